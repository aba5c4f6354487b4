"""Re-learn time: how fast the scrubbed model re-learns D_f when fine-tuned on D.

Protocol (authors' code): each "epoch" is 500 samples drawn with replacement from D, in batches of
128, plain SGD (lr 0.01, no momentum) on mean CE + (wd/2)‖w − w_start‖² (pull toward the scrubbed
weights). The D_f loss is checked before each epoch; training stops once it is ≤ threshold + 1e-5,
where the threshold is the original model's D_f loss. Reported: epoch index + 1 (1 = already there),
at most ``max_epochs`` (100).
"""
from __future__ import annotations

import copy

import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.device import model_device, seeded_generator
from scrubnet.training import predict_logits, sgd_loop


#: the re-learn readout's cap (epochs of ``samples_per_epoch`` samples), the authors' 100
RELEARN_MAX_EPOCHS = 100


def relearn_time(model: nn.Module, x: Tensor, y: Tensor, x_forget: Tensor, y_forget: Tensor, threshold: float, *,
                 wd: float, lr: float = 0.01, samples_per_epoch: int = 500, batch_size: int = 128,
                 max_epochs: int = RELEARN_MAX_EPOCHS, seed: int = 0, freeze_bn: bool = True) -> int:
    """Epochs (1-based) until the D_f loss falls to ``threshold`` (+1e-5); ``max_epochs`` if never."""
    model = copy.deepcopy(model)
    w_start = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    g = seeded_generator(10_007 * seed + 4, model_device(model))

    def relearned(epoch: int) -> bool:
        return float(F.cross_entropy(predict_logits(model, x_forget), y_forget)) <= threshold + 1e-5

    epoch, stopped = sgd_loop(model, x, y, lr=lr, momentum=0.0, batch_size=batch_size, max_epochs=max_epochs,
                              generator=g, w0=w_start, wd=wd, freeze_bn=freeze_bn,
                              samples_per_epoch=samples_per_epoch, stop=relearned)
    return epoch + 1 if stopped and epoch < max_epochs else max_epochs
