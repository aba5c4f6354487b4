"""Fisher forgetting ("Eternal Sunshine"; the noise step of "Forgetting Outside the Box"). Decisions: docs/decisions/index.md.

The deterministic part of the scrub is the identity, h(w) = w (the diagonal Fisher is too crude for a Newton
step); forgetting comes from Gaussian noise shaped by the inverse Fisher of the retain set:

    w ← μ + √v ⊙ ε,   ε ~ N(0, I),   μ = w,

with, per parameter tensor and F the diagonal **true** Fisher on D_r (mean over samples, eval mode):

    form="code"  (authors' code, default): v = α · c(1/(F + 1e-8))
    form="paper" (thesis, std ∝ F^{-1/4}):  v = √(α · c(1/(F + 1e-8)))     (α plays (λσ_h²))

where c clamps 1/(F+1e-8) at 1e3, and at 1e2 for the classifier head (``clamp``). Then, as in the authors'
code: for tensors with ndim > 1 the variance is averaged over dim 1 (input features/channels) and broadcast
back (``per_output_mean``); head parameters and 1-D parameters (biases, BatchNorm γ/β) get their variance
multiplied by ``boost`` (10); for whole-class forgetting the forgotten class's head row (weight row and bias
entry) gets mean 0 and variance 1e-4 (absolute, after every other rule; the code sets 1e-4 before its ×10 —
we keep the value itself).

**Noise scale.** Given no α, the method sets it from a budget on the retain-loss increase
(:func:`alpha_for_budget`, default :data:`DEFAULT_LOSS_BUDGET` nats), relative to the model at hand.
**scrubnet's protocol uses α = 3e-6** (:data:`DEFAULT_ALPHA`, the class's ``protocol_options``), chosen on the embedded default experiment instead of the
authors' 1e-6 (tuned for 32×32 images), which barely moves the MLP; the measured trade-off is in
docs/decisions/fisher-newton.md ("Fisher forgetting"), and ``scrubnet sweep --method fisher`` shows the whole curve.

The result carries the Gaussian N(μ, diag v) it sampled from; :meth:`FisherForgetting.noise_at` gives the
same procedure at another model (its own Fisher), from which the evaluator computes the white-box bound
(``info_weights_nats``, :mod:`scrubnet.readouts.information`) against the same-seed retrain model.
"""
from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.curvature.fallbacks import fallbacks_report
from scrubnet.curvature.fisher import FISHER_KINDS, fisher_diag
from scrubnet.device import model_device, seeded_generator
from scrubnet.methods.artifacts import ArtifactCache, fisher_key
from scrubnet.models import find_classifier
from scrubnet.data.stream import DataStream, as_stream
from scrubnet.methods.base import ForgetContext, ForgettingMethod, Option, ScrubResult, WeightGaussian, register
from scrubnet.training.cost import fisher_diagonal_cost, forward_flops, seconds_at
from scrubnet.models import eval_mode
from scrubnet.models.call import call_model

DEFAULT_ALPHA = 3e-6
FORMS = ("code", "paper")
FISHER_EPS = 1e-8
CLAMP_MAX = 1e3
CLAMP_MAX_HEAD = 1e2
FORGOTTEN_ROW_VAR = 1e-4


def head_param_names(model: nn.Module, num_classes: int, classifier: str | None = None) -> set[str]:
    """Names of the classifier-head parameters: those of the model's classifier (``classifier`` when given,
    else found as ``head``, ``fc`` or ``classifier``: :func:`scrubnet.models.find_classifier`), else (the
    authors' rule) every trainable parameter whose first dimension equals ``num_classes``."""
    try:
        prefix, _ = find_classifier(model, classifier)
    except ValueError:
        if classifier is not None:
            raise
        return {k for k, p in model.named_parameters() if p.requires_grad and p.ndim >= 1 and p.shape[0] == num_classes}
    return {f"{prefix}.{k}" for k, p in model.get_submodule(prefix).named_parameters() if p.requires_grad}


