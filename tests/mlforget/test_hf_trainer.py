"""The guide's ``ForgettableTrainer`` example, run verbatim (docs/guides/mlforgetting.md) on its tiny BERT built
from a config: its output directory is a checkpoint that takes deletion requests from the command line, each
equal to a fresh forgettable fine-tune (the same trainer) without those rows; a ``PeftModel`` given as the model
is the same fine-tune as ``peft_config=``."""
from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from scrubnet.cli import app
from scrubnet.mlforget import store

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("accelerate")

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "mlforgetting.md"


def guide_block() -> str:
    """The guide's python block that uses ``ForgettableTrainer``, as written."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    found = [b for b in blocks if "ForgettableTrainer(" in b]
    assert len(found) == 1
    return found[0]


def cli(*args):
    res = CliRunner().invoke(app, [str(a) for a in args])
    return res.exit_code, res.output


def fresh(ns: dict, rows: list, out: Path, model=None, peft_config=True) -> torch.Tensor:
    """The guide's trainer, run again on ``rows`` into ``out``: the fine-tuned user weights."""
    from scrubnet.mlforget.hf import ForgettableArguments, ForgettableTrainer
    cfg = ns["trainer"].peft_config if peft_config else None
    tr = ForgettableTrainer(model=model if model is not None else ns["model"],
                            args=transformers.TrainingArguments(output_dir=str(out), report_to=[]),
                            train_dataset=rows, peft_config=cfg, forgettable=ForgettableArguments(mu=1e-3))
    tr.train()
    return store.load(out)[0].model.delta_flat()


def test_guide_trainer_example_and_exact_requests(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(guide_block(), str(GUIDE), "exec"), ns)
    ck = tmp_path / "ft-trainer"
    st, static = store.load(ck)
    assert static["finetune"]["data"] == "data.npz" and static["finetune"]["base"]["model"] == "hf:base"
    assert static["finetune"]["user_weights"]["kind"] == "lora" and len(static["user_ids"]) == 120
    metrics = ns["trainer"].forgettable_state.train_info
    assert metrics["user_weights"] == st.model.num_linearized
    # the checkpoint, moved, takes two requests from the command line
    moved = tmp_path / "elsewhere" / "ck"
    moved.parent.mkdir()
    os.rename(ck, moved)
    forgotten: list[int] = []
    for ids in ([3, 17], [40]):
        code, out = cli("mlforget", "forget", moved, "--ids", ",".join(map(str, ids)), "--sigma", 0)
        assert code == 0 and "forgot" in out, out
        forgotten += ids
    w = store.load(moved)[0].model.delta_flat()
    keep = [r for i, r in enumerate(ns["train"]) if i not in forgotten]
    ref = fresh(ns, keep, tmp_path / "fresh")
    rel = float((w - ref).abs().max() / ref.abs().max())
    print(f"requests vs a fresh forgettable fine-tune without those rows: max rel diff {rel:.2e}")
    assert rel <= 1e-8
    code, out = cli("mlforget", "show", moved)
    assert code == 0 and "hash chain: valid" in out and "3 user samples forgotten" in out, out


def test_peft_model_is_the_same_fine_tune(tmp_path):
    from tests.hf_models import tiny_bert
    model = tiny_bert(num_labels=3, seed=2)
    ids = torch.randint(1, 50, (30, 8), generator=torch.Generator().manual_seed(4))
    from tests.hf_models import probe_labels
    labels = probe_labels(model, {"input_ids": ids})  # a task its features carry: no checkpoint at chance
    rows = [{"input_ids": ids[i], "attention_mask": torch.ones(8, dtype=torch.long), "label": int(labels[i])}
            for i in range(30)]
    cfg = peft.LoraConfig(r=2, lora_alpha=2, target_modules=["query"], modules_to_save=["classifier"])
    wrapped = peft.get_peft_model(copy.deepcopy(model), copy.deepcopy(cfg))
    ns = {"model": model, "trainer": type("T", (), {"peft_config": cfg})}
    a = fresh(ns, rows, tmp_path / "a")
    b = fresh(ns, rows, tmp_path / "b", model=wrapped, peft_config=False)
    assert torch.equal(a, b)
    from scrubnet.mlforget.hf import base_and_user_weights
    with pytest.raises(ValueError, match="once"):
        base_and_user_weights(wrapped, cfg)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x").write_text("")
    with pytest.raises(ValueError, match="not empty"):
        fresh(ns, rows, tmp_path / "c")
