"""Shared fixtures: a tiny, fast version of the embedded experiment."""
from __future__ import annotations

import pytest
import torch

from scrubnet.data.registry import DataConfig
from scrubnet.experiments.config import ExperimentConfig
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
