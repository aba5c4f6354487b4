"""Forget people from a LoRA-fine-tuned causal LM (synthetic TOFU, forget10): scrubnet's exact route against the
field's tuned approximate methods, scored as the LLM field scores it.

Prints, over the seeds, the one-line result

    tofu: exact FQ F1 (KS p >= 0.05 in K/S seeds), utility U1 vs ordinary LoRA U0; best approximate M FQ F2,
    utility U2; retain-vs-retain FQ F0; request_vs_refinetune R

then the table (:func:`scrubnet.experiments.tofu_report.render_tofu`), and writes tofu.json/md/png to --out.
The same run as ``scrubnet bench --dataset tofu-synthetic``; this script adds the preset and size knobs.

    python benchmarks/tofu.py --out /tmp/tofu                      # the committed table (CPU, 3 seeds)
    python benchmarks/tofu.py --preset quick --out /tmp/tofu-q     # minutes
    python benchmarks/tofu.py --preset gpu --out /tmp/tofu-gpu     # the larger model (≈ 1 M parameters)
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from scrubnet.experiments.tofu import PRESETS, run_tofu, summary_line, tofu_config
from scrubnet.experiments.tofu_report import render_tofu, write_tofu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="default", choices=sorted(PRESETS))
    ap.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default: the preset's)")
    ap.add_argument("--exact", default=None, choices=["retrain", "sharded"])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override a TofuConfig field, e.g. --set finetune_epochs=60")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    over = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    if args.seeds is not None:
        over["seeds"] = tuple(range(args.seeds))
    if args.exact is not None:
        over["exact"] = args.exact
    for k in ("seeds", "methods", "lr_grid"):
        if isinstance(over.get(k), list):
            over[k] = tuple(over[k])
    cfg = tofu_config(args.preset, **over)
    t0 = time.time()
    res = run_tofu(cfg, progress=lambda s: print(f"[{time.time() - t0:6.0f} s] {s}", flush=True))
    write_tofu(res, args.out)
    print(render_tofu(res))
    print(summary_line(res))


if __name__ == "__main__":
    main()
