"""Shared fixtures: a tiny, fast version of the embedded experiment."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from scrubnet.data.registry import DataConfig
from scrubnet.experiments.config import ExperimentConfig
from scrubnet.methods.base import ForgetContext
from scrubnet.recipe import TrainingRecipe
from scrubnet.training import TrainConfig

# tiny models: one thread is fastest and immune to OpenMP oversubscription on a busy machine
torch.set_num_threads(1)


def tiny_config(**over) -> ExperimentConfig:
    data = DataConfig(n_train_per_class=20, n_test_per_class=20, core_per_class=40, forget_count=5,
                      num_samples=1500)
    train = TrainConfig(wd=0.03, max_epochs=15, pretrain_epochs=2, batch_size=32)
    cfg = ExperimentConfig(data=data, train=train, model="mlp", model_options={"hidden": 32}, seeds=[0],
                           relearn_max_epochs=5)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


@pytest.fixture
def tiny_cfg() -> ExperimentConfig:
    return tiny_config()


def protocol_ctx(w0: dict, config: TrainConfig | None = None, loss: str = "cross_entropy", **fields) -> ForgetContext:
    """A context whose recipe is scrubnet's protocol objective pulled toward ``w0`` with ``config``'s decay and
    SGD settings (``config`` also the schedule) and ``loss``: what the tests of a single method need without a
    start model."""
    config = config or TrainConfig()
    recipe = dataclasses.replace(TrainingRecipe.scrubnet_protocol(w0, config), loss=loss)
    return ForgetContext(recipe=recipe, schedule=config, **fields)
