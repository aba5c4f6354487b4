"""A tuned profile: what :func:`scrubnet.tuning.tune.tune` tried on the user's model, how close each candidate came
to the user's own retraining on a validation forget set, and the method a request runs (``method="auto"``).

The profile is a JSON file (:meth:`TunedProfile.save`, :meth:`TunedProfile.load`): the CLI (``scrubnet tune``
writes it, ``scrubnet forget --method auto --profile P`` reads it) and the service read the same file. It is
bound to the weights it was tuned on (their sha256): a profile is refused on another model.

The choice (:func:`choose`): among the candidates whose tuned result is *within tolerance* of the retraining —
closes at least ``min_closure`` of the forget-loss gap between the original and the retraining on the
validation set, and keeps the retain and test errors within half the ``tolerance`` of the retraining's (a
margin: the validation set is a sample) — the one with the
smallest measured cost; when none is, of the runs that kept retain and test error within tolerance the one that
closed most of the forget-loss gap, else the closest (smallest distance), with that said.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scrubnet.atomic_io import atomic_write_json
from scrubnet.checkpoint import weights_sha256

PROFILE_VERSION = 2
#: versions this scrubnet reads (a version-1 profile: one validation draw, no FLOP counts)
READS_VERSIONS = (1, 2)

#: the default candidates: the fine-tuning methods, whose rate and length scale to any model and which run
#: under the retain guard; a method's grid is its rate × length (:func:`candidate_grid`). SSD is not among them
#: (``methods=`` adds it): its one-shot selection depends on the very samples forgotten, and a validation set's
#: SSD result did not carry over to the request (docs/decisions/own-model-tuning.md)
DEFAULT_CANDIDATES = ("finetune", "neggrad", "randomlabels", "neggrad-plus", "l1-sparse", "salun", "scrub")
#: methods trained with Adam (their rate is an Adam rate)
ADAM_METHODS = ("scrub", "bad-teacher")


def method_rates(recipe) -> tuple[float, float]:
    """(SGD rate, Adam rate) relative to the training's: an SGD-trained model's rate r gives SGD r and Adam
    r/100; an AdamW-trained model's r gives Adam r and SGD 10·r (at most 0.1) — an AdamW rate is never an SGD
    rate."""
    r = float(recipe.lr)
    if getattr(recipe, "optimizer", "sgd") == "adamw":
        return min(0.1, 10.0 * r), r
    return r, r / 100.0


#: (share of the training's epochs, share of the method's rate), most promising first: the first ``budget``
#: of them are tried, so a small budget still spans short/long and fast/slow
GRID = ((0.25, 1 / 3), (0.1, 1 / 3), (0.25, 1.0), (0.25, 0.1), (0.1, 1.0), (0.1, 0.1))


def candidate_grid(method: str, recipe, budget: int = 4) -> list[dict]:
    """The options tried for ``method``: lengths of about 10 % and 25 % of the training's epochs × rates of
    1, 1/3 and 1/10 of the method's rate (:func:`method_rates`), in the order of :data:`GRID`; SSD its
    selection threshold; at most ``budget`` of them, the same budget for every method.

    Parameters
    ----------
    method : str
    recipe : TrainingRecipe
        How the model was trained.
    budget : int
        Options tried per method.

    Returns
    -------
    list of dict
        Method options.
    """
    if method == "ssd":
        return [{"selection_threshold": t} for t in (5.0, 1.0, 2.0, 10.0)][:budget]
    epochs = max(1, int(recipe.epochs))
    sgd, adam = method_rates(recipe)
    rate = adam if method in ADAM_METHODS else sgd
    grid = [{"epochs": max(1, round(share * epochs)), "lr": rate * f} for share, f in GRID]
    if method == "scrub":
        grid = [dict(g, msteps=min(3, g["epochs"])) for g in grid]
    return grid[:budget]


@dataclass
class Trial:
    """One candidate's tuned run on the validation forget set.

    Parameters
    ----------
    method : str
    options : dict
    metrics : dict
        forget/retain/test error, forget loss, membership AUC of the scrubbed model (or empty on error).
    distance : float
        Σ |metric − the retraining's| over forget, retain and test error and the membership AUC (inf: failed).
    closure : float
        Share of the forget-loss gap to the retraining closed (1: on the retraining; ≤ 0: none).
    seconds : float
        Measured CPU seconds of the scrub.
    ok : bool
        The scrub's own verdict (the retain rule, the method's checks).
    note : str
        Why it failed, or empty.
    within : bool
        Within tolerance of the retraining on this draw.
    draw : int
        The validation draw it ran on (0-based).
    work : float
        Its FLOP count over the retraining's (the cost model's; nan without one): the choice's cost, the same on
        every run and engine.

    Returns
    -------
    Trial
    """

    method: str
    options: dict
    metrics: dict
    distance: float
    closure: float
    seconds: float
    ok: bool
    note: str = ""
    within: bool = False
    draw: int = 0
    work: float = math.nan


@dataclass
class TunedProfile:
    """The result of a tuning run (module docstring).

    Parameters
    ----------
    model_sha256 : str
        The tuned model's weights.
    validation : dict
        The validation forget set (size, class mix, whole class), the retraining's cost and metrics.
    original : dict
        The model's metrics on the validation sets.
    trials : list of Trial
        Every candidate run, best options per method marked by ``best``.
    tolerance, min_closure : float
        What "within tolerance of the retraining" means.
    chosen : dict
        ``method``, ``options``, ``within`` (bool), ``why`` (one sentence).
    tuning_seconds : float
        CPU seconds of the whole tuning, retraining included.

    Returns
    -------
    TunedProfile
    """

    model_sha256: str
    validation: dict
    original: dict
    trials: list[Trial]
    tolerance: float
    min_closure: float
    chosen: dict = field(default_factory=dict)
    tuning_seconds: float = 0.0
    version: int = PROFILE_VERSION

    @property
    def method(self) -> str:
        """The chosen method."""
        return self.chosen["method"]

    @property
    def options(self) -> dict:
        """The chosen method's tuned options."""
        return dict(self.chosen["options"])

    def to_dict(self) -> dict:
        """The profile as JSON-ready data (infinite distances as null)."""
        d = asdict(self)
        for t in d["trials"]:
            for k in ("distance", "closure", "work"):
                t[k] = None if not math.isfinite(t[k]) else t[k]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TunedProfile":
        """The inverse of :meth:`to_dict`; ``ValueError`` for another version or missing fields."""
        if d.get("version") not in READS_VERSIONS:
            raise ValueError(f"a tuned profile of version {d.get('version')!r}; this scrubnet reads versions "
                             f"{', '.join(map(str, READS_VERSIONS))}")
        try:
            trials = [Trial(**dict(t, distance=math.inf if t["distance"] is None else t["distance"],
                                   closure=-math.inf if t["closure"] is None else t["closure"],
                                   work=math.nan if t.get("work") is None else t["work"]))
                      for t in d["trials"]]
            return cls(**{**d, "trials": trials, "version": PROFILE_VERSION})
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a tuned profile: {e}") from None

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON (atomically: a temporary file renamed)."""
        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "TunedProfile":
        """Read a profile written by :meth:`save` (plain JSON: nothing executed)."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the tuned profile {path}: {e}") from None
        return cls.from_dict(data)

    def summary(self) -> list[str]:
        """What was tried and why one was chosen, one line each (the CLI prints them)."""
        v = self.validation
        kind = "random" if v["class"] is None else "classes " + ", ".join(
            str(d["class"]) for d in v.get("draws", [v]))
        k = len(v.get("draws", [v]))
        lines = [f"validation forget sets: {k} draw(s) of {v['n']} samples ({kind}); retrained "
                 f"{v.get('retrainings', 1)}× without them, {v['retrain_seconds']:.3g} CPU-s each",
                 f"within tolerance = closes ≥ {100 * self.min_closure:g} % of the forget-loss gap and keeps retain "
                 f"and test error within {100 * MARGIN * self.tolerance:g} points of the retraining, on every draw",
                 "closes = 1 − |L_f(run) − L_f(retraining)| / |L_f(original) − L_f(retraining)| on a draw: 100 % "
                 "lands on the retraining's forget loss, 0 % did not move it; below 0 the run moved it the wrong "
                 "way or overshot the retraining by more than the whole gap (−100 %: as far past as the original "
                 "was short)"]
        for t in sorted(self.trials, key=lambda t: (t.method, repr(sorted(t.options.items())), t.draw)):
            opts = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in t.options.items())
            state = "error: " + t.note if t.note and not t.metrics else ("within" if t.within else
                                                                        ("not ok" if not t.ok else "outside"))
            cost = (f"{t.work:.2f}× retrain (FLOPs), " if math.isfinite(t.work) else "") + \
                f"{t.seconds / max(v['retrain_seconds'], 1e-9):.2f}× measured"
            lines.append(f"  {t.method:<13} {opts:<36} draw {t.draw + 1} distance {t.distance:.3f} closes "
                         f"{100 * t.closure:5.0f} % cost {cost}  {state}")
        c = self.chosen
        spread = (f" (expected closure on its worst draw {100 * c['closure_worst']:.0f} %, median "
                  f"{100 * c['closure_median']:.0f} %, range {100 * c['closure_min']:.0f}–{100 * c['closure_max']:.0f} "
                  f"% over {c['draws']} draws)") if "closure_worst" in c else ""
        lines.append(f"chosen: {c['method']} — {c['why']}{spread}")
        return lines


