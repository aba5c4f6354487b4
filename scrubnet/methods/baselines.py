"""The baselines of the papers: Original, Retrain, Finetune, NegGrad, Random labels, Hiding.

Decisions where the papers differ (docs/decisions/baselines.md, "Baselines and re-learn time"):
* Finetune: 10 epochs on D_r at the fine-tuning lr, same objective as fine-tuning (mean CE + the L2 pull
  toward w_0 with the protocol's wd), momentum as in fine-tuning.
* NegGrad: 10 epochs on all of D where each D_f sample's loss is negated and capped at chance level:
  per-sample term −min(CE_i, log c), so its gradient vanishes once a sample is at chance.
* Random labels: 10 epochs on D with the labels of D_f resampled uniformly over the c classes (shuffling
  within D_f would be a no-op for class forgetting).
* Hiding: class forgetting only; the forgotten class's head row (weight and bias) is replaced by a fresh
  random initialisation (the appendix's version).
"""
from __future__ import annotations

import copy
import math

import torch
from torch import Tensor, nn

from scrubnet.methods.artifacts import retrain_key
from scrubnet.methods.base import ForgetContext, ForgettingMethod, Option, ScrubResult, register
from scrubnet.models import find_classifier, freeze_batchnorm
from scrubnet.device import model_device, seeded_generator
from scrubnet.curvature.ggn import per_sample_loss
from scrubnet.data.stream import DataStream
from scrubnet.recipe import PROTOCOL_BASELINE_EPOCHS
from scrubnet.recipe.retrain import initial_model, make_optimizer, retrain_like_user
from scrubnet.training import DEFAULT_RETRAIN_MODE, RETRAIN_MODES, batch_loss, l2_pull, retrain as retrain_fn, sgd_loop
from scrubnet.training.cost import copy_cost, train_cost
from scrubnet.training.guard import guard_after_step, guard_scope
from scrubnet.models.call import call_model, cat_inputs


#: epochs of the Finetune, NegGrad and Random-labels baselines (the papers' 10): their own length, whatever
#: the recipe's training epochs (scrubnet's protocol recipe states the same 10)
BASELINE_EPOCHS = PROTOCOL_BASELINE_EPOCHS


def _optimizer(model: nn.Module, ctx: ForgetContext, lr: float | None) -> torch.optim.Optimizer:
    """The recipe's optimiser at ``lr`` (default the recipe's rate, *for its optimiser*: an AdamW recipe's rate
    is AdamW's, never SGD's): SGD with the decay as the optimiser's ``weight_decay`` (a pull to a given w_0 is
    :func:`_step`'s term), or AdamW with its decoupled λ (:func:`~scrubnet.recipe.retrain.make_optimizer`)."""
    r = ctx.recipe
    if r.optimizer != "sgd":
        return make_optimizer(model, r, lr)
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=r.lr if lr is None else lr,
                           momentum=r.momentum, weight_decay=0.0 if r.pulls_to_start else r.wd)


def _finetune(model: nn.Module, x: Tensor, y: Tensor, ctx: ForgetContext, *, epochs: int | None, lr: float | None,
              negate: Tensor | None = None, seed_offset: int = 0) -> nn.Module:
    """``epochs`` epochs (default :data:`BASELINE_EPOCHS`) of the recipe's objective — mean loss +
    (wd/2)‖w − c‖², by :func:`~scrubnet.training.sgd_loop` with the recipe's optimiser (:func:`_optimizer`) at
    its rate (unless ``lr``) and batch size — on a copy of ``model``; samples with ``negate`` get
    −min(CE, log c). Ordinary weight decay (c = 0) is the optimiser's ``weight_decay``, a pull toward a given
    w_0 the explicit term (SGD), AdamW's decay its decoupled λ."""
    model = copy.deepcopy(model)
    r = ctx.recipe
    g = seeded_generator(10_007 * ctx.seed + 100 + seed_offset, model_device(model))
    if r.optimizer != "sgd":
        decay = dict(make_opt=lambda m: _optimizer(m, ctx, lr))
    else:
        decay = dict(w0=ctx.center(model), wd=r.wd) if r.pulls_to_start else dict(weight_decay=r.wd)
    sgd_loop(model, x, y, lr=r.lr if lr is None else lr, momentum=r.momentum, batch_size=r.batch_size,
             max_epochs=BASELINE_EPOCHS if epochs is None else epochs, generator=g, freeze_bn=r.freeze_bn,
             ascent=negate, ascent_cap=math.log(max(ctx.num_classes, 2)), loss_fn=r.loss_spec, **decay)
    return model


