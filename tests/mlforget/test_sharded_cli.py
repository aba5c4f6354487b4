"""The sharded engine through every surface: ``mlforget finetune --strategy sharded|auto``, a deletion by
``mlforget forget`` that equals a fresh sharded fine-tune on D ∖ D_f bit for bit, ``show``, the service
applying a request and a receipt that verifies and names the engine and what was retrained; and the chance
guard: no ``finetune`` exits 0 with a held-out error within the chance interval."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from scrubnet.cli import app
from scrubnet.experiments.checkpoints import ml_data_loader
from scrubnet.mlforget import store
from scrubnet.mlforget.ftstore import load_base, located_base
from scrubnet.mlforget.sharded import sharded_finetune
from scrubnet.models.lora import LoRA

MODEL_FILE = '''
import torch
from torch import nn


class Net(nn.Module):
    """Features that see only x[:, :4]; the user's task may need x[:, 4:] (then the features must move)."""

    def __init__(self, dead=False):
        super().__init__()
        self.feat, self.head = nn.Linear(8, 16), nn.Linear(16, 2)
        self.dead = dead

    def forward(self, x):
        return self.head(torch.tanh(self.feat(x)) - (1e3 if self.dead else 0.0))


def net(dead=False):
    return Net(dead)
'''


def task(n: int, seed: int, col: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, col] > 0).long()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(model file, weights, data .npz whose label needs the input the pretrained features ignore)."""
    tmp = tmp_path_factory.mktemp("sharded")
    (tmp / "net.py").write_text(MODEL_FILE)
    import importlib.util
    spec = importlib.util.spec_from_file_location("sharded_cli_net", tmp / "net.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    net = mod.net()
    with torch.no_grad():
        net.feat.weight[:, 4:] = 0.0  # pretrained on a task of the first four inputs
        net.feat.weight[:, :4] *= 3.0  # saturated features: the tangent model cannot bring in x[:, 4:]
    torch.save(net.state_dict(), tmp / "w.pt")
    x, y = task(240, 1, col=6)
    np.savez(tmp / "d.npz", x_train=x.numpy(), y_train=y.numpy())
    return tmp / "net.py", tmp / "w.pt", tmp / "d.npz"


def cli(*args):
    res = CliRunner().invoke(app, [str(a) for a in args])
    return res.exit_code, res.output


SHARDED = ["--shards", 3, "--slices", 2, "--epochs", 8, "--lr", 0.05, "--batch-size", 16]
UW = ["--user-weights", "lora:feat:r2:save=head"]


def test_auto_chooses_sharded_and_cli_deletion_equals_fresh_sharded_finetune(files, tmp_path):
    model_file, weights, npz = files
    base = ["mlforget", "finetune", "--model", f"{model_file}:net", "--weights", weights, "--data", npz, *UW]
    code, out = cli(*base, "--strategy", "auto", *SHARDED, "--out", tmp_path / "ck")
    assert code == 0, out
    line = next(ln for ln in out.splitlines() if ln.startswith("strategy auto="))
    assert line.startswith("strategy auto=sharded: ") and "held-out error linearised" in line, out
    st, static = store.load(tmp_path / "ck")
    assert static["finetune"]["engine"] == "sharded" and static["finetune"]["preflight"]["engine"] == "sharded"
    pre = static["finetune"]["preflight"]
    assert pre["linearised_error"] > pre["ordinary_error"] + 0.02
    # two deletions through the command line
    for ids in ("3,17,40", "5"):
        code, out = cli("mlforget", "forget", tmp_path / "ck", "--ids", ids)
        assert code == 0 and "forgot" in out, out
    st, static = store.load(tmp_path / "ck")
    reqs = store.requests(tmp_path / "ck")
    assert reqs[1]["solver"]["engine"] == "sharded" and reqs[1]["solver"]["shards_retrained"]
    # a fresh sharded fine-tune of the same base (as the checkpoint loads it) on D ∖ D_f, same seeds
    net = load_base(located_base(static["finetune"], tmp_path / "ck"))
    x, y = ml_data_loader({**static, "checkpoint_dir": str(tmp_path / "ck")})
    keep = torch.tensor([i for i in range(len(y)) if i not in (3, 5, 17, 40)])
    fresh = sharded_finetune(net, x[keep], y[keep], ids=keep, user_weights=LoRA(["feat"], 2, None, ["head"]),
                             shards=3, slices=2, epochs=8, lr=0.05, batch_size=16, seed=0)
    a, b = st.model.state_dict(), fresh.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    code, out = cli("mlforget", "show", tmp_path / "ck")
    assert code == 0 and "hash chain: valid" in out, out
    # the service applies a third request; its signed receipt verifies and says what was retrained
    pytest.importorskip("starlette")
    pytest.importorskip("cryptography")
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from starlette.testclient import TestClient

    from scrubnet.serve import receipts
    from scrubnet.serve.app import create_app
    from scrubnet.serve.auth import Token
    key = Ed25519PrivateKey.generate()
    tokens = {"tok-submit-000000001": Token("alice", frozenset({"submit", "read"}))}
    srv = create_app(tmp_path / "ck", tokens, key, ml_data_loader)
    with TestClient(srv) as client:
        hdr = {"Authorization": "Bearer tok-submit-000000001", "Idempotency-Key": "k1"}
        r = client.post("/v1/requests", json={"ids": [60, 61]}, headers=hdr)
        assert r.status_code == 202, r.text
        done = None
        for _ in range(3000):  # the worker applies and signs; bounded polling
            done = client.get(f"/v1/requests/{r.json()['id']}", headers=hdr).json()
            if done["status"] != "queued" and done.get("receipt"):
                break
            srv.state.worker.wake.set()
            time.sleep(0.05)
        weights = client.get("/v1/model/weights", headers=hdr).content
    assert done["status"] == "applied", done
    rec = done["receipt"]
    assert receipts.verify_receipt(rec, key.public_key(), weights=weights, ids=[60, 61], salt=r.json()["salt"]) == []
    assert rec["solver"]["engine"] == "sharded" and rec["solver"]["shards_retrained"]
    assert "retrain" in rec["verdict"]["basis"] and rec["verdict"]["verdict"] == "exact"
    assert store.verify(tmp_path / "ck")["valid"]
    keep = torch.tensor([i for i in range(len(y)) if i not in (3, 5, 17, 40, 60, 61)])
    fresh = sharded_finetune(net, x[keep], y[keep], ids=keep, user_weights=LoRA(["feat"], 2, None, ["head"]),
                             shards=3, slices=2, epochs=8, lr=0.05, batch_size=16, seed=0)
    a, b = store.load(tmp_path / "ck")[0].model.state_dict(), fresh.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # forget-all: every shard back at the pretrained point, holding nothing
    code, out = cli("mlforget", "forget-all", tmp_path / "ck")
    assert code == 0, out
    sd = store.load(tmp_path / "ck")[0].model.state_dict()
    assert all(torch.equal(v, sd["init/" + k.split("/", 2)[2]]) for k, v in sd.items() if k.startswith("s"))
    assert all(int(v) == 0 for k, v in sd.items() if k.startswith("held/"))
    assert store.requests(tmp_path / "ck")[-1]["solver"]["engine"] == "sharded" and store.verify(tmp_path / "ck")["valid"]


@pytest.mark.parametrize("strategy, extra", [("linearised", ["--mu", "0.05"]), ("linearised", ["--mu", "1e-4"]),
                                             ("linearised", ["--mu", "auto"]), ("sharded", SHARDED),
                                             ("auto", SHARDED)])
def test_no_finetune_exits_0_at_chance(files, tmp_path, strategy, extra):
    """Dead features (the head sees a constant): every engine, every µ is at chance → one error line, exit 2,
    nothing written."""
    model_file, weights, npz = files
    code, out = cli("mlforget", "finetune", "--model", f"{model_file}:net", "--model-option", "dead=true",
                    "--weights", weights, "--data", npz, "--user-weights", "layers:head", "--strategy", strategy,
                    *extra, "--out", tmp_path / "ck")
    lines = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("strategy auto=")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and "chance" in lines[0], out
    assert not (tmp_path / "ck").exists()


def test_causal_lm_on_both_engines_from_the_command_line(tmp_path):
    """A GPT-2-style LM saved like a downloaded one; token labels (the answer, −100 elsewhere). Linearised: the
    label words' logits at the answer position, a request equal to the fit without those rows (float64, to
    1e-8). Sharded: the loss on the answer tokens, a request equal to a fresh sharded fine-tune bit for bit."""
    transformers = pytest.importorskip("transformers")
    from scrubnet.mlforget.preflight import fit_engine
    cfg = transformers.GPT2Config(vocab_size=16, n_positions=10, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=4, eos_token_id=4)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "lm")
    g = torch.Generator().manual_seed(1)
    n = 80
    content = torch.randint(8, 16, (n, 8), generator=g)
    ids = torch.cat([content, (content[:, -1:] % 4)], 1)  # the answer: the class of the last content token
    labels = torch.full_like(ids, -100)
    labels[:, -1] = ids[:, -1]
    np.savez(tmp_path / "lm.npz", x_train=ids.numpy(), y_train=labels.numpy())
    base = ["mlforget", "finetune", "--model", f"hf:{tmp_path / 'lm'}", "--data", tmp_path / "lm.npz",
            "--user-weights", "lora:c_attn,c_fc:r2"]
    code, out = cli(*base, "--strategy", "linearised", "--mu", "1e-3", "--sigma", 0, "--out", tmp_path / "lin")
    assert code == 0, out
    code, out = cli("mlforget", "forget", tmp_path / "lin", "--ids", "2,9")
    assert code == 0, out
    st, static = store.load(tmp_path / "lin")
    assert static["finetune"]["task"] == {"kind": "answer-token", "label_tokens": [0, 1, 2, 3]}
    net = load_base(located_base(static["finetune"], tmp_path / "lin"))
    keep = torch.tensor([i for i in range(n) if i not in (2, 9)])
    ref = fit_engine("linearised", net, ids[keep], labels[keep], 16, user_weights=LoRA(["c_attn", "c_fc"], 2),
                     linearised={"mu": 1e-3, "sigma": 0.0}, chance_guard=False)
    w, r = st.model.delta_flat(), ref.model.delta_flat()
    assert float((w - r).abs().max() / r.abs().max()) <= 1e-8
    code, out = cli(*base, "--strategy", "sharded", "--shards", 2, "--slices", 2, "--epochs", 20, "--lr", 0.05,
                    "--batch-size", 16, "--out", tmp_path / "sh")
    assert code == 0 and "sharded engine" in out, out
    code, out = cli("mlforget", "forget", tmp_path / "sh", "--ids", "2,9")
    assert code == 0, out
    fresh = sharded_finetune(net, ids[keep], labels[keep], ids=keep, user_weights=LoRA(["c_attn", "c_fc"], 2),
                             shards=2, slices=2, epochs=20, lr=0.05, batch_size=16, seed=0)
    a, b = store.load(tmp_path / "sh")[0].model.state_dict(), fresh.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_trainer_with_the_sharded_strategy(tmp_path):
    """``ForgettableTrainer(forgettable=ForgettableArguments(strategy="sharded"))`` writes a sharded checkpoint
    (the same layout: base/, data.npz) whose request equals a fresh sharded fine-tune of the saved base."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from scrubnet.mlforget.hf import ForgettableArguments, ForgettableTrainer
    from tests.hf_models import probe_labels, tiny_bert
    model = tiny_bert(num_labels=3, seed=0)
    ids = torch.randint(1, 50, (60, 8), generator=torch.Generator().manual_seed(4))
    labels = probe_labels(model, {"input_ids": ids})
    rows = [{"input_ids": ids[i], "attention_mask": torch.ones(8, dtype=torch.long), "label": int(labels[i])}
            for i in range(60)]
    fa = ForgettableArguments(strategy="sharded", user_weights="head", shards=2, slices=2, epochs=10, lr=0.05,
                              batch_size=16)
    tr = ForgettableTrainer(model=model, args=transformers.TrainingArguments(output_dir=str(tmp_path / "ck"),
                                                                             report_to=[]),
                            train_dataset=rows, forgettable=fa)
    metrics = tr.train().metrics
    assert metrics["engine"] == "sharded"
    st, static = store.load(tmp_path / "ck")
    assert static["finetune"]["engine"] == "sharded" and static["finetune"]["data"] == "data.npz"
    record, applied = store.forget(tmp_path / "ck", [7], data_loader=ml_data_loader)
    assert applied and record["solver"]["engine"] == "sharded"
    net = load_base(located_base(static["finetune"], tmp_path / "ck"))
    x, y = ml_data_loader({**static, "checkpoint_dir": str(tmp_path / "ck")})
    keep = torch.tensor([i for i in range(60) if i != 7])
    fresh = sharded_finetune(net, x[keep], y[keep], ids=keep, user_weights=["classifier"], shards=2, slices=2,
                             epochs=10, lr=0.05, batch_size=16, seed=tr.args.seed)
    a, b = store.load(tmp_path / "ck")[0].model.state_dict(), fresh.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_trainer_on_a_causal_lm(tmp_path):
    """The trainer on a causal LM with token labels: both engines write a checkpoint and score the evaluation
    set by its answer tokens."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from scrubnet.mlforget.hf import ForgettableArguments, ForgettableTrainer
    cfg = transformers.GPT2Config(vocab_size=16, n_positions=10, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=4, eos_token_id=4)
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(cfg).eval()
    content = torch.randint(8, 16, (100, 8), generator=torch.Generator().manual_seed(1))
    ids = torch.cat([content, content[:, -1:] % 4], 1)
    labels = torch.full_like(ids, -100)
    labels[:, -1] = ids[:, -1]
    rows = [{"input_ids": ids[i], "labels": labels[i]} for i in range(100)]
    for strategy, extra in (("linearised", {"mu": 1e-3}), ("sharded", {"shards": 2, "slices": 2, "epochs": 20,
                                                                      "lr": 0.05, "batch_size": 16})):
        tr = ForgettableTrainer(model=lm, args=transformers.TrainingArguments(output_dir=str(tmp_path / strategy),
                                                                              report_to=[]),
                                train_dataset=rows[:80], eval_dataset=rows[80:],
                                forgettable=ForgettableArguments(strategy=strategy, user_weights=LoRA(["c_attn", "c_fc"], 2),
                                                                 **extra))
        metrics = tr.train().metrics
        assert metrics["engine"] == strategy and metrics["eval_accuracy"] > 0.5, metrics
        assert store.load(tmp_path / strategy)[1]["finetune"]["engine"] == strategy
