import json

import pytest
import torch

from scrubnet.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, sidecar_path
from scrubnet.models import build_model


def _save(tmp_path, name="m.safetensors", arch="cnn2d"):
    m = build_model(arch, (1, 8, 8), 3, seed=0)
    p = tmp_path / name
    save_checkpoint(p, m, arch=arch, in_shape=(1, 8, 8), num_classes=3, seed=0, config={"a": 1})
    return m, p


def test_roundtrip_includes_batchnorm_buffers(tmp_path):
    m, p = _save(tmp_path)
    with torch.no_grad():
        m.features[1].running_mean.fill_(0.5)
    save_checkpoint(p, m, arch="cnn2d", in_shape=(1, 8, 8), num_classes=3)
    m2, meta = load_checkpoint(p)
    for (k, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), k
    assert meta["arch"] == "cnn2d" and len(meta["sha256"]) == 64
    assert not list(tmp_path.glob(".*.tmp"))


def test_missing_and_corrupt(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "nope.safetensors")
    _, p = _save(tmp_path)
    data = bytearray(p.read_bytes())
    data[-5] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(p)
    _, p2 = _save(tmp_path, "b.safetensors")
    sidecar_path(p2).write_text("{not json")
    with pytest.raises(CheckpointError, match="sidecar"):
        load_checkpoint(p2)
    _, p3 = _save(tmp_path, "c.safetensors")
    sidecar_path(p3).unlink()
    with pytest.raises(CheckpointError, match="no sidecar"):
        load_checkpoint(p3)


def test_garbage_file_with_matching_hash_is_rejected(tmp_path):
    _, p = _save(tmp_path)
    p.write_bytes(b"this is not safetensors")
    meta = json.loads(sidecar_path(p).read_text())
    import hashlib
    meta["sha256"] = hashlib.sha256(b"this is not safetensors").hexdigest()
    sidecar_path(p).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="safetensors"):
        load_checkpoint(p)


def test_other_architecture_and_shapes(tmp_path):
    _, p = _save(tmp_path)
    with pytest.raises(CheckpointError, match="expected 'mlp'"):
        load_checkpoint(p, expect_arch="mlp")
    with pytest.raises(CheckpointError, match="does not match"):
        load_checkpoint(p, model=build_model("mlp", (1, 8, 8), 3))
    with pytest.raises(CheckpointError, match="shape"):
        load_checkpoint(p, model=build_model("cnn2d", (1, 8, 8), 5))


@pytest.mark.parametrize("damage,reason", [("flip", "hash mismatch"), ("truncate", "truncated"),
                                           ("fill_7f", "hash mismatch")])
def test_bit_flips_truncation_and_7f_bytes_are_named(tmp_path, damage, reason):
    import corrupt
    m = build_model("mlp", (40,), 10, seed=0, hidden=64)
    p = tmp_path / "w.safetensors"
    save_checkpoint(p, m, arch="mlp", in_shape=(40,), num_classes=10, arch_options={"hidden": 64})
    assert p.stat().st_size > 5000
    {"flip": lambda f: corrupt.flip_exponent_bits(f, 2000), "truncate": lambda f: corrupt.truncate(f, 5000),
     "fill_7f": corrupt.fill_7f}[damage](p)
    with pytest.raises(CheckpointError, match=f"checkpoint {p}: {reason}"):
        load_checkpoint(p)
