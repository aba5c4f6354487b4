"""From a split to an ML model: pre-train on the core classes, build w_0, train w_c and w_u.

The same steps (and seeds) as the experiment runner's ``prepare_seed`` for the pre-training and the
fine-tuning start, so the ML model and the protocol's non-linear original share w_0.
"""
from __future__ import annotations

from torch import Tensor, nn

from scrubnet.mlforget.model import MLConfig, MLState, build_ml_model
from scrubnet.models import build_model
from scrubnet.training import TrainConfig, finetune_start, pretrain


def fine_tuning_start(split, model_name: str, model_options: dict, train_cfg: TrainConfig, seed: int) -> nn.Module:
    """w_0 exactly as the runner builds it: pre-train on the core classes, then a fresh task head."""
    n_pre = split.num_core_classes if len(split.y_core) else split.num_classes
    model = build_model(model_name, split.input_shape, n_pre, seed=seed, **(model_options or {}))
    pre = pretrain(model, split.x_core, split.y_core, train_cfg, seed) if len(split.y_core) else model
    return finetune_start(pre, split.num_classes, seed)


def train_ml(split, cfg: MLConfig, train_cfg: TrainConfig, seed: int, *, model_name: str = "mlp",
             model_options: dict | None = None, start: nn.Module | None = None,
             exclude_from_core: Tensor | None = None) -> MLState:
    """The ML model for ``split`` (see :func:`scrubnet.mlforget.model.build_ml_model`); ``start`` is w_0
    when already built, else it is built with :func:`fine_tuning_start`."""
    if start is None:
        start = fine_tuning_start(split, model_name, model_options or {}, train_cfg, seed)
    return build_ml_model(start, split, cfg, train_cfg, seed, exclude_from_core=exclude_from_core)
