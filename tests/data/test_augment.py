"""The shift + noise augmentation against a per-sample loop."""
from __future__ import annotations

import pytest
import torch

from scrubnet.data.augment import ShiftNoise, make_augment, shift_zero_fill


def _shift_ref(v, s):
    out = torch.zeros_like(v)
    for t in range(len(v)):
        if 0 <= t - s < len(v):
            out[t] = v[t - s]
    return out


def test_shift_zero_fill_matches_loop():
    x = torch.randn(5, 9)
    s = torch.tensor([-3, 0, 2, 9, -1])
    got = shift_zero_fill(x, s, 1)
    for i in range(5):
        assert torch.equal(got[i], _shift_ref(x[i], int(s[i])))
    img = torch.randn(3, 1, 4, 4)
    s = torch.tensor([1, -1, 0])
    got = shift_zero_fill(img, s, 2)
    for i in range(3):
        for c in range(4):
            assert torch.equal(got[i, 0, :, c], _shift_ref(img[i, 0, :, c], int(s[i])))


def test_shift_noise_is_seeded_and_shape_preserving():
    x = torch.randn(6, 40)
    a, b = ShiftNoise(3), ShiftNoise(3)
    assert torch.equal(a(x), b(x))
    assert not torch.equal(a(x), b(torch.randn(6, 40)))
    noiseless = ShiftNoise(0, noise=0.0, max_shift=0)
    assert torch.equal(noiseless(x), x)
    assert make_augment("shift_noise", 0)(torch.randn(2, 1, 8, 8)).shape == (2, 1, 8, 8)
    assert make_augment("none", 0) is None
    with pytest.raises(ValueError, match="augmentation"):
        make_augment("mixup", 0)
    with pytest.raises(ValueError, match="signals"):
        ShiftNoise(0)(torch.randn(3))
