"""Where tensors live: the ``--device auto|cpu|cuda`` choice, a model's device, and seeded generators on it.

Every tensor a computation creates is put on the device of the model it belongs to; random numbers come from
a generator on that device. On the CPU, :func:`seeded_generator` gives exactly the numbers of
``torch.Generator().manual_seed(seed)``, so CPU results do not depend on this module; on CUDA the streams
differ from the CPU ones but are as reproducible (same seed, same device → same numbers).
"""
from __future__ import annotations

import torch
from torch import nn

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def resolve_device(name: str | torch.device | None) -> torch.device:
    """``auto`` (or None) → CUDA when a GPU is present, else CPU; ``cpu``; ``cuda`` / ``cuda:N`` (error when
    no GPU is present)."""
    if isinstance(name, torch.device):
        name = str(name)
    name = "auto" if name is None else str(name).strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} requested but no CUDA device is available (use auto or cpu)")
        return torch.device(name)
    raise ValueError(f"unknown device {name!r}; choose one of {', '.join(DEVICE_CHOICES)}")


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); CPU for a model without tensors."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def seeded_generator(seed: int, device: torch.device | str | None = None) -> torch.Generator:
    """A generator on ``device`` (default CPU) seeded with ``seed``."""
    return torch.Generator(device=torch.device(device or "cpu")).manual_seed(int(seed))