def _finetune_stream(model: nn.Module, data: DataStream, ctx: ForgetContext, *, epochs: int | None,
                     lr: float | None) -> nn.Module:
    """:func:`_finetune` on a stream that is not in memory: the same objective and optimiser, batches of the
    recipe's size drawn by a seeded permutation (a ``Dataset``) or a ``DataLoader``'s own batches, one pass
    per epoch; memory is one batch."""
    model = copy.deepcopy(model)
    r = ctx.recipe
    g = seeded_generator(10_007 * ctx.seed + 100, model_device(model))
    opt = _optimizer(model, ctx, lr)
    dev = model_device(model)
    center = ctx.center(model) if r.pulls_to_start else None
    with guard_scope(model):
        for _ in range(BASELINE_EPOCHS if epochs is None else epochs):
            model.train()
            if r.freeze_bn:
                freeze_batchnorm(model)
            if data.indexable:
                order = torch.randperm(len(data), generator=g, device=g.device).cpu()
                batches = (data.take(order[i:i + r.batch_size]) for i in range(0, len(order), r.batch_size))
            else:
                batches = data.chunks()
            for xb, yb in batches:
                xb, yb = xb.to(dev), yb.to(dev)
                _step(model, opt, per_sample_loss(call_model(model, xb), yb, r.loss_spec).mean(), ctx, center)
    return model.eval()


def _step(model: nn.Module, opt: torch.optim.Optimizer, loss: Tensor, ctx: ForgetContext,
          center: dict[str, Tensor] | None) -> None:
    """One optimiser step on ``loss`` plus the recipe's (wd/2)‖w − c‖² pull when it pulls to the start
    (``center`` = c, :meth:`ForgetContext.center`; SGD: an AdamW recipe's decay is the optimiser's)."""
    r = ctx.recipe
    if r.pulls_to_start and r.wd > 0 and r.optimizer == "sgd":
        loss = loss + 0.5 * r.wd * l2_pull(model, center)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    guard_after_step(opt)


def _finetune_mixed_stream(model: nn.Module, retain: DataStream, x_f: Tensor, y_f: Tensor, ctx: ForgetContext, *,
                           negate: bool, epochs: int | None, lr: float | None, seed_offset: int) -> nn.Module:
    """:func:`_finetune` on D = D_r ⊔ D_f with D_r streamed (an indexable ``Dataset``; D_f, small by nature, in
    memory): the same seeded permutation of the N_r + N_f positions (D_r first, then D_f), the same batches,
    loss (:func:`~scrubnet.training.batch_loss`, the D_f terms negated and capped when ``negate``) and
    optimiser as the in-memory loop, so the result equals it; memory is one batch of D_r."""
    if retain.indexed() is None:
        raise ValueError("NegGrad and Random labels draw batches from D_r and D_f together: give D_r as tensors, "
                         "an indexable Dataset or a DataLoader over a map-style Dataset")
    retain = retain.indexed()   # a DataLoader: its data set read by index, its collate_fn kept
    model = copy.deepcopy(model)
    r = ctx.recipe
    dev = model_device(model)
    g = seeded_generator(10_007 * ctx.seed + 100 + seed_offset, dev)
    opt = _optimizer(model, ctx, lr)
    n_r, n_f = len(retain), len(y_f)
    x_f, y_f = x_f.to(dev), y_f.to(dev)
    cap = math.log(max(ctx.num_classes, 2))
    center = ctx.center(model) if r.pulls_to_start else None
    with guard_scope(model):
        for _ in range(BASELINE_EPOCHS if epochs is None else epochs):
            model.train()
            if r.freeze_bn:
                freeze_batchnorm(model)
            order = torch.randperm(n_r + n_f, generator=g, device=g.device).cpu()
            for i in range(0, len(order), r.batch_size):
                idx = order[i:i + r.batch_size]
                from_r = idx < n_r
                xr, yr = retain.take(idx[from_r])
                sel_f = (idx[~from_r] - n_r).to(dev)
                # the batch in the permutation's order: position j holds D_r's next sample or D_f's
                pos = torch.empty(len(idx), dtype=torch.long)
                pos[from_r] = torch.arange(int(from_r.sum()))
                pos[~from_r] = int(from_r.sum()) + torch.arange(int((~from_r).sum()))
                pos = pos.to(dev)
                xb = cat_inputs([xr.to(dev, x_f.dtype), x_f[sel_f]])[pos]
                yb = torch.cat([yr.to(dev, y_f.dtype), y_f[sel_f]])[pos]
                ascent = (~from_r).to(dev) if negate else None
                _step(model, opt, batch_loss(call_model(model, xb), yb, r.loss_spec, ascent, cap if negate else None),
                      ctx, center)
    return model.eval()


