"""Checks of what a user's training returned and of a request's result, shared by :func:`scrubnet.forget` and the
tuning.

* :func:`check_trained` — a model the user's ``train`` returned is the yardstick of a tuning (or a ``retrain``):
  it must have the trained model's architecture (the same parameter and buffer names and shapes), finite
  weights, and output as many classes; else ``ValueError`` naming what is wrong (one ``error:`` line in the CLI).
* :func:`remaining_class_rule` — a whole-class request must not break the classes that remain: the test error of
  the remaining classes (held-out samples whose label is not the forgotten class) may rise by at most the
  retain-error tolerance; past it the result is ``ok=False``, whatever the verdict says of the forgotten class.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.checkpoint import non_finite_tensors
from scrubnet.data.stream import DataStream
from scrubnet.models.call import call_model

__all__ = ["check_trained", "remaining_class_rule", "request_class"]


def check_trained(trained, model: nn.Module, probe, what: str = "the training function (train=, --train)") -> None:
    """Refuse (``ValueError``) a model ``train`` returned that cannot stand for a retraining of ``model``.

    Parameters
    ----------
    trained : object
        What the user's training returned.
    model : nn.Module
        The trained model it must match: the same state-dict names and shapes, and the same class count.
    probe : inputs
        A batch of the model's inputs (its output's last dimension is the class count).
    what : str
        How the message names the training.
    """
    if not isinstance(trained, nn.Module):
        raise ValueError(f"{what} returned {type(trained).__name__}, not the trained nn.Module")
    mine = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in trained.state_dict().items()}
    if type(trained) is not type(model) or mine != theirs:
        diff = sorted(set(mine) ^ set(theirs))[:3] or [k for k in mine if mine[k] != theirs.get(k)][:3]
        raise ValueError(f"{what} returned another architecture ({type(trained).__name__} against the model's "
                         f"{type(model).__name__}; differing weights: {', '.join(diff) or 'none'}): it must "
                         "return the model it was handed, trained")
    bad = non_finite_tensors(trained.state_dict())
    if bad:
        raise ValueError(f"{what} returned non-finite weights (NaN or inf) in {', '.join(bad[:3])}: it is no "
                         "retraining to measure against")
    with torch.no_grad():
        c_model = int(call_model(model.eval(), probe).shape[-1])
        out = call_model(trained.eval(), probe)
    if int(out.shape[-1]) != c_model or not bool(torch.isfinite(out).all()):
        raise ValueError(f"{what} returned a model with {int(out.shape[-1])} outputs"
                         + ("" if int(out.shape[-1]) != c_model else " that are not finite")
                         + f" where the model has {c_model} classes")


def request_class(y_retain: Tensor, y_forget: Tensor, forget_class: int | None) -> int | None:
    """D_f's class when the request forgets a whole class (given, or D_f one class that D_r lacks), else None."""
    if forget_class is not None:
        return int(forget_class)
    classes = y_forget.unique()
    if len(classes) == 1 and not bool((y_retain == classes[0]).any()):
        return int(classes[0])
    return None


@torch.no_grad()
def _remaining_error(model: nn.Module, test: DataStream, cls: int) -> tuple[float, int]:
    """(error on the held-out samples not of class ``cls``, their count)."""
    model.eval()
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    wrong, n = 0, 0
    for x, y in test.chunks():
        keep = y != cls
        if not bool(keep.any()):
            continue
        logits = call_model(model, x.to(dev)).float()
        pred = logits.argmax(-1).cpu()
        wrong += int((pred[keep.cpu()] != y[keep].cpu()).sum())
        n += int(keep.sum())
    return wrong / max(n, 1), n


def remaining_class_rule(out, model: nn.Module, test: DataStream | None, cls: int | None, tolerance: float) -> None:
    """On a whole-class request with held-out data: record the test error of the remaining classes before and
    after (``out.checks["remaining_test_error"]``) and fail the result (``ok=False``) when it rose by more than
    ``tolerance`` (a fraction). Nothing without held-out data or for a request that is not a whole class.

    Parameters
    ----------
    out : ForgetResult
        The request's result (``out.model`` the scrubbed model).
    model : nn.Module
        The model before the request.
    test : DataStream or None
    cls : int or None
        The forgotten class.
    tolerance : float
    """
    if test is None or cls is None or out.scrub is None:
        return
    before, n = _remaining_error(model, test, cls)
    after, _ = _remaining_error(out.scrub.model, test, cls)
    passed = after - before <= tolerance + 1e-12
    out.checks["remaining_test_error"] = {"class": int(cls), "before": before, "after": after, "n": n,
                                          "tolerance": float(tolerance), "passed": bool(passed)}
    if not passed:
        out.ok = False
        out.reasons.append(f"the test error of the remaining classes rose from {100 * before:.1f} % to "
                           f"{100 * after:.1f} % (more than {100 * tolerance:g} points): forgetting class {cls} "
                           "broke the others")


def per_sample_loss(model: nn.Module, data: DataStream) -> Tensor:
    """Cross-entropy of every sample of ``data`` (eval mode, no gradient)."""
    model.eval()
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    out = []
    with torch.no_grad():
        for x, y in data.chunks():
            out.append(F.cross_entropy(call_model(model, x.to(dev)).float(), y.to(dev), reduction="none").cpu())
    return torch.cat(out) if out else torch.zeros(0)
