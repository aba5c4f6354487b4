"""Deleting a person from the synthetic-TOFU model through the command line and the service.

The CI-size GPT-2 (≈ 0.1 M parameters, a few pretraining epochs on the public people) is fine-tuned on the
private people's question–answer pairs with ``mlforget finetune --strategy sharded --task memorisation`` (a
memorisation task: the chance guard scores the aggregate on its own training answers; a held-out question
about an unseen person has no answer to find). One person's pairs are deleted by ``mlforget forget`` and a second
person's by a POST to ``scrubnet serve``, whose signed receipt verifies and names the engine and the shards
retrained; the checkpoint then equals a fresh sharded fine-tune on D ∖ D_f (both people gone) bit for bit.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("transformers")
pytest.importorskip("faker")
pytest.importorskip("starlette")
pytest.importorskip("cryptography")

from scrubnet.cli import app  # noqa: E402
from scrubnet.experiments.checkpoints import ml_data_loader  # noqa: E402
from scrubnet.experiments.tofu import prepare, pretrain, tofu_config  # noqa: E402
from scrubnet.mlforget import store  # noqa: E402
from scrubnet.mlforget.ftstore import load_base, located_base  # noqa: E402
from scrubnet.mlforget.sharded import sharded_finetune  # noqa: E402
from scrubnet.models.lora import LoRA  # noqa: E402
from scrubnet.training.lm import encode  # noqa: E402

CFG = tofu_config("ci", n_private=6, n_public=6, pretrain_epochs=5)
SHARDED = dict(shards=2, slices=2, epochs=40, lr=2e-2, batch_size=16)


def cli(*args):
    res = CliRunner().invoke(app, [str(a) for a in args])
    return res.exit_code, res.output


@pytest.fixture(scope="module")
def tofu(tmp_path_factory):
    """(directory, the private pairs) with ``lm/`` (the pretrained base, saved as a downloaded model) and
    ``d.npz`` (the private people's pairs: token ids, attention mask, answer-token labels)."""
    tmp = tmp_path_factory.mktemp("tofu_person")
    torch.manual_seed(0)
    data, tok = prepare(CFG)
    base, _ = pretrain(data, tok, CFG)
    base.save_pretrained(tmp / "lm")
    qa = data.questions(range(data.n_private))
    b = encode(tok, [q.question for q in qa], [q.answer for q in qa])
    np.savez(tmp / "d.npz", x_train=b["input_ids"].numpy(), train_attention_mask=b["attention_mask"].numpy(),
             y_train=b["labels"].numpy())
    return tmp, qa


def test_a_person_is_deleted_through_the_cli_and_the_service(tofu, tmp_path):
    root, qa = tofu
    ck = tmp_path / "ck"
    opts = [a for k, v in SHARDED.items() for a in (f"--{k.replace('_', '-')}", v)]
    code, out = cli("mlforget", "finetune", "--model", f"hf:{root / 'lm'}", "--data", root / "d.npz",
                    "--user-weights", "lora:c_attn,c_proj,c_fc:r8", "--strategy", "sharded", "--task",
                    "memorisation", *opts, "--out", ck)
    assert code == 0 and "training-answer error" in out, out
    check = store.requests(ck)[0]["solver"]["chance_check"]
    assert check["error"] < check["chance_interval"][0]
    person = {p: [i for i, q in enumerate(qa) if q.person == p] for p in sorted({q.person for q in qa})}
    assert all(len(v) == 20 for v in person.values())
    # the first person through the command line
    code, out = cli("mlforget", "forget", ck, "--ids", ",".join(map(str, person[0])))
    assert code == 0 and "forgot 20 samples" in out, out
    st, static = store.load(ck)
    net = load_base(located_base(static["finetune"], ck))
    x, y = ml_data_loader({**static, "checkpoint_dir": str(ck)})
    lora = LoRA(["c_attn", "c_proj", "c_fc"], 8)

    def fresh(gone):
        keep = torch.tensor([i for i in range(len(y)) if i not in gone])
        return sharded_finetune(net, x[keep], y[keep], ids=keep, user_weights=lora, seed=0, **SHARDED)

    req = store.requests(ck)[1]["solver"]
    assert req["engine"] == "sharded" and req["shards_retrained"] and req["sample_passes"] > 0
    # the second person through the service: applied, signed, the receipt verifies
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from starlette.testclient import TestClient

    from scrubnet.serve import receipts
    from scrubnet.serve.app import create_app
    from scrubnet.serve.auth import Token
    key = Ed25519PrivateKey.generate()
    tokens = {"tok-submit-000000001": Token("dpo", frozenset({"submit", "read"}))}
    srv = create_app(ck, tokens, key, ml_data_loader)
    with TestClient(srv) as client:
        hdr = {"Authorization": "Bearer tok-submit-000000001", "Idempotency-Key": "person-1"}
        r = client.post("/v1/requests", json={"ids": person[1]}, headers=hdr)
        assert r.status_code == 202, r.text
        done = None
        for _ in range(6000):  # the worker applies and signs; bounded polling
            done = client.get(f"/v1/requests/{r.json()['id']}", headers=hdr).json()
            if done["status"] != "queued" and done.get("receipt"):
                break
            srv.state.worker.wake.set()
            time.sleep(0.05)
        weights = client.get("/v1/model/weights", headers=hdr).content
    assert done["status"] == "applied", done
    rec = done["receipt"]
    assert receipts.verify_receipt(rec, key.public_key(), weights=weights, ids=person[1],
                                   salt=r.json()["salt"]) == []
    assert rec["solver"]["engine"] == "sharded" and rec["solver"]["shards_retrained"]
    assert rec["verdict"]["verdict"] == "exact" and store.verify(ck)["valid"]
    a, b = store.load(ck)[0].model.state_dict(), fresh(set(person[0]) | set(person[1])).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