@register("original")
class Original(ForgettingMethod):
    """No forgetting: the trained model itself (the upper end of what an attacker can recover).

    It takes no options.

    Returns
    -------
    ScrubResult
        ``scrub`` returns a copy of the model in eval mode; ``info`` is empty.
    """

    needs_retain = False
    anchor = "original"
    forgets = False
    options = {}

    def scrub(self, model, retain, forget, ctx):
        return ScrubResult(copy.deepcopy(model).eval())

    @classmethod
    def cost(cls, model, x1, n_retain, n_forget, num_classes, config, **options):
        """A copy of the model: O(p)."""
        return copy_cost(model)


def reinitialised(model: nn.Module, seed: int) -> nn.Module:
    """The start of a user's retraining: :func:`scrubnet.recipe.retrain.initial_model` (trainable parameters
    drawn anew, bare ``nn.Parameter`` s included; frozen parameters kept).

    Parameters
    ----------
    model : nn.Module
        The trained model; not modified.
    seed : int
        Fixes the draw.

    Returns
    -------
    nn.Module
        The re-initialised copy.
    """
    return initial_model(model, seed)


@register("retrain")
class Retrain(ForgettingMethod):
    """The gold standard: fine-tune from w_0 with the same seed and schedule without D_f.

    On a user's model (no ``ctx.start`` and no protocol split): the user's retraining on D_r,
    :func:`scrubnet.recipe.retrain.retrain_like_user` — their own training (``ctx.train``: a callable
    ``train(model, data) -> model`` or a HuggingFace ``Trainer``) or the stated recipe reproduced faithfully
    (its optimiser, schedule, loss, batch size and epochs), from ``ctx.retrain_start`` or the model's
    initialisation drawn anew for its trainable parameters only (frozen ones kept) — the reference the verdict
    and the cost are compared with.

    Needs ``ctx.start`` (the model at w_0); the model is an artifact of ``ctx.cache`` (the protocol stores the
    one it trained).

    Parameters
    ----------
    mode : {"replace", "remove"} or None
        How D_f is left out (default: the protocol's ``ctx.retrain_mode``): ``"replace"`` (needs ``ctx.split``)
        keeps |D| by replacing forgotten samples with copies of random retained ones; ``"remove"`` trains on D_r
        only.

    Returns
    -------
    ScrubResult
        ``scrub`` returns the retrained model (eval mode); ``info`` is empty.
    """

    anchor = "retrain"
    forgets = False  # the gold standard: judged by nothing, the others are judged against it
    streams = True   # D_r reaches the user's training as the user gave it
    options = {"mode": Option(str | None, choices=RETRAIN_MODES)}

    @classmethod
    def cost(cls, model, x1, n_retain, n_forget, num_classes, config, *, mode: str | None = None):
        """Retrain from w_0 (:func:`scrubnet.training.retrain`): at the config's epoch cap ``max_epochs`` (upper
        bound: training stops ``extra_epochs`` after zero training error), over D (mode "replace", the default:
        forgotten samples replaced by retained ones) or D_r ("remove"); the stopping rule evaluates the training
        error after every epoch (one forward over the set), and the final loss is one more forward."""
        ep = int(config.max_epochs)
        n = n_retain if (mode or DEFAULT_RETRAIN_MODE) == "remove" else n_retain + n_forget
        return train_cost(model, x1, n, ep, config.batch_size, eval_forwards=ep + 1.0)

    def __init__(self, mode: str | None = None):
        if mode is not None and mode not in RETRAIN_MODES:
            raise ValueError(f"retrain mode must be one of {', '.join(RETRAIN_MODES)}, got {mode!r}")
        self.mode = mode

    def scrub(self, model, retain, forget, ctx):
        if ctx.start is None:
            if ctx.split is not None:
                raise ValueError("retrain needs the fine-tuning start model (ctx.start)")
            # a user's model: the reference is the user's own retraining (their function, or their recipe)
            out = retrain_like_user(model, retain, train=ctx.train, recipe=ctx.recipe, seed=ctx.seed,
                                    start=ctx.retrain_start)
            info = {"retrain_from_init": float(ctx.retrain_start is None), "retrain_user_function":
                    float(ctx.train is not None)}
            if ctx.train is None:
                info["retrain_epochs"] = float(ctx.recipe.epochs)
            return ScrubResult(out, info=info)
        mode = self.mode or ctx.retrain_mode
        if ctx.split is not None:
            x, y, forget_idx = ctx.split.x, ctx.split.y, ctx.split.forget_idx
        elif mode == "remove":
            x, y = retain.tensors()
            forget_idx = torch.zeros(0, dtype=torch.long, device=y.device)
        else:
            raise ValueError("retrain mode 'replace' needs the full split (ctx.split)")
        key = retrain_key(ctx.start, x, y, forget_idx, train=ctx.config.to_dict(), seed=ctx.seed, mode=mode)
        trained = ctx.cache.get_or_compute(
            key, lambda: retrain_fn(ctx.start, x, y, forget_idx, ctx.config, ctx.seed, mode=mode)[0])
        return ScrubResult(copy.deepcopy(trained).eval())


