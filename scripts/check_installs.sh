#!/usr/bin/env bash
# Every install the README names works on a clean machine: a venv made with `pip install -e .` alone (no extras)
# runs `scrubnet --help` and a short real command (train, then forget, on the tiny embedded configuration); then
# each extra the docs tell users to install (serve, hf, ray) is added to that venv and exercised by a command
# that needs it. The test suite runs in a separate venv with `.[test]`, whose documentation toolchain pulls in
# packages (click among them) that a plain install lacks, so this is the only check of what users get.
#
#   bash scripts/check_installs.sh [VENV_DIR]        (default: a fresh temporary directory, removed at the end)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
venv=${1:-$(mktemp -d)/base-venv}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 SCRUBNET_TINY=1
step() { printf 'install check: %s\n' "$*"; }

step "base: python3 -m venv + pip install -e . (no extras)"
python3 -m venv "$venv"
"$venv/bin/pip" install -q -e "$repo"
"$venv/bin/scrubnet" --help >/dev/null
# a short real command: the original / retrain checkpoints, then one scrub of them
"$venv/bin/scrubnet" train --out "$work/ckpt" >/dev/null 2>&1 || { "$venv/bin/scrubnet" train --out "$work/ckpt2"; exit 1; }
"$venv/bin/scrubnet" forget --checkpoint "$work/ckpt/original.safetensors" --forget-ids "$work/ckpt/forget_ids.txt" \
    --method finetune --out "$work/ckpt/scrubbed.safetensors" >/dev/null
test -s "$work/ckpt/scrubbed.safetensors"
# no module of the package needs more than the base dependencies at import time (the extras' subpackages aside)
"$venv/bin/python" - <<'PY'
import importlib, pkgutil, scrubnet
EXTRA_ONLY = ("scrubnet.serve",)
bad = []
for m in pkgutil.walk_packages(scrubnet.__path__, "scrubnet."):
    if m.name.startswith(EXTRA_ONLY) or m.name.endswith(".__main__"):   # __main__ runs the CLI
        continue
    try:
        importlib.import_module(m.name)
    except ImportError as e:
        bad.append(f"{m.name}: {e}")
if bad:
    raise SystemExit("modules that a plain install cannot import:\n  " + "\n  ".join(bad))
PY
step "base: ok"

step "extra serve: pip install -e .[serve], then a request over HTTP"
"$venv/bin/pip" install -q -e "$repo[serve]"
"$venv/bin/python" scripts/serve_smoke.py "$venv/bin/scrubnet" "$work/serve"
step "serve: ok"

step "extra hf: pip install -e .[hf], then --model hf:DIR on a tiny model built from a config"
"$venv/bin/pip" install -q -e "$repo[hf]"
"$venv/bin/python" - "$work/hf" <<'PY'
import sys
from pathlib import Path
import numpy as np, torch
from transformers import BertConfig, BertForSequenceClassification
out = Path(sys.argv[1]); out.mkdir(parents=True)
torch.manual_seed(0)
m = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32, num_labels=3))
m.save_pretrained(out / "bert-tiny")
# labels the model's features carry (the fine-tune refuses a model left at chance, as on unlearnable labels)
x = torch.randint(1, 50, (60, 8))
s = m.bert(input_ids=x).pooler_output.detach() @ torch.randn(16)
y = torch.bucketize(s, s.quantile(torch.tensor([1 / 3, 2 / 3])))
np.savez(out / "ft.npz", x_train=x.numpy(), train_attention_mask=np.ones((60, 8), int), y_train=y.numpy())
PY
"$venv/bin/scrubnet" mlforget finetune --model "hf:$work/hf/bert-tiny" --data "$work/hf/ft.npz" \
    --user-weights lora:query,value:r4:save=classifier --mu 1e-4 --out "$work/hf/ml-ft/" >/dev/null 2>&1
"$venv/bin/scrubnet" mlforget forget --checkpoint "$work/hf/ml-ft/" --ids 17,22 >/dev/null
step "hf: ok"

step "extra ray: pip install -e .[ray], then Ray starts and runs a task"
"$venv/bin/pip" install -q -e "$repo[ray]"
"$venv/bin/python" - <<'PY'
import ray
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
try:
    assert ray.get(ray.remote(lambda a: a + 1).remote(1)) == 2
finally:
    ray.shutdown()
PY
step "ray: ok"
step "every install the README names works"
