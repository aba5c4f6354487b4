"""The field's standard unlearning metrics for image classifiers: UA, RA, TA, MIA-efficacy and Avg. Gap.

* UA (unlearning accuracy) = 1 − accuracy on D_f; RA = accuracy on D_r; TA = accuracy on D_test.
* MIA-efficacy: a confidence-based membership attack, as the field's evaluation code builds it — an RBF SVC
  (C = 3, gamma "auto") on one scalar feature per sample (``"confidence"``: the softmax probability of the true
  label; or ``"entropy"``: the softmax entropy), trained with a random subset of D_r as members (as many as
  |D_test|, seeded) and D_test as non-members, then applied to D_f; the score is the fraction of D_f predicted
  *non-member* (higher: D_f looks less like training data).
* Avg. Gap = mean over {UA, RA, TA, MIA-efficacy} of |metric(model) − metric(retrained model)|.

All values are fractions in [0, 1] (the papers print percentages: ×100). Every set may be (x, y) tensors, a
``Dataset`` or a ``DataLoader``: it is read in chunks through :func:`~scrubnet.models.call.call_model`, in eval
mode, and only per-sample scalars are kept.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from scrubnet.data.stream import as_stream
from scrubnet.device import model_device
from scrubnet.models import eval_mode
from scrubnet.models.call import call_model
from scrubnet.readouts.mia import attack_with_degeneracy

MIA_FEATURES = ("confidence", "entropy")
#: the four metrics Avg. Gap averages over
GAP_METRICS = ("ua", "ra", "ta", "mia_efficacy")


@dataclass
class StandardMetrics:
    """UA, RA, TA and MIA-efficacy of one model (fractions in [0, 1]); ``mia_degenerate`` is True when the
    attack's SVC predicted one class for every point (its score is then a constant, not a measurement)."""

    ua: float
    ra: float
    ta: float
    mia_efficacy: float
    mia_degenerate: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def correct_and_features(model: nn.Module, data, chunk_size: int = 512) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """What the standard metrics need from one set, per sample.

    Parameters
    ----------
    model : nn.Module
        Evaluated in eval mode (its mode is restored).
    data : (x, y) tensors, Dataset or DataLoader
        Read ``chunk_size`` samples at a time.

    Returns
    -------
    correct : ndarray (bool), shape (N,)
        Whether the argmax of the logits is the label.
    features : dict of str to ndarray (float64), shape (N,)
        "confidence": the softmax probability of the label; "entropy": the softmax entropy (nats).
    """
    dev = model_device(model)
    correct, conf, ent = [], [], []
    with eval_mode(model):
        for x, y in as_stream(data, chunk_size=chunk_size).chunks():
            x, y = x.to(dev), y.to(dev)
            logp = F.log_softmax(call_model(model, x).double(), dim=-1)
            correct.append((logp.argmax(-1) == y).cpu())
            conf.append(logp.gather(1, y[:, None])[:, 0].exp().cpu())
            ent.append(-(logp.exp() * logp).nan_to_num().sum(-1).cpu())
    cat = (lambda parts: torch.cat(parts).numpy()) if correct else (lambda parts: np.zeros(0))
    return cat(correct).astype(bool), {"confidence": cat(conf), "entropy": cat(ent)}


def mia_efficacy(f_retain: np.ndarray, f_test: np.ndarray, f_forget: np.ndarray, *, seed: int = 0,
                 C: float = 3.0) -> tuple[float, bool]:
    """The confidence attack's MIA-efficacy on per-sample features.

    Parameters
    ----------
    f_retain, f_test, f_forget : ndarray, shapes (N_r,), (N_test,), (N_f,)
        One feature per sample of D_r, D_test and D_f.
    seed : int
        Fixes the members: a random subset of ``f_retain`` of size min(N_r, N_test).
    C : float
        The RBF SVC's C (:func:`scrubnet.readouts.mia.attack_with_degeneracy`).

    Returns
    -------
    efficacy : float in [0, 1]
        The fraction of ``f_forget`` the attack calls non-member.
    degenerate : bool
        The SVC predicted one class for every point.
    """
    if len(f_retain) == 0 or len(f_test) == 0 or len(f_forget) == 0:
        raise ValueError("MIA-efficacy needs non-empty D_r, D_test and D_f")
    k = min(len(f_retain), len(f_test))
    pick = np.random.default_rng(seed).permutation(len(f_retain))[:k]
    member_fraction, degenerate = attack_with_degeneracy(np.asarray(f_retain)[pick], np.asarray(f_test),
                                                         np.asarray(f_forget), C)
    return 1.0 - member_fraction, degenerate


