"""The black-box membership attack of the papers.

Feature: the entropy of the softmax output. Classifier: ``SVC(C=3, gamma='auto', kernel='rbf')``
trained with D_r as members (label 1) and D_test as non-members (label 0). Readout: the fraction of
D_f that the attack calls "member" — it should match the retrain model's; lower means a Streisand effect.
"""
from __future__ import annotations

import numpy as np
from torch import Tensor, nn

from scrubnet.readouts.basic import softmax_entropy


def membership_attack_from_entropies(h_retain: np.ndarray, h_test: np.ndarray, h_forget: np.ndarray,
                                     C: float = 3.0) -> float:
    """Fraction of ``h_forget`` classified as member by an RBF SVC fit on retain (1) vs test (0) entropies."""
    return attack_with_degeneracy(h_retain, h_test, h_forget, C)[0]


def attack_with_degeneracy(h_retain: np.ndarray, h_test: np.ndarray, h_forget: np.ndarray,
                           C: float = 3.0) -> tuple[float, bool]:
    """(fraction of ``h_forget`` called member, degenerate): degenerate when the fitted classifier predicts
    one class for every point it sees (D_r, D_test and D_f together) — then 0 % or 100 % is the classifier's
    constant, not a measurement of the model."""
    feats = np.concatenate([h_retain, h_test]).reshape(-1, 1)
    labels = np.concatenate([np.ones(len(h_retain)), np.zeros(len(h_test))])
    from sklearn.svm import SVC  # imported here: scikit-learn costs ≈ 1 s at start-up of every command

    clf = SVC(C=C, gamma="auto", kernel="rbf")
    clf.fit(feats, labels)
    pred_forget = clf.predict(np.asarray(h_forget).reshape(-1, 1))
    everything = np.concatenate([clf.predict(feats), pred_forget])
    return float(pred_forget.mean()), bool(np.all(everything == everything[0]))


def membership_attack(model: nn.Module, retain: tuple[Tensor, Tensor], forget: tuple[Tensor, Tensor],
                      test: tuple[Tensor, Tensor]) -> float:
    """``mia_forget``: fraction of D_f the entropy attack calls a training member."""
    return membership_attack_flagged(model, retain, forget, test)[0]


def membership_attack_flagged(model: nn.Module, retain: tuple[Tensor, Tensor], forget: tuple[Tensor, Tensor],
                              test: tuple[Tensor, Tensor]) -> tuple[float, bool]:
    """(``mia_forget``, degenerate) — see :func:`attack_with_degeneracy`."""
    h = [softmax_entropy(model, d[0]).cpu().numpy().astype(np.float64) for d in (retain, test, forget)]
    return attack_with_degeneracy(*h)
