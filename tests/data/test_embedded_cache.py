"""The MNIST-1D pools' cache: what it returns is what the generator makes, and a damaged file is regenerated."""
import numpy as np
import pytest
import torch

from scrubnet.data import embedded as E


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv(E.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(E.CACHE_SWITCH_ENV, raising=False)
    monkeypatch.setattr(E, "_MEMO", {})
    return tmp_path


def test_cached_pools_equal_the_generators(fresh):
    direct = E._generate_mnist1d(300, 7)                            # the slow, obviously correct twin
    first = E.mnist1d_arrays(300, 7)                                # generated, then written
    (path,) = fresh.glob("mnist1d-*-n300-s7.npz")
    E._MEMO.clear()
    again = E.mnist1d_arrays(300, 7)                                # read back from the file
    for k in direct:
        assert np.array_equal(first[k], direct[k]) and np.array_equal(again[k], direct[k]) and again[k].dtype == direct[k].dtype
    # callers get copies: writing into one does not reach the next call
    again["x"][0, 0] = 1e9
    assert E.mnist1d_arrays(300, 7)["x"][0, 0] == direct["x"][0, 0]
    x, y, xt, yt = E.mnist1d_pools(300, 7)
    assert x.dtype == torch.float32 and y.dtype == torch.long and abs(float(x.mean())) < 1e-5
    assert path.stat().st_size > 0


@pytest.mark.parametrize("damage", ["truncate", "tamper"])
def test_a_damaged_cache_file_is_regenerated(fresh, damage):
    direct = E._generate_mnist1d(200, 3)
    E.mnist1d_arrays(200, 3)
    (path,) = fresh.glob("mnist1d-*-n200-s3.npz")
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:100])
    else:  # plausible arrays under the old digest: the check refuses them
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        arrays["y"] = (arrays["y"] + 1) % 10
        np.savez(path, **arrays)
    E._MEMO.clear()
    got = E.mnist1d_arrays(200, 3)
    assert all(np.array_equal(got[k], direct[k]) for k in direct)
    assert E._read_cache(path) is not None                          # rewritten whole


def test_the_cache_can_be_turned_off(fresh, monkeypatch):
    monkeypatch.setenv(E.CACHE_SWITCH_ENV, "0")
    E.mnist1d_arrays(100, 1)
    assert not list(fresh.iterdir())