def standard_metrics(model: nn.Module, retain, forget, test, *, feature: str = "confidence", seed: int = 0,
                     chunk_size: int = 512) -> StandardMetrics:
    """UA, RA, TA and MIA-efficacy (module docstring) of ``model``.

    Parameters
    ----------
    model : nn.Module
        The classifier (logits (n, c) through ``call_model``).
    retain, forget, test : (x, y) tensors, Dataset or DataLoader
        D_r, D_f and the held-out test set.
    feature : {"confidence", "entropy"}
        The attack's per-sample feature (the field's MIA-efficacy uses "confidence").
    seed : int
        Fixes the random subset of D_r used as members.

    Returns
    -------
    StandardMetrics
        Fractions in [0, 1].
    """
    if feature not in MIA_FEATURES:
        raise ValueError(f"feature must be one of {', '.join(MIA_FEATURES)}, got {feature!r}")
    c_r, f_r = correct_and_features(model, retain, chunk_size)
    c_f, f_f = correct_and_features(model, forget, chunk_size)
    c_t, f_t = correct_and_features(model, test, chunk_size)
    if not (len(c_r) and len(c_f) and len(c_t)):
        raise ValueError("the standard metrics need non-empty D_r, D_f and D_test")
    eff, degenerate = mia_efficacy(f_r[feature], f_t[feature], f_f[feature], seed=seed)
    return StandardMetrics(ua=1.0 - float(c_f.mean()), ra=float(c_r.mean()), ta=float(c_t.mean()),
                           mia_efficacy=eff, mia_degenerate=degenerate)


def avg_gap(metrics, reference) -> float:
    """Avg. Gap: the mean of |metrics[m] − reference[m]| over UA, RA, TA and MIA-efficacy.

    Parameters
    ----------
    metrics, reference : StandardMetrics or mapping
        The method's metrics and the retrained model's (same units).

    Returns
    -------
    float
        In the metrics' units (fractions: ×100 for the papers' points).
    """
    a = metrics.as_dict() if isinstance(metrics, StandardMetrics) else metrics
    b = reference.as_dict() if isinstance(reference, StandardMetrics) else reference
    return float(np.mean([abs(float(a[m]) - float(b[m])) for m in GAP_METRICS]))


#: the keys :func:`standard_readouts` adds to a run's readouts (fractions; ``avg_gap`` against the retrain model)
STANDARD_READOUTS = ("ua", "ra", "ta", "mia_efficacy", "avg_gap")


def standard_readouts(model: nn.Module, retain, forget, test, *, reference: StandardMetrics | None = None,
                      seed: int = 0) -> tuple[dict[str, float], StandardMetrics]:
    """The standard metrics of ``model`` as flat readouts, with Avg. Gap to ``reference`` when given.

    Parameters
    ----------
    model : nn.Module
        The scrubbed (or anchor) model.
    retain, forget, test : (x, y) tensors, Dataset or DataLoader
        D_r, D_f and D_test.
    reference : StandardMetrics, optional
        The retrained model's metrics (same seed); without it no ``avg_gap`` key.
    seed : int
        The attack's member subset (:func:`standard_metrics`).

    Returns
    -------
    readouts : dict of str to float
        ``ua``, ``ra``, ``ta``, ``mia_efficacy`` (fractions), ``mia_efficacy_degenerate`` (0/1) and
        ``avg_gap`` (fraction).
    metrics : StandardMetrics
        The same numbers as a record.
    """
    m = standard_metrics(model, retain, forget, test, seed=seed)
    out = {"ua": m.ua, "ra": m.ra, "ta": m.ta, "mia_efficacy": m.mia_efficacy,
           "mia_efficacy_degenerate": float(m.mia_degenerate)}
    if reference is not None:
        out["avg_gap"] = avg_gap(m, reference)
    return out, m


def metrics_from_logits(retain: tuple, forget: tuple, test: tuple, *, feature: str = "confidence",
                        seed: int = 0) -> StandardMetrics:
    """The standard metrics from stored logits (a pool of models kept as logits, as in the audit).

    Parameters
    ----------
    retain, forget, test : (logits, labels)
        Logits ndarray (n, c) and integer labels ndarray (n,) of D_r, D_f and D_test.
    feature : {"confidence", "entropy"}
        The attack's feature (:func:`standard_metrics`).
    seed : int
        Fixes the random subset of D_r used as members.

    Returns
    -------
    StandardMetrics
        Fractions in [0, 1]; the same numbers :func:`standard_metrics` gives on the model with these logits.
    """
    if feature not in MIA_FEATURES:
        raise ValueError(f"feature must be one of {', '.join(MIA_FEATURES)}, got {feature!r}")
    parts = []
    for lg, y in (retain, forget, test):
        logp = F.log_softmax(torch.as_tensor(np.asarray(lg), dtype=torch.float64), dim=-1)
        y = torch.as_tensor(np.asarray(y), dtype=torch.long)
        if len(y) == 0:
            raise ValueError("the standard metrics need non-empty D_r, D_f and D_test")
        feats = {"confidence": logp.gather(1, y[:, None])[:, 0].exp().numpy(),
                 "entropy": -(logp.exp() * logp).nan_to_num().sum(-1).numpy()}
        parts.append(((logp.argmax(-1) == y).numpy(), feats[feature]))
    (c_r, f_r), (c_f, f_f), (c_t, f_t) = parts
    eff, degenerate = mia_efficacy(f_r, f_t, f_f, seed=seed)
    return StandardMetrics(ua=1.0 - float(c_f.mean()), ra=float(c_r.mean()), ta=float(c_t.mean()),
                           mia_efficacy=eff, mia_degenerate=degenerate)
