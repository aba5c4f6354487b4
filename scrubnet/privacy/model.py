"""A private linear classifier on top of its frozen feature network, as a scrubnet checkpoint.

The module computes logits = normalise(φ(x) − c) W, with φ the feature network (a zoo model whose ``head`` is
replaced by the identity), c the mean feature of the core (pre-training) data and W (D, C) the linear weights
trained by NoisyGD / AdaMix. It is saved with :func:`scrubnet.checkpoint.save_checkpoint` (safetensors + JSON
sidecar); the sidecar's ``accounting`` field holds the privacy ledger (μ, ε, δ, σ, T, clip thresholds).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from scrubnet.checkpoint import CheckpointError, load_checkpoint, read_meta, save_checkpoint
from scrubnet.models import build_model
from scrubnet.privacy.linear import normalise_features

ARCH = "linear-on-frozen-features"


class FrozenFeatureLinear(nn.Module):
    """logits = normalise(backbone(x) − center) @ W; ``backbone`` has its head replaced by the identity."""

    def __init__(self, backbone: nn.Module, center: Tensor, weights: Tensor):
        super().__init__()
        backbone.head = nn.Identity()
        self.backbone = backbone.eval()
        for p in self.backbone.parameters():
            p.requires_grad_(False)
        self.register_buffer("center", center.detach().clone().float())
        self.head = nn.Linear(weights.shape[0], weights.shape[1], bias=False)
        with torch.no_grad():
            self.head.weight.copy_(weights.T.float())

    def features(self, x: Tensor) -> Tensor:
        """Normalised, centred features (n, D)."""
        return normalise_features(self.backbone(x) - self.center)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def save_private_classifier(path: str | Path, model: FrozenFeatureLinear, *, backbone: str, backbone_options: dict,
                            in_shape, accounting: dict, config: dict | None = None, seed: int | None = None,
                            extra: dict | None = None) -> dict:
    """Write ``model`` as a checkpoint; the sidecar carries the backbone name/options and the accounting."""
    d, c = model.head.in_features, model.head.out_features
    return save_checkpoint(path, model, arch=ARCH, in_shape=in_shape, num_classes=c,
                           arch_options={"backbone": backbone, "backbone_options": dict(backbone_options),
                                         "feature_dim": d},
                           config=config, seed=seed, extra={"accounting": accounting, **(extra or {})})


def load_private_classifier(path: str | Path) -> tuple[FrozenFeatureLinear, dict]:
    """Rebuild and load a checkpoint written by :func:`save_private_classifier` (validated like any other)."""
    meta = read_meta(path)
    if meta.get("arch") != ARCH:
        raise CheckpointError(f"checkpoint {path} holds a {meta.get('arch')!r} model, expected {ARCH!r}")
    if "accounting" not in meta:
        raise CheckpointError(f"checkpoint {path} has no privacy accounting in its sidecar")
    opts = meta.get("arch_options", {})
    try:
        backbone = build_model(opts["backbone"], meta["in_shape"], 1, **opts.get("backbone_options", {}))
        d = int(opts["feature_dim"])
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot rebuild the feature network: {e}") from None
    shell = FrozenFeatureLinear(backbone, torch.zeros(d), torch.zeros(d, int(meta["num_classes"])))
    return load_checkpoint(path, expect_arch=ARCH, model=shell)