@register("finetune")
class Finetune(ForgettingMethod):
    """Keep training on D_r only with the recipe's objective and optimiser.

    Streams D_r: a ``Dataset`` or ``DataLoader`` is read batch by batch, never held in memory.

    Parameters
    ----------
    epochs : int or None
        Passes over D_r (default :data:`BASELINE_EPOCHS`: the method's own length, not the recipe's training
        epochs).
    lr : float or None
        Step size of the recipe's optimiser (default: the recipe's rate, for its optimiser: SGD's or AdamW's).

    Returns
    -------
    ScrubResult
        ``scrub`` returns the fine-tuned model (eval mode); ``info`` is empty.
    """

    streams = True
    passes = "epochs"
    options = {"epochs": Option(int | None, ">= 0"), "lr": Option(float | None, "> 0")}

    @classmethod
    def cost(cls, model, x1, n_retain, n_forget, num_classes, config, *, epochs: int | None = None, lr=None):
        """``epochs`` epochs on D_r (default :data:`BASELINE_EPOCHS`, the number the method runs: a fixed count,
        not a cap)."""
        ep = int(BASELINE_EPOCHS if epochs is None else epochs)
        return train_cost(model, x1, n_retain, ep, config.batch_size)

    def __init__(self, epochs: int | None = None, lr: float | None = None):
        self.epochs, self.lr = (None if epochs is None else int(epochs)), lr

    def scrub(self, model, retain, forget, ctx):
        if retain.kind == "tensors":
            return ScrubResult(_finetune(model, retain.x, retain.y, ctx, epochs=self.epochs, lr=self.lr))
        return ScrubResult(_finetune_stream(model, retain, ctx, epochs=self.epochs, lr=self.lr))


class _FinetuneOnAllOfD(ForgettingMethod):
    """What NegGrad and Random labels share: fine-tuning on all of D (D_r streamed, D_f altered), its options
    and its cost. Not registered: a base, not a method."""

    streams = True
    options = {"epochs": Option(int | None, ">= 0"), "lr": Option(float | None, "> 0")}

    @classmethod
    def cost(cls, model, x1, n_retain, n_forget, num_classes, config, *, epochs: int | None = None, lr=None):
        """``epochs`` epochs (default :data:`BASELINE_EPOCHS`) on all of D."""
        ep = int(BASELINE_EPOCHS if epochs is None else epochs)
        return train_cost(model, x1, n_retain + n_forget, ep, config.batch_size)

    def __init__(self, epochs: int | None = None, lr: float | None = None):
        self.epochs, self.lr = (None if epochs is None else int(epochs)), lr


