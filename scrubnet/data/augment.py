"""Data augmentation: random shifts (zero fill) and additive Gaussian noise for the embedded data sets, and the
field's CIFAR augmentation (``crop_flip``).

``shift_noise`` is the augmentation that MNIST-1D's own generator uses to make its signals (a translation
and a little noise); on 8×8 digits it is a translation by up to ``max_shift`` pixels on each axis. Per
sample i, with shifts s_i drawn uniformly from {−m, …, m} (one per spatial axis) and ε_i ~ N(0, σ² I):

    x'_i[t] = x_i[t − s_i] (0 outside the signal) + ε_i[t]

Spatial axes: the last one for signals (B, L) or (B, C, L), the last two for images (B, C, H, W).

``crop_flip`` (images (B, C, H, W) only) is torchvision's ``RandomCrop(H, padding=4)`` followed by
``RandomHorizontalFlip()``, the augmentation every CIFAR-10 unlearning paper trains ResNet-18 with: zero-pad 4
pixels on each side, take the H×W window at offsets (a_i, b_i) drawn uniformly from {0, …, 8}², then mirror the
columns with probability ½:

    x'_i[c, h, w] = pad(x_i)[c, h + a_i, w + b_i]   (w → W − 1 − w when flipped)

Every draw comes from the augmenter's own seeded generator, so switching augmentation on or off leaves the batch
order of the training loop unchanged.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

AUGMENTATIONS = ("none", "shift_noise", "crop_flip")
#: the field's CIFAR crop padding (pixels on each side)
CROP_PADDING = 4

#: MNIST-1D signals are standardised (std 1) and 40 long; digits are in [0, 1] and 8×8
DEFAULT_MAX_SHIFT = {2: 3, 3: 3, 4: 1}
DEFAULT_NOISE = 0.05


def shift_zero_fill(x: Tensor, shifts: Tensor, dim: int) -> Tensor:
    """x shifted along ``dim`` by ``shifts[i]`` positions for sample i (positive: toward higher indices),
    zero-filled. x (B, ...), shifts (B,) int64."""
    n = x.shape[dim]
    view = [1] * x.ndim
    view[0], view[dim] = -1, n
    src = torch.arange(n, device=x.device).view(view) - shifts.view([-1] + [1] * (x.ndim - 1))  # (B, .., n, ..)
    valid = (src >= 0) & (src < n)
    idx = src.clamp(0, n - 1).expand(x.shape)
    return torch.where(valid.expand(x.shape), torch.gather(x, dim, idx), torch.zeros((), dtype=x.dtype,
                                                                                         device=x.device))


class ShiftNoise:
    """Callable x (B, ...) → augmented x (same shape): random zero-filled shift + N(0, σ²) noise (module
    docstring). ``seed`` fixes every draw; one instance draws a fresh augmentation per call."""

    def __init__(self, seed: int, *, max_shift: int | None = None, noise: float = DEFAULT_NOISE,
                 device: torch.device | str = "cpu"):
        if max_shift is not None and max_shift < 0:
            raise ValueError(f"max_shift must be ≥ 0, got {max_shift}")
        if not noise >= 0:
            raise ValueError(f"noise must be ≥ 0, got {noise}")
        self.max_shift, self.noise = max_shift, float(noise)
        self.generator = torch.Generator(device=torch.device(device)).manual_seed(int(seed))

    def __call__(self, x: Tensor) -> Tensor:
        if x.ndim not in (2, 3, 4):
            raise ValueError(f"shift_noise augments signals (B, L), (B, C, L) or images (B, C, H, W); got {tuple(x.shape)}")
        m = DEFAULT_MAX_SHIFT[x.ndim] if self.max_shift is None else self.max_shift
        g = self.generator
        dims = [x.ndim - 1] if x.ndim < 4 else [2, 3]
        out = x
        for d in dims:
            s = torch.randint(-m, m + 1, (x.shape[0],), generator=g, device=g.device).to(x.device)
            out = shift_zero_fill(out, s, d)
        if self.noise > 0:
            eps = torch.randn(x.shape, generator=g, device=g.device, dtype=x.dtype).to(x.device)
            out = out + self.noise * eps
        return out


class CropFlip:
    """Callable x (B, C, H, W) → augmented x: random crop of the 4-pixel zero-padded image, then a horizontal
    flip with probability ½ (module docstring). ``seed`` fixes every draw."""

    def __init__(self, seed: int, *, padding: int = CROP_PADDING, device: torch.device | str = "cpu"):
        if padding < 0:
            raise ValueError(f"padding must be ≥ 0, got {padding}")
        self.padding = int(padding)
        self.generator = torch.Generator(device=torch.device(device)).manual_seed(int(seed))

    def __call__(self, x: Tensor) -> Tensor:
        if x.ndim != 4:
            raise ValueError(f"crop_flip augments images (B, C, H, W); got {tuple(x.shape)}")
        g, p = self.generator, self.padding
        b = x.shape[0]
        # a crop at offset a of the padded image is the image shifted by p − a (zero-filled)
        for d in (2, 3):
            off = torch.randint(0, 2 * p + 1, (b,), generator=g, device=g.device).to(x.device)
            x = shift_zero_fill(x, p - off, d)
        flip = (torch.rand(b, generator=g, device=g.device) < 0.5).to(x.device)
        return torch.where(flip[:, None, None, None], x.flip(3), x)


def make_augment(kind: str, seed: int, device: torch.device | str = "cpu") -> Callable[[Tensor], Tensor] | None:
    """The augmenter named ``kind`` (one of :data:`AUGMENTATIONS`; "none" → None), seeded."""
    if kind == "none":
        return None
    if kind == "shift_noise":
        return ShiftNoise(seed, device=device)
    if kind == "crop_flip":
        return CropFlip(seed, device=device)
    raise ValueError(f"unknown augmentation {kind!r}; choose one of {', '.join(AUGMENTATIONS)}")
