"""Error, loss, softmax entropy and the L1 distance of softmax outputs between two models."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.data.stream import DataStream
from scrubnet.training import predict_logits


def error_and_loss(model: nn.Module, x: Tensor, y: Tensor) -> tuple[float, float]:
    """(error rate in [0, 1], mean cross-entropy in nats) of ``model`` on (x, y); NaN for an empty set."""
    if len(y) == 0:
        return float("nan"), float("nan")
    logits = predict_logits(model, x)
    return float((logits.argmax(1) != y).float().mean()), float(F.cross_entropy(logits, y))


def entropy(probs: Tensor) -> Tensor:
    """Shannon entropy (nats) of each row of a (n, c) probability matrix; 0·log 0 = 0."""
    return -(probs * torch.log(probs.clamp_min(1e-30))).sum(dim=1)


def softmax_entropy(model: nn.Module, x: Tensor) -> Tensor:
    """Entropy (nats) of the model's softmax output for each sample; shape (n,)."""
    return entropy(torch.softmax(predict_logits(model, x), dim=1))


def activation_l1(model: nn.Module, reference: nn.Module, x: Tensor) -> float:
    """E_x ‖softmax(f(x)) − softmax(f_ref(x))‖₁: mean over samples of the per-sample L1 distance."""
    if len(x) == 0:
        return float("nan")
    p = torch.softmax(predict_logits(model, x), dim=1)
    q = torch.softmax(predict_logits(reference, x), dim=1)
    return float((p - q).abs().sum(dim=1).mean())


def stream_error_and_loss(model: nn.Module, data: DataStream) -> tuple[float, float]:
    """:func:`error_and_loss` over a :class:`~scrubnet.data.stream.DataStream`, chunk by chunk: (Σ wrong / N,
    Σ CE / N); NaN for an empty set. Memory: one chunk's inputs and logits."""
    wrong, total, n = 0, 0.0, 0
    for x, y in data.chunks():
        logits = predict_logits(model, x)
        wrong += int((logits.argmax(1) != y).sum())
        total += float(F.cross_entropy(logits, y, reduction="sum"))
        n += len(y)
    return (wrong / n, total / n) if n else (float("nan"), float("nan"))