def within_tolerance(t: Trial, gold: dict, tolerance: float, min_closure: float) -> bool:
    """Whether a trial's result is within tolerance of the retraining (module docstring)."""
    return t.closure >= min_closure and unbroken(t, gold, tolerance)


#: the share of the tolerance a validation run must keep (the validation set is a sample of the requests to
#: come: a run at the edge of the tolerance on it falls over on the request; measured in
#: docs/decisions/own-model-tuning.md)
MARGIN = 0.5


def unbroken(t: Trial, gold: dict, tolerance: float) -> bool:
    """A trial that ran, passed the scrub path's checks and kept retain and test error within
    ``MARGIN`` × tolerance of the retraining's (whatever it did to the forget set)."""
    tol = MARGIN * tolerance
    return bool(t.ok and t.metrics and abs(t.metrics["retain_error"] - gold["retain_error"]) <= tol
                and abs(t.metrics["test_error"] - gold["test_error"]) <= tol)


def choose(trials: list[Trial], retrain_seconds: float, gold: dict | None = None, tolerance: float = 0.05) -> dict:
    """The request's method (module docstring): the cheapest trial within tolerance; else, of the unbroken
    trials (:func:`unbroken`, when ``gold`` is given), the one closing most of the forget-loss gap; else the
    closest.

    Parameters
    ----------
    trials : list of Trial
        With ``within`` set.
    retrain_seconds : float
        The measured retraining (the costs are said against it).
    gold : dict, optional
        The retraining's readouts on the validation sets.
    tolerance : float
        Retain and test error tolerance of :func:`unbroken`.

    Returns
    -------
    dict
        ``method``, ``options``, ``within``, ``why``.
    """
    inside = [t for t in trials if t.within]
    if inside:
        t = min(inside, key=lambda t: t.seconds)
        why = (f"the cheapest of {len(inside)} tuned runs within tolerance of the retraining "
               f"({t.seconds / max(retrain_seconds, 1e-9):.2f}× its cost, closes {100 * t.closure:.0f} % of the "
               "forget-loss gap)")
        return {"method": t.method, "options": t.options, "within": True, "why": why}
    whole = [t for t in trials if gold is not None and unbroken(t, gold, tolerance)]
    if whole:
        t = max(whole, key=lambda t: t.closure)
        why = (f"NO candidate came within tolerance of the retraining; of the {len(whole)} runs that kept retain "
               f"and test error within tolerance this one closed most of the forget-loss gap "
               f"({100 * t.closure:.0f} %); the request's verdict says whether it forgot")
        return {"method": t.method, "options": t.options, "within": False, "why": why}
    ran = [t for t in trials if math.isfinite(t.distance)]
    if not ran:
        raise ValueError("no candidate method ran on the validation forget set: " +
                         "; ".join(f"{t.method}: {t.note}" for t in trials[:3]))
    t = min(ran, key=lambda t: t.distance)
    why = (f"NO candidate came within tolerance of the retraining; the closest (distance {t.distance:.3f}, closes "
           f"{100 * t.closure:.0f} % of the forget-loss gap) is run, and the request's verdict says whether it forgot")
    return {"method": t.method, "options": t.options, "within": False, "why": why}


