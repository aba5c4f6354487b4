"""Readouts: what an attacker or a user can measure on a scrubbed model.

error/loss on D_r, D_f, D_test; re-learn time; the entropy membership attack; L1 distance of softmax
outputs to the retrain model; entropy histograms; the forgetting verdict without a retrained model
(``forgetting``: does D_f look like held-out data after the scrub?). Information bounds live in
``information`` (white-box) and ``activation_info`` (black-box)."""
from scrubnet.readouts.basic import activation_l1, entropy, error_and_loss, softmax_entropy, stream_error_and_loss
from scrubnet.readouts.forgetting import ForgettingVerdict, VerdictRules, forgetting_verdict
from scrubnet.readouts.mia import membership_attack
from scrubnet.readouts.relearn import relearn_time

__all__ = ["ForgettingVerdict", "VerdictRules", "forgetting_verdict", "activation_l1", "entropy", "error_and_loss",
           "softmax_entropy", "stream_error_and_loss", "membership_attack", "relearn_time"]
