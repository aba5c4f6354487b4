"""Per-example forgetting audits (U-LiRA and the NeurIPS-2023 ε-score) on a pool of models.

The statistics (:mod:`scrubnet.audit.stats`) are pure NumPy and take logits or φ from anywhere; the pool
(:mod:`scrubnet.audit.pool`) trains the models of one experiment and caches their outputs; the engines
(:mod:`scrubnet.audit.engine`) run the pool's tasks in-process or on a Ray cluster.
"""
from scrubnet.audit.stats import (EpsilonResult, ULiRAResult, epsilon_score, example_epsilons, forget_score,
                                  logit_confidence, ulira)

__all__ = ["EpsilonResult", "ULiRAResult", "epsilon_score", "example_epsilons", "forget_score", "logit_confidence",
           "ulira"]
