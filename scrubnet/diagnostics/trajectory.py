"""Weight norm, effective learning rate and the PCA of training trajectories.

* ‖w_t‖² = Σ_j w_j² over the trainable parameters at epoch t (float64);
* the effective learning rate η_eff,t = η_t / ‖w_t‖² (for the scale-invariant weights in front of a
  BatchNorm, a step of η on w moves the direction w/‖w‖ like a step of η/‖w‖² would);
* trajectory PCA: the weights saved at intervals along every run are stacked into one matrix M (rows =
  snapshots, all runs together), centred by its row mean, and every snapshot is projected on the first two
  principal directions of M (the right singular vectors of the centred M).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn


def weight_sq_norm(model: nn.Module) -> float:
    """‖w‖² = Σ over trainable parameters of the squared entries (float64 sum)."""
    return float(sum(p.detach().double().pow(2).sum() for p in model.parameters() if p.requires_grad))


def flat_weights(model: nn.Module) -> Tensor:
    """The trainable parameters as one flat float64 vector (a copy), in ``named_parameters`` order."""
    return torch.cat([p.detach().double().reshape(-1) for p in model.parameters() if p.requires_grad]).cpu()


@dataclass
class WeightNormLog:
    """Per-epoch ‖w_t‖² and η_t/‖w_t‖²; ``lr_at(e)`` gives the learning rate of epoch e. Pass
    :meth:`on_epoch` to ``sgd_loop(on_epoch=...)`` (or call it from your loop) and, optionally, keep a weight
    snapshot every ``snapshot_every`` epochs for the trajectory PCA (0: none)."""

    model: nn.Module
    lr_at: Callable[[int], float]
    snapshot_every: int = 0
    epochs: list[int] = field(default_factory=list)
    sq_norms: list[float] = field(default_factory=list)
    effective_lr: list[float] = field(default_factory=list)
    snapshots: list[Tensor] = field(default_factory=list)
    snapshot_epochs: list[int] = field(default_factory=list)

    def on_epoch(self, epoch: int) -> None:
        n2 = weight_sq_norm(self.model)
        self.epochs.append(int(epoch))
        self.sq_norms.append(n2)
        self.effective_lr.append(float(self.lr_at(epoch)) / n2 if n2 > 0 else float("inf"))
        if self.snapshot_every and epoch % self.snapshot_every == 0:
            self.snapshots.append(flat_weights(self.model))
            self.snapshot_epochs.append(int(epoch))

    def summary(self) -> dict:
        return {"epochs": self.epochs, "sq_norm": self.sq_norms, "effective_lr": self.effective_lr}


def trajectory_pca(paths: dict[str, Tensor], components: int = 2) -> tuple[dict[str, Tensor], Tensor]:
    """Project every run's snapshots on the first ``components`` principal directions of all of them.

    paths: {run: (T_run, p)} weight snapshots. Returns ({run: (T_run, components)} coordinates, explained
    variance ratios (components,)). M = rows of all runs; coordinates = (M − mean) V_{:, :components}."""
    if not paths:
        raise ValueError("no trajectories to project")
    names = list(paths)
    m = torch.cat([paths[k].double() for k in names])
    if m.shape[0] < 2:
        raise ValueError("the trajectory PCA needs at least two snapshots")
    centred = m - m.mean(0, keepdim=True)
    _, s, vh = torch.linalg.svd(centred, full_matrices=False)
    c = min(components, vh.shape[0])
    proj = centred @ vh[:c].T
    var = s ** 2
    ratio = var[:c] / var.sum() if var.sum() > 0 else torch.zeros(c, dtype=var.dtype)
    out, i = {}, 0
    for k in names:
        n = paths[k].shape[0]
        out[k] = proj[i:i + n]
        i += n
    return out, ratio