@register("neggrad")
class NegGrad(_FinetuneOnAllOfD):
    """Fine-tune on D with the D_f loss negated and capped at chance (−min(CE_i, log c)).

    Streams D_r (an indexable ``Dataset``: batches drawn as from the in-memory D; D_f is read into memory).

    Parameters
    ----------
    epochs : int or None
        Passes over all of D, D_f included (default :data:`BASELINE_EPOCHS`).
    lr : float or None
        Step size of the recipe's optimiser (default: the recipe's rate, for its optimiser).

    Returns
    -------
    ScrubResult
        The model after the negated-loss fine-tuning (eval mode); no ``info`` keys.
    """


    def scrub(self, model, retain, forget, ctx):
        x_f, y_f = forget.tensors()
        if retain.kind != "tensors":
            return ScrubResult(_finetune_mixed_stream(model, retain, x_f, y_f, ctx, negate=True, epochs=self.epochs,
                                                      lr=self.lr, seed_offset=1))
        x = cat_inputs([retain.x, x_f])
        y = torch.cat([retain.y, y_f])
        dev = retain.y.device
        neg = torch.cat([torch.zeros(len(retain.y), dtype=torch.bool, device=dev),
                         torch.ones(len(y_f), dtype=torch.bool, device=dev)])
        return ScrubResult(_finetune(model, x, y, ctx, epochs=self.epochs, lr=self.lr, negate=neg, seed_offset=1))


@register("randomlabels")
class RandomLabels(_FinetuneOnAllOfD):
    """Fine-tune on D with each D_f label resampled uniformly over the c classes (seeded).

    Streams D_r as :class:`NegGrad` does.

    Parameters
    ----------
    epochs, lr : int or None, float or None
        As :class:`NegGrad`'s: epochs over D (default :data:`BASELINE_EPOCHS`) and the step size of the recipe's
        optimiser (default its rate).

    Returns
    -------
    ScrubResult
        The model fine-tuned on the relabelled D (eval mode); ``info["randomlabels_changed"]`` is the fraction
        of D_f labels the resampling changed (in [0, 1]).
    """


    def scrub(self, model, retain, forget, ctx):
        x_f, y_f = forget.tensors()
        g = seeded_generator(10_007 * ctx.seed + 5, y_f.device)
        y_rand = torch.randint(ctx.num_classes, (len(y_f),), generator=g, device=g.device)
        info = {"randomlabels_changed": float((y_rand != y_f).float().mean())}
        if retain.kind != "tensors":
            return ScrubResult(_finetune_mixed_stream(model, retain, x_f, y_rand, ctx, negate=False,
                                                      epochs=self.epochs, lr=self.lr, seed_offset=2), info=info)
        x = cat_inputs([retain.x, x_f])
        y = torch.cat([retain.y, y_rand])
        return ScrubResult(_finetune(model, x, y, ctx, epochs=self.epochs, lr=self.lr, seed_offset=2), info=info)


@register("hiding")
class Hiding(ForgettingMethod):
    """Class forgetting only: re-initialise the forgotten class's row of the head (weight and bias).

    Only the outputs are masked; the features keep everything they knew.

    Parameters
    ----------
    classifier : str or None
        Name of the final ``nn.Linear`` (default: found as ``head``, ``fc`` or ``classifier``, the torchvision
        and timm names).

    Returns
    -------
    ScrubResult
        ``scrub`` returns the model with the forgotten class's head row re-initialised; ``info`` is empty.
    """

    needs_retain = False
    class_only = True
    forgets = False  # masks the outputs only: the baseline of what does not count as forgetting
    passes = "0"
    options = {"classifier": Option(str | None)}

    @classmethod
    def cost(cls, model, x1, n_retain, n_forget, num_classes, config, **options):
        """An edit of one head row: O(p) for the copy."""
        return copy_cost(model)

    def __init__(self, classifier: str | None = None):
        self.classifier = classifier

    def scrub(self, model, retain, forget, ctx):
        if ctx.forget_class is None:
            raise ValueError("hiding applies to class forgetting only: give a whole forget class")
        model = copy.deepcopy(model)
        _, head = find_classifier(model, self.classifier)
        g = seeded_generator(10_007 * ctx.seed + 6, head.weight.device)
        bound = 1.0 / math.sqrt(head.in_features)
        with torch.no_grad():
            c = ctx.forget_class
            head.weight[c] = (torch.rand(head.in_features, generator=g, device=g.device) * 2 - 1) * bound
            head.bias[c] = (torch.rand((), generator=g, device=g.device) * 2 - 1) * bound
        return ScrubResult(model.eval())