def fisher_noise_variance(model: nn.Module, fisher: dict[str, Tensor], *, alpha: float, num_classes: int,
                          forget_class: int | None = None, form: str = "code", clamp: bool = True,
                          per_output_mean: bool = True, boost: float = 10.0, classifier: str | None = None
                          ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The noise mean μ and variance v of Fisher forgetting (rules in the module docstring), as dicts over
    the trainable parameters of ``model``. ``fisher`` maps every such name to its diagonal Fisher."""
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r}; choose one of {', '.join(FORMS)}")
    if boost <= 0:
        raise ValueError(f"boost must be > 0, got {boost}")
    if forget_class is not None and not 0 <= forget_class < num_classes:
        raise ValueError(f"forget_class {forget_class} outside 0..{num_classes - 1}")
    head = head_param_names(model, num_classes, classifier)
    mean, var = {}, {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name not in fisher:
            raise ValueError(f"no Fisher for parameter {name!r}")
        f = fisher[name].detach().to(torch.float64)
        if f.shape != p.shape:
            raise ValueError(f"Fisher of {name!r} has shape {tuple(f.shape)}, parameter {tuple(p.shape)}")
        if bool(torch.any(f < 0)):
            raise ValueError(f"Fisher of {name!r} has negative entries")
        inv = 1.0 / (f + FISHER_EPS)
        if clamp:
            inv = inv.clamp(max=CLAMP_MAX_HEAD if name in head else CLAMP_MAX)
        v = alpha * inv if form == "code" else torch.sqrt(alpha * inv)
        if per_output_mean and v.ndim > 1:
            v = v.mean(dim=1, keepdim=True).expand_as(v).clone()
        if name in head or v.ndim == 1:
            v = v * boost
        m = p.detach().clone()
        if forget_class is not None and name in head:
            m[forget_class] = 0.0
            v[forget_class] = FORGOTTEN_ROW_VAR
        mean[name] = m
        var[name] = v.to(p.dtype)
    return mean, var


def sample_gaussian_weights(model: nn.Module, mean: dict[str, Tensor], var: dict[str, Tensor],
                            generator: torch.Generator) -> nn.Module:
    """A deep copy of ``model`` with w = μ + √v ⊙ ε (ε ~ N(0, I) from ``generator``, named-parameter order)."""
    noisy = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in noisy.named_parameters():
            if name in mean:
                eps = torch.randn(p.shape, generator=generator, dtype=p.dtype, device=generator.device).to(p.device)
                p.copy_(mean[name] + var[name].sqrt() * eps)
    return noisy


def _cached_fisher(model: nn.Module, x: Tensor, y: Tensor, kind: str, batch_size: int | None,
                   cache: ArtifactCache | None) -> dict[str, Tensor]:
    """fisher_diag, memoised in ``cache`` (key: the model's weights, the data, the Fisher kind)."""
    if cache is None:
        return fisher_diag(model, x, y, kind=kind, batch_size=batch_size)
    return cache.get_or_compute(fisher_key(model, x, y, kind),
                                lambda: fisher_diag(model, x, y, kind=kind, batch_size=batch_size))


def fisher_noise(model: nn.Module, retain, *, alpha: float, num_classes: int, forget_class: int | None = None,
                 form: str = "code", generator: torch.Generator | None = None, seed: int | None = None,
                 kind: str = "true", clamp: bool = True, per_output_mean: bool = True, boost: float = 10.0,
                 fisher: dict[str, Tensor] | None = None, batch_size: int | None = None,
                 cache: ArtifactCache | None = None, classifier: str | None = None
                 ) -> tuple[nn.Module, dict[str, Tensor], dict[str, Tensor]]:
    """Fisher forgetting of ``model`` with its own diagonal Fisher on ``retain`` = (x, y).

    Returns ``(noisy_model, mean, var)``: a new model with w = μ + √v ⊙ ε, and μ, v as dicts over the
    trainable parameters (see :func:`fisher_noise_variance`). The noise comes from ``generator``, or from a
    generator seeded with ``seed`` (one of the two is required). ``fisher`` may be passed precomputed (e.g.
    at another point, as NTK+Fisher does); else it is computed (kind "true" or "empirical") and memoised in
    ``cache`` when given.
    """
    if generator is None:
        if seed is None:
            raise ValueError("fisher_noise needs a generator or a seed")
        generator = seeded_generator(seed, model_device(model))
    if kind not in FISHER_KINDS:
        raise ValueError(f"unknown Fisher kind {kind!r}; choose one of {', '.join(FISHER_KINDS)}")
    if fisher is None:
        x, y = retain
        fisher = _cached_fisher(model, x, y, kind, batch_size, cache)
    mean, var = fisher_noise_variance(model, fisher, alpha=alpha, num_classes=num_classes,
                                      forget_class=forget_class, form=form, clamp=clamp,
                                      per_output_mean=per_output_mean, boost=boost, classifier=classifier)
    return sample_gaussian_weights(model, mean, var, generator), mean, var


def stream_fisher(model: nn.Module, retain: DataStream, kind: str, batch_size: int | None,
                  cache: ArtifactCache | None) -> dict[str, Tensor]:
    """The Fisher diagonal on a stream: the in-memory path for tensors (memoised), else the chunk sums
    Σ_c N_c·F_c / N (each chunk's Fisher is a mean over its samples)."""
    if retain.kind == "tensors":
        return _cached_fisher(model, retain.x, retain.y, kind, batch_size, cache)
    acc: dict[str, Tensor] = {}
    n = 0
    for x, y in retain.chunks():
        fc = fisher_diag(model, x, y if kind == "empirical" else None, kind=kind, batch_size=batch_size)
        for k, v in fc.items():
            acc[k] = acc[k] + v * len(y) if k in acc else v * len(y)
        n += len(y)
    if n == 0:
        raise ValueError("cannot compute a Fisher on an empty data set")
    return {k: v / n for k, v in acc.items()}


#: the subsample's Fisher is the mean of this many disjoint parts; their spread gives its standard error
SUBSAMPLE_PARTS = 8


def subsample_fisher(model: nn.Module, retain: DataStream, k: int, kind: str, batch_size: int | None,
                     seed: int) -> tuple[dict[str, Tensor], dict[str, float]]:
    """The Fisher diagonal on ``k`` samples of D_r drawn without replacement (seeded), with its variance.

    The ``k`` samples are split into :data:`SUBSAMPLE_PARTS` disjoint parts; the estimate is their
    size-weighted mean. Returns (the diagonal, info) with ``fisher_subsample`` = k, ``fisher_trace_rel_se``
    = the standard error of the estimate's trace over the parts, relative to the trace (the sampling error
    the subsample adds to the noise scale), and ``fisher_diag_rel_se_median`` = the median over parameters of
    the same ratio entry by entry.
    """
    if not retain.indexable:
        raise ValueError("fisher subsample: D_r must be tensors or an indexable Dataset, not a DataLoader")
    g = torch.Generator().manual_seed(10_007 * int(seed) + 41)
    idx = torch.randperm(len(retain), generator=g)[:k]
    parts = [fisher_diag(model, *_xy(retain.take(p), kind), kind=kind, batch_size=batch_size)
             for p in idx.tensor_split(SUBSAMPLE_PARTS)]
    sizes = torch.tensor([len(p) for p in idx.tensor_split(SUBSAMPLE_PARTS)], dtype=torch.float64)
    w = sizes / sizes.sum()
    fisher = {n: sum(float(w[j]) * parts[j][n] for j in range(len(parts))) for n in parts[0]}
    traces = torch.tensor([sum(float(v.double().sum()) for v in p.values()) for p in parts], dtype=torch.float64)
    m = len(parts)
    mean_tr = float((w * traces).sum())
    se_tr = float(traces.std(unbiased=True)) / m ** 0.5
    flat = torch.stack([torch.cat([p[n].double().reshape(-1) for n in fisher]) for p in parts])
    est = flat.mean(0)
    rel = (flat.std(0, unbiased=True) / m ** 0.5) / est.clamp_min(1e-30)
    return fisher, {"fisher_subsample": float(k), "fisher_trace_rel_se": se_tr / max(abs(mean_tr), 1e-30),
                    "fisher_diag_rel_se_median": float(rel[est > 0].median()) if bool((est > 0).any()) else 0.0}


def _xy(chunk: tuple[Tensor, Tensor], kind: str) -> tuple[Tensor, Tensor | None]:
    x, y = chunk
    return x, (y if kind == "empirical" else None)


def alpha_for_budget(model: nn.Module, fisher: dict[str, Tensor], budget: float, **variance_options) -> float:
    """α whose noise raises the mean retain loss by ``budget`` nats to second order.

    For w + n, n ~ N(0, diag v), E[L_r(w + n)] − L_r(w) ≈ ½ Σ_j F_j v_j (F: the Fisher = Gauss–Newton diagonal
    of the retain loss). With v = α·u (form "code") that is α = 2·budget / Σ_j F_j u_j; with v = √(α·u) (form
    "paper") √α = 2·budget / Σ_j F_j √u_j. ``u`` is :func:`fisher_noise_variance` at α = 1 without the
    forgotten-class rule (those entries are absolute, not scaled by α)."""
    opts = {**variance_options, "forget_class": None}
    _, unit = fisher_noise_variance(model, fisher, alpha=1.0, **opts)
    form = opts.get("form", "code")
    total = sum(float((fisher[k].double() * unit[k].double()).sum()) for k in unit)
    if not total > 0:
        raise ValueError("the retain Fisher is zero: the retain loss does not depend on the weights")
    return 2.0 * budget / total if form == "code" else (2.0 * budget / total) ** 2


def _stream_mean_loss(model: nn.Module, data: DataStream) -> float:
    total, n = 0.0, 0
    with torch.no_grad(), eval_mode(model):
        for x, y in data.chunks():
            total += float(F.cross_entropy(call_model(model, x), y, reduction="sum"))
            n += len(y)
    return total / max(n, 1)


#: the default budget on the mean retain cross-entropy the noise may add (nats)
DEFAULT_LOSS_BUDGET = 0.05
#: the budgeted mode measures the α search's retain-loss rise on max(this, subsample) seeded samples of D_r: a
#: paired difference of two means on the same samples, whose sampling error is far below the 0.05-nat budget,
#: so the search's passes stop growing with N (at N = 5,000 on a ResNet they were 0.65 of one retraining)
LOSS_SAMPLE_MIN = 2000


def loss_sample_size(n_retain: int, subsample: int | None) -> int:
    """Samples of D_r the α search's losses are measured on: all without ``subsample``, else
    min(N_r, max(:data:`LOSS_SAMPLE_MIN`, ``subsample``))."""
    return n_retain if subsample is None else min(n_retain, max(LOSS_SAMPLE_MIN, int(subsample)))
#: resample at half α while the measured increase exceeds this multiple of the budget, at most this often
BUDGET_SLACK, BUDGET_RETRIES = 2.0, 6


def check_noise_scale(alpha: float | None, retain_loss_budget: float | None) -> None:
    """Refuse a noise scale given twice or out of range: ``alpha`` > 0 or ``retain_loss_budget`` > 0 (nats), not
    both (``ValueError`` naming the option)."""
    if alpha is not None and not float(alpha) > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if alpha is not None and retain_loss_budget is not None:
        raise ValueError("give alpha or retain_loss_budget, not both")
    if retain_loss_budget is not None and not float(retain_loss_budget) > 0:
        raise ValueError(f"retain_loss_budget must be > 0, got {retain_loss_budget}")


@register("fisher")
class FisherForgetting(ForgettingMethod):
    """Fisher forgetting: w + √(α·v(F)) ε with the authors' options (module docstring).

    Parameters
    ----------
    alpha : float or None
        An explicit noise scale (scrubnet's own protocol uses :data:`DEFAULT_ALPHA`). Give it or
        ``retain_loss_budget``, not both.
    form : {"code", "paper"}
        The variance formula: the authors' released code (default) or the paper's.
    kind : {"true", "mc", "empirical"}
        Which Fisher diagonal (default "true").
    clamp : bool
        Clamp 1/(F + 1e-8) at 1e3 (1e2 for the head), as the authors' code (default True).
    per_output_mean : bool
        Average the variance over a parameter's output dimension (module docstring; default True).
    boost : float
        Variance multiplier of the head and of 1-D parameters (biases, BatchNorm; default 10).
    batch_size : int or None
        Fisher vmap batch (default: planned by the memory budget).
    classifier : str or None
        Name of the final layer when it is not ``head``, ``fc`` or ``classifier``.
    retain_loss_budget : float or None
        Nats (default :data:`DEFAULT_LOSS_BUDGET` when ``alpha`` is not given): α is set so the noise raises the
        mean retain cross-entropy by that much (:func:`alpha_for_budget`), the rise is then measured on the
        sample and α halved while it exceeds twice the budget.
    subsample : int or None
        The budgeted mode: the Fisher diagonal on this many samples of D_r (≥ 8, drawn without replacement,
        seeded; :func:`subsample_fisher`), its sampling error reported in ``info`` (``fisher_subsample``,
        ``fisher_trace_rel_se``, ``fisher_diag_rel_se_median``); the α search then measures the retain-loss
        rise on :func:`loss_sample_size` seeded samples (``retain_loss_samples``). Default None: all of D_r.

    Returns
    -------
    ScrubResult
        ``scrub`` returns the noisy model (eval mode) and ``noise``, the :class:`WeightGaussian` it was drawn
        from; ``info``: ``alpha`` (the scale used), ``fisher_seconds`` (seconds), ``noise_std_median`` (weight
        units), ``fallbacks`` and, with a budget, ``retain_loss_increase``, ``retain_loss_budget`` (nats) and
        ``alpha_halvings``. ``ok`` is False when the rise stays above twice the budget.

    Raises
    ------
    ValueError
        When ``ctx.num_classes`` is unset or the recipe's loss is not cross-entropy.
    """

    uses_curvature = True
    noisy = True
    streams = True
    passes = "1 (Fisher) + 2 (loss before and after; budget mode) + 1 per halving"
    protocol_options = {"alpha": DEFAULT_ALPHA}
    options = {"alpha": Option(float | None, "> 0"), "form": Option(str, choices=FORMS, default="code"),
               "kind": Option(str, choices=tuple(FISHER_KINDS), default="true"),
               "clamp": Option(bool, default=True), "per_output_mean": Option(bool, default=True),
               "boost": Option(float, "> 0", default=10.0), "batch_size": Option(int | None, ">= 1"),
               "classifier": Option(str | None), "retain_loss_budget": Option(float | None, "> 0"),
               "subsample": Option(int | None, ">= 8")}
    #: the option of the budgeted mode (:func:`scrubnet.cost_guard.budgeted_options`)
    budget_knob = "subsample"
    budget_replaces = ()

    @classmethod
    def cost(cls, model, x1, n_retain, n_forget, num_classes, config, *, kind: str = "true",
             batch_size: int | None = None, alpha: float | None = None, subsample: int | None = None, **_options):
        """The Fisher diagonal on D_r (:func:`~scrubnet.curvature.fisher.plan_fisher`) and the noise draws
        (O(p) each); without ``alpha``, the α search's forward passes over D_r: the base loss and at most
        1 + :data:`BUDGET_RETRIES` noisy draws (an upper bound). Budgeted (``subsample``): the diagonal on
        that many samples of D_r, the losses on :func:`loss_sample_size` of them."""
        n_fisher = n_retain if subsample is None else min(int(subsample), n_retain)
        est = fisher_diagonal_cost(model, x1, n_fisher, kind=kind, batch_size=batch_size)
        if alpha is None:
            evals = (2 + BUDGET_RETRIES) * loss_sample_size(n_retain, subsample) * forward_flops(model, x1)
            est.flops += evals
            est.seconds += seconds_at(evals, "newton")
            est.details["alpha_search_flops"] = evals
        return est

    def __init__(self, alpha: float | None = None, form: str = "code", kind: str = "true", clamp: bool = True,
                 per_output_mean: bool = True, boost: float = 10.0, batch_size: int | None = None,
                 classifier: str | None = None, retain_loss_budget: float | None = None,
                 subsample: int | None = None):
        if subsample is not None and int(subsample) < SUBSAMPLE_PARTS:
            raise ValueError(f"subsample must be ≥ {SUBSAMPLE_PARTS}, got {subsample}")
        self.subsample = None if subsample is None else int(subsample)
        check_noise_scale(alpha, retain_loss_budget)
        if form not in FORMS:
            raise ValueError(f"unknown form {form!r}; choose one of {', '.join(FORMS)}")
        if kind not in FISHER_KINDS:
            raise ValueError(f"unknown Fisher kind {kind!r}; choose one of {', '.join(FISHER_KINDS)}")
        self.alpha = None if alpha is None else float(alpha)
        self.budget = None if alpha is not None else float(retain_loss_budget or DEFAULT_LOSS_BUDGET)
        self.form, self.kind = form, kind
        self.clamp, self.per_output_mean, self.boost = bool(clamp), bool(per_output_mean), float(boost)
        self.batch_size = batch_size
        self.classifier = classifier
        self.alpha_used: float | None = self.alpha

    def _variance_options(self, ctx: ForgetContext) -> dict:
        return dict(num_classes=ctx.num_classes, forget_class=ctx.forget_class, form=self.form, clamp=self.clamp,
                    per_output_mean=self.per_output_mean, boost=self.boost, classifier=self.classifier)

    def scrub(self, model: nn.Module, retain, forget, ctx: ForgetContext) -> ScrubResult:
        if ctx.num_classes < 1:
            raise ValueError("fisher forgetting needs ctx.num_classes")
        if ctx.recipe.loss != "cross_entropy":
            raise ValueError("fisher forgetting shapes its noise by the Fisher of a cross-entropy model; the "
                             f"recipe's loss is {ctx.recipe.loss!r}")
        t0 = time.perf_counter()
        info: dict[str, float] = {}
        if self.subsample is not None and self.subsample < len(retain):
            fisher, info = subsample_fisher(model, retain, self.subsample, self.kind, self.batch_size, ctx.seed)
        else:
            fisher = stream_fisher(model, retain, self.kind, self.batch_size, ctx.cache)
        opts = self._variance_options(ctx)
        alpha = self.alpha if self.alpha is not None else alpha_for_budget(model, fisher, self.budget, **opts)
        loss_data = retain
        n_loss = loss_sample_size(len(retain), self.subsample)
        if self.budget is not None and n_loss < len(retain) and retain.indexable:   # budgeted: a seeded sample
            g = torch.Generator().manual_seed(10_007 * int(ctx.seed) + 43)
            loss_data = as_stream(retain.take(torch.randperm(len(retain), generator=g)[:n_loss]))
            info["retain_loss_samples"] = float(n_loss)
        base = _stream_mean_loss(model, loss_data) if self.budget is not None else float("nan")
        for tries in range(BUDGET_RETRIES + 1):
            gen = seeded_generator(10_007 * int(ctx.seed) + 31, model_device(model))
            mean, var = fisher_noise_variance(model, fisher, alpha=alpha, **opts)
            noisy = sample_gaussian_weights(model, mean, var, gen)
            if self.budget is None:
                break
            rise = _stream_mean_loss(noisy, loss_data) - base
            info.update(retain_loss_increase=rise, retain_loss_budget=self.budget, alpha_halvings=float(tries))
            if rise <= BUDGET_SLACK * self.budget or tries == BUDGET_RETRIES:
                break
            alpha *= 0.5
        self.alpha_used = alpha
        info.update({"alpha": alpha, "fisher_seconds": time.perf_counter() - t0,
                     "noise_std_median": float(torch.cat([v.reshape(-1).double() for v in var.values()]).sqrt().median())})
        info["fallbacks"] = fallbacks_report(model, retain)   # autodiff paths taken (curvature.fallbacks)
        res = ScrubResult(model=noisy.eval(), info=info, noise=WeightGaussian(mean, var))
        if self.budget is not None and info["retain_loss_increase"] > BUDGET_SLACK * self.budget:
            res.fail(f"the noise raised the retain loss by {info['retain_loss_increase']:.3g} nats, more than "
                     f"{BUDGET_SLACK:g}× the budget {self.budget:g}, even at α = {alpha:.3g}")
        return res

    def noise_at(self, model: nn.Module, retain, forget, ctx: ForgetContext) -> WeightGaussian:
        """The Fisher-forgetting Gaussian of ``model`` with its own Fisher on D_r, at the α the scrub used."""
        if self.alpha_used is None:
            raise ValueError("noise_at needs the α of a scrub: run the scrub first (or give alpha)")
        fisher = stream_fisher(model, as_stream(retain), self.kind, self.batch_size, ctx.cache)
        mean, var = fisher_noise_variance(model, fisher, alpha=self.alpha_used, **self._variance_options(ctx))
        return WeightGaussian(mean, var)
