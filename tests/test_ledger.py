"""The ML checkpoint's request ledger: exactly-once requests, refusals, and real kills mid-request."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from scrubnet.cli_mlforget import mlforget_app
from scrubnet.mlforget import store

DATA = '{"num_samples": 1000, "n_train_per_class": 20, "n_test_per_class": 10, "forget_count": 2}'
TRAIN = '{"pretrain_epochs": 2, "max_epochs": 5}'
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("ml") / "ckpt"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    res = CliRunner().invoke(mlforget_app, ["train", "--out", str(out), "--data-options", DATA, "--train-options",
                                            TRAIN, "--model-options", '{"hidden": 16}'])
    torch.set_num_threads(n)
    assert res.exit_code == 0, res.output
    return out


def deletable(path, k=3):
    meta = json.loads((Path(path) / "state.json").read_text())
    core = set(meta["core_ids"])
    return [i for i in meta["user_ids"] if i not in core][:k]


def cli_inprocess(*args):
    """Run a command in this process; returns (exit code, output)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = CliRunner().invoke(mlforget_app, [str(a) for a in args])
    finally:
        torch.set_num_threads(n)
    return r.exit_code, r.output


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "scrubnet.cli_mlforget", *map(str, args)], capture_output=True,
                          text=True, env=env or ENV, timeout=120)


def snapshot(path):
    return {f.name: f.read_bytes() for f in Path(path).iterdir()}


@pytest.fixture(scope="module")
def reference(base_ckpt, tmp_path_factory):
    """The checkpoint after one uninterrupted request."""
    ref = tmp_path_factory.mktemp("ref") / "ckpt"
    shutil.copytree(base_ckpt, ref)
    ids = deletable(ref)
    r = cli("forget", ref, "--ids", ",".join(map(str, ids)))
    assert r.returncode == 0, r.stderr
    return ref, ids


# one stage before the commit (weights file half-written), one during it (state record half-written), one
# after it (ledger line half-written); the other pause points behave like their neighbours
@pytest.mark.parametrize("stage", ["weights_partial", "state_partial", "ledger_partial"])
def test_request_killed_midway_is_applied_exactly_once(base_ckpt, reference, tmp_path, stage):
    ref, ids = reference
    ck = tmp_path / "ckpt"
    shutil.copytree(base_ckpt, ck)
    before = snapshot(ck)
    proc = subprocess.Popen([sys.executable, "-m", "scrubnet.cli_mlforget", "forget", str(ck), "--ids",
                             ",".join(map(str, ids))], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, store.PAUSE_ENV: stage})
    line = proc.stdout.readline()
    assert line.strip() == f"PAUSED {stage}", proc.stderr.read() if not line else line
    proc.kill()  # SIGKILL: no cleanup handlers run
    proc.wait(timeout=30)
    after_kill = snapshot(ck)
    committed = stage in ("after_commit", "ledger_partial")
    if not committed:
        # the previous checkpoint and ledger are intact (a stray temp/orphan file at most)
        for name in ("state.json", "ledger.jsonl", "weights-000000.safetensors"):
            assert after_kill[name] == before[name]
        state, meta = store.load(ck)
        assert meta["seq"] == 0 and len(state.forgotten_ids) == 0
    # re-run the same request: it completes, once
    r = cli("forget", ck, "--ids", ",".join(map(str, ids)))
    assert r.returncode == 0, r.stderr
    assert ("already applied" in r.stdout) == committed
    ledger = store.read_ledger(ck)
    assert [e["seq"] for e in ledger] == [0, 1]
    assert ledger[1]["ids"] == ids and ledger[1]["kind"] == "forget"
    ref_meta = json.loads((ref / "state.json").read_text())
    meta = json.loads((ck / "state.json").read_text())
    assert meta["weights_sha256"] == ref_meta["weights_sha256"]  # same weights as the uninterrupted run
    assert meta["forgotten_ids"] == sorted(ids)
    assert sorted(f.name for f in ck.iterdir()) == ["ledger.jsonl", "state.json", "weights-000001.safetensors"]
    assert ledger[1]["sha256_before"] == ledger[0]["sha256_after"]
    assert ledger[1]["sha256_after"] == meta["weights_sha256"]


def test_ledger_records_and_refusals(reference, tmp_path):
    ref, ids = reference
    ck = tmp_path / "ckpt"
    shutil.copytree(ref, ck)
    e = store.read_ledger(ck)[1]
    for k in ("ids", "n_ids", "sigma", "steps", "seconds", "time", "residual_norm", "sha256_before", "sha256_after"):
        assert k in e
    assert e["residual_norm"] < 1e-4 and e["n_ids"] == len(ids)
    code, out = cli_inprocess("forget", ck, "--ids", ids[0])
    assert code == 2 and "already forgotten" in out
    meta = json.loads((ck / "state.json").read_text())
    code, out = cli_inprocess("forget", ck, "--ids", meta["core_ids"][0])
    assert code == 2 and "core data" in out
    code, out = cli_inprocess("forget", ck, "--ids", "1,x")
    assert code == 2 and "not an integer" in out
    code, out = cli_inprocess("forget", ck)
    assert code == 2 and "exactly one of --ids" in out
    assert snapshot(ck) == snapshot(ref)  # refused requests change nothing
    code, out = cli_inprocess("forget-all", ck)
    assert code == 0, out
    state, meta = store.load(ck)
    assert torch.equal(state.model.delta_flat(), torch.zeros_like(state.model.delta_flat()))
    x = torch.randn(4, 40)
    assert torch.equal(state.model(x), state.model.base(x))
    assert [e["kind"] for e in store.read_ledger(ck)] == ["train", "forget", "forget_all"]


def test_train_refuses_existing_output_and_bad_options(base_ckpt, tmp_path):
    r = CliRunner().invoke(mlforget_app, ["train", "--out", str(base_ckpt)])
    assert r.exit_code == 2 and "already exists" in r.output
    r = CliRunner().invoke(mlforget_app, ["train", "--out", str(tmp_path / "new"), "--ml-options", '{"mu": -1}'])
    assert r.exit_code == 2 and "mu must be positive" in r.output
    assert not (tmp_path / "new").exists()
    r = CliRunner().invoke(mlforget_app, ["forget", str(tmp_path / "nothing"), "--ids", "1"])
    assert r.exit_code == 2 and "not found" in r.output