def resolve_profile(profile: "TunedProfile | str | Path | None", model) -> TunedProfile:
    """The profile of ``method="auto"``: loaded when a path, refused (``ValueError``) when missing or tuned on
    other weights than ``model``'s.

    Parameters
    ----------
    profile : TunedProfile, str, Path or None
    model : nn.Module

    Returns
    -------
    TunedProfile
    """
    if profile is None:
        raise ValueError("method 'auto' runs the method a tuned profile chose: tune one first "
                         "(scrubnet.tuning.tune.tune, or `scrubnet tune`) and pass profile=")
    prof = profile if isinstance(profile, TunedProfile) else TunedProfile.load(profile)
    sha = weights_sha256(model)
    if sha != prof.model_sha256:
        raise ValueError(f"the tuned profile was tuned on other weights (sha256 {prof.model_sha256[:12]}…, this "
                         f"model {sha[:12]}…): tune it on this model")
    return prof


def note_auto(out, prof: TunedProfile | None, n_forget: int) -> None:
    """Record on a request's result (a ``ForgetResult``) which method the profile chose and why
    (``checks["auto"]``, ``report["auto_*"]``), and warn when the profile did not find a method within
    tolerance or was tuned on a forget set of another size; nothing without a profile."""
    if prof is None:
        return
    out.checks["auto"] = {"method": prof.method, "options": prof.options, "within": prof.chosen["within"],
                          "why": prof.chosen["why"], "tuning_seconds": prof.tuning_seconds,
                          "retrain_seconds": prof.validation["retrain_seconds"]}
    out.report["auto_within_tolerance"] = float(bool(prof.chosen["within"]))
    if not prof.chosen["within"]:
        out.warnings.append(f"auto: {prof.chosen['why']}")
    n_v = int(prof.validation["n"])
    if not n_v / 2 <= n_forget <= 2 * n_v:
        out.warnings.append(f"auto: the profile was tuned on validation forget sets of {n_v} samples, this request "
                            f"forgets {n_forget}: tune on forget sets like this one")


