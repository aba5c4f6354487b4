"""The "Your own model" guide's command-line blocks run verbatim, in the session's one run of the site
(``docs_run``, tests/docs_blocks.py: its blocks run in order in one temporary directory with the venv's
``python`` and ``scrubnet`` first on PATH); these tests check what those blocks wrote and printed."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
PAGE = "docs/guides/own-model.md"


def own_model_block(index: int = 0) -> str:
    """The ``index``-th ```bash block of the guide docs/guides/own-model.md."""
    text = (ROOT / "docs" / "guides" / "own-model.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert len(blocks) > index, "missing bash block in docs/guides/own-model.md"
    return blocks[index]


def test_readme_own_model_block_runs_verbatim(docs_run):
    block = own_model_block()
    assert "scrubnet forget --model" in block and "scrubnet evaluate --model" in block
    r = docs_run.block(PAGE, block)
    assert r.returncode == 0, r.failure()
    own = docs_run.site_dir / "own"
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


def test_the_masked_text_model_block_runs_verbatim(docs_run):
    """The second block: a factory whose forward needs ``attention_mask``, token ids and the mask in the .npz,
    Fisher, Newton and NTK from the command line, then ``scrubnet evaluate``; no traceback anywhere."""
    import numpy as np
    import torch

    block = own_model_block(1)
    assert "train_attention_mask" in block and "--method $m" in block and "scrubnet evaluate --model" in block
    r = docs_run.block(PAGE, block)
    assert r.returncode == 0, r.failure()
    assert "Traceback" not in r.stdout + r.stderr
    own = docs_run.site_dir / "own-text"
    with np.load(own / "reviews.npz") as z:
        assert z["x_train"].dtype == np.int64 and set(z.files) == {
            "x_train", "train_attention_mask", "y_train", "x_test", "test_attention_mask", "y_test"}
        ids, mask = torch.from_numpy(z["x_train"]), torch.from_numpy(z["train_attention_mask"])
    assert (mask == 0).any()
    keys = set(load_file(str(own / "text-fisher.safetensors")))
    for m in ("fisher", "newton", "ntk"):
        meta = json.loads((own / f"text-{m}.safetensors.json").read_text())
        assert meta["method"] == m and meta["forget_ids"] == list(range(10))
        assert set(load_file(str(own / f"text-{m}.safetensors"))) == keys
        assert f"wrote text-{m}.safetensors" in r.stdout
    readouts = json.loads((own / "text-ntk.json").read_text())
    for k in ("error_retain", "error_forget", "error_test", "loss_retain"):
        assert k in readouts
    # the evaluation read the mask: the scrubbed model, run with the mask by hand, gives the same retain loss
    sys.path.insert(0, str(own))
    try:
        from textnet import make_textnet
    finally:
        sys.path.remove(str(own))
    net = make_textnet()
    net.load_state_dict(load_file(str(own / "text-ntk.safetensors")))
    with np.load(own / "reviews.npz") as z:
        forget = set(range(10))
        keep = torch.tensor([i not in forget for i in range(len(z["y_train"]))])
        y = torch.from_numpy(z["y_train"])
    with torch.no_grad():
        with_mask = torch.nn.functional.cross_entropy(net.eval()(ids[keep], attention_mask=mask[keep]), y[keep])
    assert readouts["loss_retain"] == pytest.approx(float(with_mask), rel=1e-4, abs=1e-6)
    assert readouts["error_retain"] <= 0.05
