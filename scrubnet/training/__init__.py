"""Training: the SGD loops of the protocol (:mod:`~scrubnet.training.loops`), the vmapped pool of models
(:mod:`~scrubnet.training.pool`), LQF's linearised training (:mod:`~scrubnet.training.lqf`) and the cost engine
the methods' estimates are built on (:mod:`~scrubnet.training.cost`).

``from scrubnet.training import X`` gives the public names of the loops and the pool.
"""
from scrubnet.training.loops import (AUGMENTATIONS, DEFAULT_RETRAIN_MODE, RETRAIN_MODES, TRAIN_RANGES, EpochWindow,
                                     TrainConfig, TrainHistory, batch_loss, check_window, error_rate, finetune,
                                     finetune_start, in_window, l2_pull, predict_logits, pretrain, replace_forgotten,
                                     retrain, sgd_loop, train_epochs)
from scrubnet.training.pool import check_poolable, finetune_many, retrain_many

__all__ = ["AUGMENTATIONS", "DEFAULT_RETRAIN_MODE", "RETRAIN_MODES", "TRAIN_RANGES", "EpochWindow", "TrainConfig",
           "TrainHistory", "batch_loss", "check_poolable", "check_window", "error_rate", "finetune",
           "finetune_many", "finetune_start", "in_window", "l2_pull", "predict_logits", "pretrain",
           "replace_forgotten", "retrain", "retrain_many", "sgd_loop", "train_epochs"]
