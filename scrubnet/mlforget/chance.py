"""The honest chance level of a fine-tuning task, and the held-out split that measures against it.

A model "at chance" is one whose held-out error a predictor of the majority class could have produced. The
majority class and its rate come from the WHOLE training labels (N of them), not from a small held-out draw
(a 30-sample draw read 0.833 where the true chance error was 0.80):

    c = 1 − max_k n_k / N                          (the chance error; n_k the count of class k)

and a majority predictor's error on n held-out samples is Binomial(n, c)/n, whose 95 % range starts at

    c_lo = c − z·√(c(1−c)/n),   z = 1.96.

A held-out error e ≥ c_lo lies within the chance interval: :func:`at_chance` is then True, and no
``mlforget finetune`` (either engine, any µ) writes a checkpoint. The held-out split (:func:`held_out_split`)
holds at least :data:`MIN_HELD_OUT` samples, or half of the deletable samples when there are fewer than
twice that ("all there is"), and at least 10 %.

**Task kinds** (:data:`TASKS`). A *generalisation* task (the default) is judged on samples the model never
trained on, as above. A *memorisation* (knowledge) task — facts about people, TOFU's question–answer pairs —
has no held-out answer to find: a question about a person the model never saw cannot be answered, so every
held-out error is 1 and the guard would refuse every such fine-tune. There the guard scores the model that
answers on its OWN remaining training samples (a seeded draw of at most :data:`MAX_CHECK`) and refuses when
that error lies within the same chance interval: a memorisation task passes only when the model learned its
training answers, and the check is never silently off (docs/decisions/forgettable.md, "Task kinds").
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

#: the held-out split's least size when the data allow it
MIN_HELD_OUT = 200
#: the two-sided 95 % normal quantile of the chance interval
Z = 1.96
#: the task kinds the guard knows: judged on held-out samples, or on the model's own training answers
TASKS = ("generalisation", "memorisation")
#: the most samples a training-answer (memorisation) check scores
MAX_CHECK = 400


def check_draw(n: int, seed: int, k: int = MAX_CHECK) -> Tensor:
    """Sorted positions of a seeded draw of min(k, n) of 0..n−1 (the memorisation check's samples)."""
    g = torch.Generator().manual_seed(7919 * int(seed) + 23)
    return torch.sort(torch.randperm(int(n), generator=g)[:k]).values


def chance_error(y: Tensor, num_classes: int | None = None) -> tuple[float, int]:
    """(c, majority class): 1 − the majority-class rate of the whole training labels ``y`` (N,)."""
    counts = torch.bincount(y.reshape(-1).long(), minlength=int(num_classes or 0))
    k = int(counts.argmax())
    return 1.0 - float(counts[k]) / float(counts.sum()), k


def chance_interval(c: float, n: int) -> tuple[float, float]:
    """The 95 % range [c_lo, c_hi] of a majority predictor's error on ``n`` held-out samples."""
    half = Z * math.sqrt(max(c * (1.0 - c), 0.0) / max(int(n), 1))
    return max(0.0, c - half), min(1.0, c + half)


def at_chance(error: float, c: float, n: int) -> bool:
    """True when a held-out ``error`` on ``n`` samples lies within (or above) the chance interval of ``c``."""
    return error >= chance_interval(c, n)[0]


def error_interval(error: float, n: int) -> tuple[float, float]:
    """Wilson 95 % interval of an error rate measured on ``n`` samples."""
    n = max(int(n), 1)
    centre = (error + Z * Z / (2 * n)) / (1 + Z * Z / n)
    half = Z * math.sqrt(error * (1 - error) / n + Z * Z / (4 * n * n)) / (1 + Z * Z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def held_out_size(n_deletable: int) -> int:
    """max(10 %, min(:data:`MIN_HELD_OUT`, half)) of ``n_deletable`` samples (module docstring)."""
    return max(int(round(0.1 * n_deletable)), min(MIN_HELD_OUT, n_deletable // 2))


def held_out_split(n: int, seed: int, exclude: Tensor | None = None, n_held_out: int | None = None
                   ) -> tuple[Tensor, Tensor]:
    """(fit positions, held-out positions), sorted: a seeded draw of :func:`held_out_size` (or
    ``n_held_out``) samples among 0..n−1 outside ``exclude`` (core samples are never held out)."""
    skip = set() if exclude is None else set(exclude.tolist())
    deletable = torch.tensor([i for i in range(n) if i not in skip], dtype=torch.long)
    k = held_out_size(len(deletable)) if n_held_out is None else int(n_held_out)
    g = torch.Generator().manual_seed(7919 * int(seed) + 5)
    val = deletable[torch.randperm(len(deletable), generator=g)[:k]]
    fit = torch.tensor(sorted(set(range(n)) - set(val.tolist())), dtype=torch.long)
    return fit, val


def chance_report(error: float, n: int, y_train: Tensor, num_classes: int | None = None) -> dict:
    """``{"error", "error_interval", "held_out", "chance", "chance_interval", "majority", "at_chance"}``."""
    c, k = chance_error(y_train, num_classes)
    return {"error": float(error), "error_interval": list(error_interval(error, n)), "held_out": int(n),
            "chance": c, "chance_interval": list(chance_interval(c, n)), "majority": k,
            "at_chance": at_chance(error, c, n)}


def refusal(report: dict, what: str) -> str:
    """The one-line reason a checkpoint at chance is refused."""
    lo, hi = report["chance_interval"]
    measured = report.get("measured", "held-out error")
    return (f"{what}: {measured} {report['error']:.3f} on {report['held_out']} samples lies within the chance "
            f"interval [{lo:.3f}, {hi:.3f}] (majority class {report['majority']}, chance error "
            f"{report['chance']:.3f} over the whole training labels): the model learns nothing here; no checkpoint "
            "written (check the labels, the user weights, or try the other engine)")
