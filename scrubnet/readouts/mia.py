"""The black-box membership attack of the papers.

Feature: the entropy of the softmax output. Classifier: ``SVC(C=3, gamma='auto', kernel='rbf')``
trained with D_r as members (label 1) and D_test as non-members (label 0). Readout: the fraction of
D_f that the attack calls "member" — it should match the retrain model's; lower means a Streisand effect.
"""
from __future__ import annotations

import numpy as np
from sklearn.svm import SVC
from torch import Tensor, nn

from scrubnet.readouts.basic import softmax_entropy


def membership_attack_from_entropies(h_retain: np.ndarray, h_test: np.ndarray, h_forget: np.ndarray,
                                     C: float = 3.0) -> float:
    """Fraction of ``h_forget`` classified as member by an RBF SVC fit on retain (1) vs test (0) entropies."""
    feats = np.concatenate([h_retain, h_test]).reshape(-1, 1)
    labels = np.concatenate([np.ones(len(h_retain)), np.zeros(len(h_test))])
    clf = SVC(C=C, gamma="auto", kernel="rbf")
    clf.fit(feats, labels)
    return float(clf.predict(np.asarray(h_forget).reshape(-1, 1)).mean())


def membership_attack(model: nn.Module, retain: tuple[Tensor, Tensor], forget: tuple[Tensor, Tensor],
                      test: tuple[Tensor, Tensor]) -> float:
    """``mia_forget``: fraction of D_f the entropy attack calls a training member."""
    h = [softmax_entropy(model, d[0]).cpu().numpy().astype(np.float64) for d in (retain, test, forget)]
    return membership_attack_from_entropies(*h)
