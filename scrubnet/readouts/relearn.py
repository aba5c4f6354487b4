"""Re-learn time: how fast the scrubbed model re-learns D_f when fine-tuned on D.

Protocol (authors' code): each "epoch" is 500 samples drawn with replacement from D, in batches of
128, plain SGD (lr 0.01, no momentum) on mean CE + (wd/2)‖w − w_start‖² (pull toward the scrubbed
weights). The D_f loss is checked before each epoch; training stops once it is ≤ threshold + 1e-5,
where the threshold is the original model's D_f loss. Reported: epoch index + 1 (1 = already there),
at most ``max_epochs`` (100).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.models import freeze_batchnorm
from scrubnet.training import l2_pull, predict_logits


def relearn_time(model: nn.Module, x: Tensor, y: Tensor, x_forget: Tensor, y_forget: Tensor, threshold: float, *,
                 wd: float, lr: float = 0.01, samples_per_epoch: int = 500, batch_size: int = 128,
                 max_epochs: int = 100, seed: int = 0, freeze_bn: bool = True) -> int:
    """Epochs (1-based) until the D_f loss falls to ``threshold`` (+1e-5); ``max_epochs`` if never."""
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    w_start = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    opt = torch.optim.SGD(params, lr=lr, momentum=0.0)
    g = torch.Generator().manual_seed(10_007 * seed + 4)
    for epoch in range(max_epochs):
        loss_f = float(F.cross_entropy(predict_logits(model, x_forget), y_forget))
        if loss_f <= threshold + 1e-5:
            return epoch + 1
        model.train()
        if freeze_bn:
            freeze_batchnorm(model)
        idx_all = torch.randint(len(y), (samples_per_epoch,), generator=g)
        for i in range(0, samples_per_epoch, batch_size):
            idx = idx_all[i:i + batch_size]
            loss = F.cross_entropy(model(x[idx]), y[idx]) + 0.5 * wd * l2_pull(model, w_start)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        model.eval()
    return max_epochs