def _cost(trials: list[Trial], retrain_seconds: float) -> float:
    """A candidate's cost in retrainings: its FLOP count's (the same on every run), else its measured seconds."""
    if all(math.isfinite(t.work) for t in trials):
        return max(t.work for t in trials)
    return max(t.seconds for t in trials) / max(retrain_seconds, 1e-9)


def _spread(trials: list[Trial]) -> dict:
    cl = sorted(t.closure for t in trials)
    return {"closure_worst": cl[0], "closure_median": cl[(len(cl) - 1) // 2], "closure_min": cl[0],
            "closure_max": cl[-1], "draws": len(cl)}


def choose_across(per_cand: dict[int, list[Trial]], grid: list[tuple[str, dict]], n_draws: int,
                  retrain_seconds: float, golds: list[dict], tolerance: float = 0.05) -> dict:
    """The request's method over several validation draws: of the candidates that ran on every draw, the cheapest
    (:func:`_cost`) within tolerance on each draw — its worst draw decides; else the one unbroken on every draw
    whose worst closure is highest; else the closest (smallest mean distance) of any that ran. The choice's
    closure over its draws (worst, median, range) is kept with it, and ``next``: the other finalists in order of
    preference, then the chosen method run twice as long — the steps a request's self-check takes when it falls
    short of the promise.

    Parameters
    ----------
    per_cand : dict
        Candidate index → its trials (one per draw it ran on).
    grid : list of (method, options)
        The candidates.
    n_draws : int
        Draws in the plan.
    retrain_seconds : float
        One measured retraining.
    golds : list of dict
        The retraining's readouts on each draw.
    tolerance : float
        Retain and test error tolerance of :func:`unbroken`.

    Returns
    -------
    dict
        ``method``, ``options``, ``within``, ``why``, ``closure_worst`` …, ``cost``, ``next``.
    """
    full = {c: ts for c, ts in per_cand.items() if len(ts) == n_draws}
    within = [c for c, ts in full.items() if all(t.within for t in ts)]
    whole = [c for c, ts in full.items() if all(unbroken(t, golds[t.draw], tolerance) for t in ts)]

    def pref(c: int) -> tuple:
        ts = full[c]
        return (c not in within, _cost(ts, retrain_seconds) if c in within else -min(t.closure for t in ts))
    ranked = sorted(full, key=pref)
    if within:
        c = min(within, key=lambda c: (_cost(full[c], retrain_seconds), c))
        why = (f"the cheapest of {len(within)} tuned runs within tolerance of the retraining on every one of "
               f"{n_draws} validation draws ({_cost(full[c], retrain_seconds):.2f}× its cost)")
        ok = True
    elif whole:
        c = max(whole, key=lambda c: (min(t.closure for t in full[c]), -c))
        why = (f"NO candidate came within tolerance of the retraining on every draw; of the {len(whole)} that kept "
               "retain and test error within tolerance on every draw this one closed most of the forget-loss gap "
               "on its worst draw; the request's self-check and verdict say whether it forgot")
        ok = False
    else:
        ran = {c: ts for c, ts in per_cand.items() if any(math.isfinite(t.distance) for t in ts)}
        if not ran:
            first = [t for ts in per_cand.values() for t in ts][:3]
            raise ValueError("no candidate method ran on the validation forget sets: " +
                             "; ".join(f"{t.method}: {t.note}" for t in first))
        # the most draws first (a distance on one lucky draw is no better than a mean over three)
        c = min(ran, key=lambda c: (-len(ran[c]), statistics.fmean(t.distance for t in ran[c]), c))
        full.setdefault(c, ran[c])
        why = ("NO candidate came within tolerance of the retraining, and none kept retain and test error within "
               "tolerance on every draw; the closest is run, and the request's self-check and verdict say whether "
               "it forgot")
        ok = False
    method, options = grid[c]
    nxt = [{"method": grid[o][0], "options": dict(grid[o][1]),
            "closure_worst": min(t.closure for t in full[o])} for o in ranked if o != c][:2]
    if "epochs" in options:
        nxt.append({"method": method, "options": dict(options, epochs=2 * int(options["epochs"])),
                    "closure_worst": None})
    return {"method": method, "options": dict(options), "within": ok, "why": why,
            "cost": _cost(full[c], retrain_seconds), "next": nxt, **_spread(full[c])}
