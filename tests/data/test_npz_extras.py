"""The CLI's .npz with extra model inputs (x_train + train_<name>), integer dtypes kept, and --model hf:DIR."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from scrubnet.cli import app
from scrubnet.data.user import UserDataError, load_user_data
from scrubnet.models.call import ModelInputs

runner = CliRunner()


def write(path, **arrays):
    np.savez(path, **arrays)
    return path


def test_extras_round_trip_with_their_dtypes(tmp_path):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 50, (6, 5)).astype(np.int64)
    mask = (rng.random((6, 5)) > 0.3).astype(np.int64)
    types = np.zeros((6, 5), dtype=np.int32)
    p = write(tmp_path / "d.npz", x_train=ids, train_attention_mask=mask, train_token_type_ids=types,
              y_train=np.arange(6) % 2, x_test=ids[:3], test_attention_mask=mask[:3],
              test_token_type_ids=types[:3], y_test=np.array([0, 1, 0]))
    ud = load_user_data(p)
    assert isinstance(ud.x, ModelInputs) and set(ud.x.extras) == {"attention_mask", "token_type_ids"}
    assert ud.x.main.dtype == torch.int64 and torch.equal(ud.x.main, torch.from_numpy(ids))
    assert ud.x.extras["attention_mask"].dtype == torch.int64
    assert ud.x.extras["token_type_ids"].dtype == torch.int32
    assert torch.equal(ud.x_test.extras["attention_mask"], torch.from_numpy(mask[:3]))
    # a float input is still float32, an unsigned 16-bit one becomes int64
    ud2 = load_user_data(write(tmp_path / "f.npz", x_train=rng.random((4, 3)), y_train=np.arange(4) % 2,
                               train_ids=rng.integers(0, 9, (4, 2)).astype(np.uint16)))
    assert ud2.x.main.dtype == torch.float32 and ud2.x.extras["ids"].dtype == torch.int64
    # the fingerprint sees the extras
    ud3 = load_user_data(write(tmp_path / "g.npz", x_train=ids, train_attention_mask=1 - mask, y_train=np.arange(6) % 2,
                               x_test=ids[:3], test_attention_mask=mask[:3], y_test=np.array([0, 1, 0])))
    ud4 = load_user_data(write(tmp_path / "h.npz", x_train=ids, train_attention_mask=mask, y_train=np.arange(6) % 2,
                               x_test=ids[:3], test_attention_mask=mask[:3], y_test=np.array([0, 1, 0])))
    assert ud3.fingerprint != ud4.fingerprint


@pytest.mark.parametrize("arrays, needle", [
    (dict(train_mask=np.ones((3, 2)), x_test=np.ones((2, 2)), y_test=np.zeros(2, int)), "differ"),
    (dict(train_mask=np.ones((2, 2))), "train_mask holds 2 samples"),
    (dict(mask=np.ones((3, 2))), "unexpected array(s) mask"),
    (dict(test_mask=np.ones((3, 2))), "without x_test"),
])
def test_bad_extras_are_refused(tmp_path, arrays, needle):
    p = write(tmp_path / "d.npz", x_train=np.ones((3, 2)), y_train=np.array([0, 1, 0]), **arrays)
    with pytest.raises(UserDataError) as e:
        load_user_data(p)
    assert needle in str(e.value)


def test_hf_directory_with_mask_through_the_cli(tmp_path):
    pytest.importorskip("transformers")
    from tests.hf_models import tiny_bert, token_batch

    m = tiny_bert()
    m.save_pretrained(tmp_path / "bert")
    b, t = token_batch(30), token_batch(10, seed=3)
    data = write(tmp_path / "d.npz", x_train=b["input_ids"].numpy(), train_attention_mask=b["attention_mask"].numpy(),
                 y_train=b["labels"].numpy(), x_test=t["input_ids"].numpy(),
                 test_attention_mask=t["attention_mask"].numpy(), y_test=t["labels"].numpy())
    (tmp_path / "ids.txt").write_text("0,1,2\n")
    out = tmp_path / "out.safetensors"
    r = runner.invoke(app, ["forget", "--model", f"hf:{tmp_path / 'bert'}", "--weights",
                            str(tmp_path / "bert" / "model.safetensors"), "--data", str(data), "--forget-ids",
                            str(tmp_path / "ids.txt"), "--method", "finetune", "--out", str(out)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["evaluate", "--model", f"hf:{tmp_path / 'bert'}", "--weights", str(tmp_path / "bert" /
                            "model.safetensors"), "--data", str(data), "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    got = json.loads((tmp_path / "r.json").read_text())
    with torch.no_grad():
        logits = m(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits
    assert got["loss_test"] == pytest.approx(float(F.cross_entropy(logits, t["labels"])), rel=1e-5)
    r = runner.invoke(app, ["evaluate", "--model", f"hf:{tmp_path / 'nothing'}", "--weights", str(out),
                            "--data", str(data)])
    assert r.exit_code == 2 and r.output.startswith("error:") and "no such directory" in r.output, r.output
    (tmp_path / "plain").mkdir()
    r = runner.invoke(app, ["evaluate", "--model", f"hf:{tmp_path / 'plain'}", "--weights", str(out),
                            "--data", str(data)])
    assert r.exit_code == 2 and r.output.startswith("error:") and "config.json" in r.output, r.output


def test_an_integer_input_the_model_cannot_take_is_named_with_its_dtype(tmp_path):
    from scrubnet.own_model import OwnModelError, num_outputs

    net = torch.nn.Linear(4, 3)
    with pytest.raises(OwnModelError, match="x int64 \\(4,\\)"):
        num_outputs(net, torch.ones(2, 4, dtype=torch.int64))
