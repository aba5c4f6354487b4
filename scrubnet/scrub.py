"""The one scrub path: :func:`scrub_and_measure`.

Every entry point that runs a method goes through it — :func:`scrubnet.forget`, ``scrubnet forget``
(``--checkpoint`` and ``--model``), the experiment runner (``scrubnet run``) and the audit pool — so the honesty
checks exist once:

1. the stationarity check of the recipe before a curvature method, when the context asks for it
   (``ctx.verify_recipe``, set for a user's model): refused with
   :class:`~scrubnet.recipe.objective.RecipeMismatch` unless ``ctx.force``;
2. the method's own failure (a solver at its iteration cap or above its tolerance, a refused step): the
   result is ``ok=False`` with the method's reasons;
3. the retain guard (:mod:`scrubnet.training.guard`) while a fine-tuning method runs (``retain_rule="fail"``):
   a retain error rising past half the tolerance on a probe of D_r puts back the last good weights and halves
   the step sizes, then stops the training; what it did is in ``checks["retain_guard"]`` and the warnings;
4. the retain-error rule: a scrub that raises the error on D_r by more than ``retain_error_tolerance`` is
   ``ok=False`` (``retain_rule="fail"``, every entry point but one) or only reported in
   ``checks["retain_error"]`` (``retain_rule="report"``: the protocol experiment, whose results record the
   method's own verdict and every readout, and must not change with this rule);
5. the forgetting verdict, when held-out data are given (``test``): does D_f now look like data the model
   never saw (:func:`~scrubnet.readouts.forgetting.forgetting_verdict`, no retrained model needed)? A method
   whose purpose is forgetting (its ``forgets`` trait) that ends at ``did_not_forget`` or ``moved_wrong_way``
   is ``ok=False`` (``on_not_forgotten="fail"``) or only warned (``"warn"``); the verdict is in
   ``result.forgetting`` either way.

A failed scrub is never raised here: :func:`scrubnet.forget` raises :class:`ScrubFailed` for ``ok=False``
(unless ``on_failure="return"``), the CLI writes nothing and exits 2, the runner records the reasons.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from torch import nn

from scrubnet.data.stream import as_stream
from scrubnet.methods.base import ForgetContext, ForgettingMethod, ScrubResult, WeightGaussian
from scrubnet.readouts.basic import stream_error_and_loss
from scrubnet.readouts.forgetting import UNDECIDED, ForgettingVerdict, forgetting_verdict
from scrubnet.readouts.information import weight_information
from scrubnet.recipe import TrainingRecipe
from scrubnet.recipe.objective import check_stationarity
from scrubnet.training.guard import GUARD_SHARE, RetainGuard, active_guard

#: what the retain-error rule does with a scrub over the tolerance
RETAIN_RULES = ("fail", "report")
#: methods that draw a random part of D_r by index (a DataLoader reaches them as its data set read by index)
DRAWS_PART_OF_RETAIN = frozenset({"bad-teacher"})
#: the default tolerance of the retain-error rule (a fraction: 0.05 = 5 points of error)
RETAIN_ERROR_TOLERANCE = 0.05
#: what a failing forgetting verdict does to a method whose purpose is forgetting
ON_NOT_FORGOTTEN = ("fail", "warn")


class ScrubFailed(RuntimeError):
    """The method did not do what it claims (raised by :func:`scrubnet.forget` when ``on_failure="raise"``).

    Parameters
    ----------
    result : ForgetResult
        The failed result (``ok`` False, its ``reasons``; the scrubbed model in ``result.scrub.model``).

    Returns
    -------
    ScrubFailed
        A ``RuntimeError`` whose message names the method and its reasons; ``.result`` holds ``result``.
    """

    def __init__(self, result: "ForgetResult"):
        self.result = result
        super().__init__(f"method {result.method!r} failed: " + "; ".join(result.reasons))


@dataclass
class ForgetResult:
    """What a scrub reports.

    Parameters
    ----------
    ok : bool
        Whether the scrub did what it claims.
    reasons : list of str
        Why not (one sentence each); empty when ``ok``.
    method : str
        The method's name.
    recipe : TrainingRecipe
        The recipe used.
    report : dict of str to float
        The method's own numbers (seconds, solver iterations and residuals, step lengths, α …) and the retain
        error before and after (``retain_error_before`` / ``retain_error_after``, fractions in [0, 1]).
    noise : WeightGaussian or None
        The Gaussian a noisy method sampled the weights from (None for a deterministic one).
    bounds : dict of str to float
        ``info_weights_nats`` = KL(scrub's Gaussian ‖ the same procedure at ``reference``), in nats, when a
        reference was given to a noisy method.
    readouts : dict of str to float
        Error (fraction) and mean cross-entropy (nats) on retain, forget (and test) of the scrubbed and the input
        model, when asked.
    checks : dict of str to dict
        The honesty checks' outcomes: ``retain_error`` (``{"before", "after", "tolerance", "passed"}``) and,
        when it ran, ``stationarity`` (its numbers).
    scrub : ScrubResult or None
        The method's own :class:`~scrubnet.methods.base.ScrubResult` (model, info, noise, the reference and
        original it supplies).
    forgetting : ForgettingVerdict or None
        The :class:`~scrubnet.readouts.forgetting.ForgettingVerdict` (D_f against held-out data, before and
        after; its ``summary`` is one line), None without held-out data.
    warnings : list of str
        What the user must know though the scrub is ``ok`` (a Newton step damped to a near no-op, a failing
        verdict under ``on_not_forgotten="warn"``, a verdict that could not be computed).
    cost : dict of str to float
        What the call cost against retraining, when the entry point measured it
        (:func:`scrubnet.cost_guard.measured_cost`: ``seconds``, ``retrain_seconds_estimate``,
        ``cost_vs_retrain`` …).

    Returns
    -------
    ForgetResult
        Returned by :func:`scrubnet.forget` (second element) and :func:`scrub_and_measure`.
    """

    ok: bool
    reasons: list[str]
    method: str
    recipe: TrainingRecipe
    report: dict[str, float] = field(default_factory=dict)
    noise: WeightGaussian | None = None
    bounds: dict[str, float] = field(default_factory=dict)
    readouts: dict[str, float] = field(default_factory=dict)
    checks: dict[str, dict] = field(default_factory=dict)
    scrub: ScrubResult | None = field(default=None, repr=False)
    forgetting: ForgettingVerdict | None = None
    warnings: list[str] = field(default_factory=list)
    cost: dict[str, float] = field(default_factory=dict)

    @property
    def model(self) -> nn.Module:
        """The scrubbed model."""
        return self.scrub.model


def scrub_and_measure(method: ForgettingMethod, model: nn.Module, retain, forget, ctx: ForgetContext, *,
                      retain_error_tolerance: float = RETAIN_ERROR_TOLERANCE, retain_rule: str = "fail",
                      reference: nn.Module | None = None, readouts: bool = False, test=None,
                      on_not_forgotten: str = "fail", references=None, forget_ids=None) -> ForgetResult:
    """Run ``method`` on ``model`` with the honesty checks (module docstring) and measure what a caller asked.

    Parameters
    ----------
    method : ForgettingMethod
        The configured method (:func:`~scrubnet.methods.base.get_method` / ``protocol_method``).
    model : nn.Module
        The trained model; not modified.
    retain, forget, test : tensors, Dataset, DataLoader or DataStream
        D_r, D_f (and held-out data for the readouts and the verdict), each chunked by ``ctx.chunk_size``.
    ctx : ForgetContext
        From :meth:`ForgetContext.from_recipe` or :func:`~scrubnet.methods.base.protocol_context`.
    retain_error_tolerance : float
        The largest allowed rise of the retain error (a fraction in [0, 1]).
    retain_rule : {"fail", "report"}
        What a rise over the tolerance does: ``ok=False`` with a reason, or only ``checks["retain_error"]``.
    reference : nn.Module, optional
        A model retrained without D_f: with a noisy method, ``bounds["info_weights_nats"]``.
    readouts : bool
        Also measure error and loss (mean CE) on D_r, D_f (and ``test``) before and after, streamed.
    on_not_forgotten : {"fail", "warn"}
        What a ``did_not_forget`` / ``moved_wrong_way`` verdict does to a method whose ``forgets`` trait is
        set: ``ok=False`` with the numbers as the reason, or a warning (``result.warnings``).
    references, forget_ids : ReferenceModels, ids; optional: the verdict's calibration (``forgetting_verdict``)

    Returns
    -------
    ForgetResult
        Never raises for a failed scrub (``ok=False``); raises for bad input and for a refused recipe.
    """
    if not 0 <= retain_error_tolerance <= 1:
        raise ValueError(f"retain_error_tolerance must be in [0, 1], got {retain_error_tolerance}")
    if retain_rule not in RETAIN_RULES:
        raise ValueError(f"retain_rule must be one of {', '.join(RETAIN_RULES)}, got {retain_rule!r}")
    if on_not_forgotten not in ON_NOT_FORGOTTEN:
        raise ValueError(f"on_not_forgotten must be one of {', '.join(ON_NOT_FORGOTTEN)}, got {on_not_forgotten!r}")
    retain_s, forget_s = as_stream(retain, chunk_size=ctx.chunk_size), as_stream(forget, chunk_size=ctx.chunk_size)
    checks: dict[str, dict] = {}
    if method.uses_curvature and method.needs_retain and ctx.verify_recipe and not ctx.force:
        st = check_stationarity(model, retain_s, ctx.recipe, ctx.center(model), method=method.name)
        checks["stationarity"] = st.as_dict()
    res, guard = _guarded_run(method, model, retain_s, forget_s, ctx, retain_error_tolerance, retain_rule)
    res.info.update(checks.get("stationarity", {}))
    out = ForgetResult(ok=res.ok, reasons=list(res.reasons), method=method.name, recipe=ctx.recipe,
                       report=dict(res.info), noise=res.noise, checks=checks, scrub=res, warnings=list(res.warnings))
    if reference is not None and res.noise is not None:
        other = method.noise_at(reference, retain_s, forget_s, ctx)
        if other is not None:
            out.bounds.update(weight_information(res.noise.mean, res.noise.var, other.mean, other.var))
    # the honesty check every method gets: a scrub that costs the retain set more than a few points of error
    # is reported as failed, whatever the method thinks of itself
    err_in, loss_in = stream_error_and_loss(model, retain_s)
    err_out, loss_out = stream_error_and_loss(res.model, retain_s)
    passed = not err_out - err_in > retain_error_tolerance
    checks["retain_error"] = {"before": err_in, "after": err_out, "tolerance": retain_error_tolerance,
                              "passed": passed}
    out.report.update(retain_error_before=err_in, retain_error_after=err_out)
    if not passed and retain_rule == "fail":
        out.ok = False
        out.reasons.append(f"the retain error rose from {100 * err_in:.1f} % to {100 * err_out:.1f} %, more than "
                           f"the tolerance of {100 * retain_error_tolerance:g} points")
    if readouts:
        out.readouts.update(retain_error=err_out, retain_loss=loss_out, original_retain_error=err_in,
                            original_retain_loss=loss_in)
        sets = {"forget": forget_s}
        if test is not None:
            sets["test"] = as_stream(test, chunk_size=ctx.chunk_size)
        for part, data in sets.items():
            for tag, m in (("", res.model), ("original_", model)):
                err, loss = stream_error_and_loss(m, data)
                out.readouts[f"{tag}{part}_error"], out.readouts[f"{tag}{part}_loss"] = err, loss
    if test is not None:
        verdict_step(out, method, model, retain_s, forget_s, as_stream(test, chunk_size=ctx.chunk_size),
                     on_not_forgotten, references, forget_ids)
    guard_outcome(out, guard, method.name)
    return out


def _guarded_run(method: ForgettingMethod, model: nn.Module, retain_s, forget_s, ctx: ForgetContext,
                 tolerance: float, retain_rule: str) -> tuple[ScrubResult, RetainGuard | None]:
    """Step 3: the method run under the retain guard when it fine-tunes to forget (not a curvature method, not
    an anchor; Boundary Shrink too, which reads D_f alone) and the retain rule fails scrubs; a method drawing
    part of D_r gets a DataLoader read by index."""
    guard = None
    if method.forgets and not method.uses_curvature and retain_rule == "fail" and len(retain_s) > 0:
        guard = RetainGuard.from_stream(model, retain_s, GUARD_SHARE * tolerance, seed=ctx.seed)
    given = retain_s
    if method.name in DRAWS_PART_OF_RETAIN and retain_s.indexed() is not None:
        given = retain_s.indexed()   # a DataLoader over a map-style data set: read by index, its collate_fn kept
    with active_guard(guard):
        return method(model, given, forget_s, ctx), guard


def guard_outcome(out: ForgetResult, guard: RetainGuard | None, method: str) -> None:
    """What the guard did, into ``out``: ``checks["retain_guard"]``, its events as warnings, and a failure when
    it undid every step (the model returned is the original: the method did nothing)."""
    if guard is None:
        return
    out.checks["retain_guard"] = {"checks": guard.checks, "backoffs": guard.backoffs, "stopped": guard.stopped,
                                  "probe_error_before": guard.base_error, "tolerance": guard.tolerance}
    out.warnings += [f"retain guard: {e}" for e in guard.events]
    if guard.stopped and not guard.progressed:
        out.ok = False
        out.reasons.append(f"the retain guard undid every step of {method} (the model returned is the "
                           f"original): {guard.events[-1]}; lower its rate or tune it (scrubnet tune)")


def verdict_step(out: ForgetResult, method: ForgettingMethod, model: nn.Module, retain, forget, heldout,
                 on_not_forgotten: str, references=None, forget_ids=None) -> None:
    """Step 4 of the scrub path: the forgetting verdict into ``out.forgetting`` and, for a method whose
    purpose is forgetting, a failing verdict (did_not_forget, moved_wrong_way, hidden) into ``out.ok`` /
    ``out.reasons`` (``"fail"``) or ``out.warnings`` (``"warn"``); a verdict that could not judge the scrub
    (inconclusive, nothing_to_measure) is a warning with its reason, never a silent pass.
    ``out.report["verdict_seconds"]`` is its cost (s).

    The "before" model is the method's own original when it supplies one (a method that trains its own
    model family; the reference models, which belong to ``model``, are then not used), else ``model``.
    Held-out data the verdict cannot use at all (bad input) leave ``out.forgetting`` None with a warning.
    """
    t0 = time.perf_counter()
    own = out.scrub.original is not None
    before = out.scrub.original if own else model
    refs = None if own else references
    try:
        v = forgetting_verdict(before, out.model, forget, retain, heldout, references=refs,
                               forget_ids=forget_ids if refs is not None else None)
    except ValueError as e:
        out.warnings.append(f"no forgetting verdict: {e}")
        return
    finally:
        out.report["verdict_seconds"] = time.perf_counter() - t0
    out.forgetting = v
    if not method.forgets:
        return
    if v.verdict in UNDECIDED:
        out.warnings.append(f"the forgetting verdict could not judge this scrub: {v.summary}")
        return
    if not v.failed:
        return
    msg = f"forgetting verdict {v.summary}"
    if on_not_forgotten == "fail":
        out.ok = False
        out.reasons.append(msg + " (on_not_forgotten='warn' / --warn-not-forgotten to accept it)")
    else:
        out.warnings.append(msg)
