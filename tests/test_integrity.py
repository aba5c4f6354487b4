"""Verified safetensors artifacts (scrubnet.integrity): every corruption is detected and named."""
from __future__ import annotations

import hashlib

import pytest
import torch

from corrupt import fill_7f, flip_exponent_bits, truncate
from scrubnet.integrity import (ArtifactError, check_file_sha256, content_sha256, load_verified, read_header,
                                save_verified)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"b": torch.randn(40, 50, generator=g, dtype=torch.float64), "a": torch.arange(7),
            "c": torch.randn(3, generator=g).to(torch.float32), "empty": torch.zeros(0, 4)}


def test_round_trip_and_hash_is_canonical(tmp_path):
    t = _tensors()
    h = save_verified(tmp_path / "x.safetensors", t, {"key": "k1", "mu": "0.05"})
    back, meta = load_verified(tmp_path / "x.safetensors")
    assert meta == {"key": "k1", "mu": "0.05"}
    assert set(back) == set(t) and all(torch.equal(back[k], t[k]) for k in t)
    # the hash does not depend on dict order, and does depend on metadata, names, dtypes, shapes and values
    assert content_sha256(dict(reversed(list(t.items()))), {"mu": "0.05", "key": "k1"}) == h
    assert content_sha256(t, {"key": "k2", "mu": "0.05"}) != h
    assert content_sha256({**t, "a": t["a"].to(torch.int32)}, {"key": "k1", "mu": "0.05"}) != h
    assert content_sha256({**t, "b": t["b"].reshape(50, 40)}, {"key": "k1", "mu": "0.05"}) != h
    assert content_sha256({**{k: v for k, v in t.items() if k != "c"}, "d": t["c"]},
                          {"key": "k1", "mu": "0.05"}) != h
    b = t["b"].clone()
    b[17, 3] = torch.nextafter(b[17, 3], torch.tensor(1e9, dtype=torch.float64))
    assert content_sha256({**t, "b": b}, {"key": "k1", "mu": "0.05"}) != h
    # a slow twin: the sha256 of a hand-assembled byte stream
    ref = hashlib.sha256()
    for part in [b'{}', b"x", b"torch.float64", b"[2]", torch.tensor([1.0, 2.0], dtype=torch.float64).numpy().tobytes()]:
        ref.update(len(part).to_bytes(8, "little") + part)
    assert content_sha256({"x": torch.tensor([1.0, 2.0], dtype=torch.float64)}) == ref.hexdigest()


@pytest.mark.parametrize("damage,reason", [
    (lambda p: flip_exponent_bits(p, 2000), "hash mismatch"),
    (lambda p: truncate(p, 5000), "truncated"),
    (fill_7f, "hash mismatch"),
    (lambda p: p.write_bytes(b"\x7f" * 64 + p.read_bytes()[64:]), "not safetensors"),
    (lambda p: p.write_bytes(p.read_bytes()[:7]), "truncated"),
    (lambda p: p.write_bytes(b"hello world, not a tensor file at all"), "not safetensors"),
])
def test_each_corruption_is_named(tmp_path, damage, reason):
    p = tmp_path / "f.safetensors"
    save_verified(p, {"w": torch.randn(2000, dtype=torch.float64), "ids": torch.arange(100)}, {"k": "v"})
    damage(p)
    with pytest.raises(ArtifactError) as e:
        load_verified(p)
    assert e.value.reason == reason and e.value.path == p
    assert str(p) in str(e.value) and reason in str(e.value)


def test_missing_unhashed_and_non_finite(tmp_path):
    with pytest.raises(ArtifactError, match="missing"):
        load_verified(tmp_path / "nope.safetensors")
    from safetensors.torch import save_file
    save_file({"w": torch.ones(3)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ArtifactError, match="no content hash"):
        load_verified(tmp_path / "plain.safetensors")
    bad = {"w": torch.tensor([1.0, float("nan")])}
    with pytest.raises(ArtifactError, match="non-finite"):
        save_verified(tmp_path / "nan.safetensors", bad)
    assert not (tmp_path / "nan.safetensors").exists()
    save_verified(tmp_path / "nan.safetensors", bad, allow_non_finite=True)
    with pytest.raises(ArtifactError, match="non-finite"):
        load_verified(tmp_path / "nan.safetensors")
    assert torch.isnan(load_verified(tmp_path / "nan.safetensors", allow_non_finite=True)[0]["w"][1])


def test_check_file_sha256_names_truncation_and_mismatch(tmp_path):
    p = tmp_path / "w.safetensors"
    save_verified(p, {"w": torch.randn(3000)})
    sha = hashlib.sha256(p.read_bytes()).hexdigest()
    assert check_file_sha256(p, sha) == p.read_bytes()
    fill_7f(p)
    with pytest.raises(ArtifactError, match="hash mismatch"):
        check_file_sha256(p, sha)
    truncate(p, 5000)
    with pytest.raises(ArtifactError, match="truncated"):
        check_file_sha256(p, sha)


def test_read_header_offsets(tmp_path):
    p = tmp_path / "f.safetensors"
    save_verified(p, {"w": torch.zeros(10)})
    header, meta = read_header(p.read_bytes())
    assert header["w"]["data_offsets"] == [0, 40] and "content_sha256" in meta
