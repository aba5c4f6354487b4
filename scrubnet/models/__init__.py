"""The model zoo. Every model is a plain ``nn.Module`` whose final layer is the attribute ``head``
(an ``nn.Linear``), so fine-tuning can swap in a fresh head for the task classes."""
from scrubnet.models.zoo import (
                                 CLASSIFIER_NAMES,
                                 CNN1D,
                                 CNN2D,
                                 MLP,
                                 MODELS,
                                 AllCNN,
                                 ResNet18,
                                 build_model,
                                 eval_mode,
                                 find_classifier,
                                 freeze_batchnorm,
                                 replace_head,
)

__all__ = ["CLASSIFIER_NAMES", "find_classifier", "MODELS", "MLP", "CNN1D", "CNN2D", "AllCNN", "ResNet18", "build_model", "eval_mode", "freeze_batchnorm",
           "replace_head"]
