"""The "Your own model" guide's command-line block runs verbatim: it is extracted from
docs/guides/own-model.md and run with bash in a
temporary directory (the venv's ``python`` and ``scrubnet`` first on PATH, this checkout on PYTHONPATH)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


def own_model_block() -> str:
    """The first ```bash block of the guide docs/guides/own-model.md."""
    text = (ROOT / "docs" / "guides" / "own-model.md").read_text()
    m = re.search(r"```bash\n(.*?)```", text, re.S)
    assert m, "no bash block in docs/guides/own-model.md"
    return m.group(1)


def test_readme_own_model_block_runs_verbatim(tmp_path):
    block = own_model_block()
    assert "scrubnet forget --model" in block and "scrubnet evaluate --model" in block
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", SCRUBNET_THREADS="1",
               OMP_NUM_THREADS="1")
    r = subprocess.run(["bash", "-e", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    own = tmp_path / "own"
    for m in ("finetune", "fisher", "newton", "ntk"):
        out = own / f"scrubbed-{m}.safetensors"
        meta = json.loads((own / f"scrubbed-{m}.safetensors.json").read_text())
        assert meta["method"] == m and meta["forget_ids"] == list(range(10))
        assert set(load_file(str(out))) == set(load_file(str(own / "scrubbed-finetune.safetensors")))
        assert f"wrote scrubbed-{m}.safetensors" in r.stdout
    readouts = json.loads((own / "newton.json").read_text())
    for k in ("error_retain", "error_forget", "error_test", "reference_error_forget", "activation_l1_forget",
              "weight_distance"):
        assert k in readouts
    # the scrub kept the model: retain error stays at a few points (the model fits its 300 samples)
    assert readouts["error_retain"] <= 0.05 and readouts["error_test"] <= 0.3
