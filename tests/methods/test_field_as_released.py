"""Each field method's defaults and one update step against a transcription of its released update (written from
the update equations stated in docs/decisions/field-methods.md), on a fixed small float64 network and batch."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scrubnet.data.stream import as_stream
from scrubnet.methods.bad_teacher import BadTeacher, scaled_batch
from scrubnet.methods.base import ForgetContext, get_method
from scrubnet.methods.boundary_shrink import fgsm_neighbour_labels
from scrubnet.methods.salun import forget_gradient, saliency_mask
from scrubnet.methods.scrub import Scrub, scrub_lr
from scrubnet.methods.unsir import scaled_noise_batch
from scrubnet.recipe import TrainingRecipe
from scrubnet.device import seeded_generator


def _net(seed=0, c=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, c)).double()


def _data(n, seed, c=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(c, (n,), generator=g)


def _ctx(model, forget_class=None, seed=0, c=3):
    return ForgetContext.from_recipe(model, TrainingRecipe(batch_size=64), num_classes=c, seed=seed,
                                     forget_class=forget_class)


def _grads(model, loss):
    return torch.autograd.grad(loss, list(model.parameters()))


def _sgd_momentum_steps(model, grad_fns, lr, momentum, wd):
    """torch.optim.SGD's update written out: d = g + wd·w; b = μ·b + d (b = d at the first step); w ← w − lr·b."""
    ref = copy.deepcopy(model)
    bufs = None
    for fn in grad_fns:
        gs = fn(ref)
        with torch.no_grad():
            ds = [g + wd * p for g, p in zip(gs, ref.parameters())]
            bufs = ds if bufs is None else [momentum * b + d for b, d in zip(bufs, ds)]
            for p, b in zip(ref.parameters(), bufs):
                p -= lr * b
    return ref


def _close(a: nn.Module, b: nn.Module):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


def test_neggrad_plus_defaults_are_kurmanjis_beta_095_and_plain_sgd():
    meth = get_method("neggrad-plus")
    assert (meth.beta, meth.momentum, meth.weight_decay) == (0.95, 0.0, 0.0)
    model, (xr, yr), (xf, yf) = _net(), _data(8, 1), _data(4, 2)
    # two full-batch epochs: w ← w − lr·(0.95·∇CE_r − 0.05·∇CE_f), no momentum carried between them
    out = get_method("neggrad-plus", epochs=2, lr=0.1, batch_size=100)(model, (xr, yr), (xf, yf), _ctx(model)).model
    step = lambda m: _grads(m, 0.95 * F.cross_entropy(m(xr), yr) - 0.05 * F.cross_entropy(m(xf), yf))  # noqa: E731
    _close(out, _sgd_momentum_steps(model, [step, step], 0.1, 0.0, 0.0))


def test_ga_ascends_the_forget_loss_alone_with_optmls_sgd():
    meth = get_method("ga")
    assert (meth.epochs, meth.lr, meth.momentum, meth.weight_decay) == (5, 1e-4, 0.9, 5e-4)
    model, retain, (xf, yf) = _net(), _data(8, 1), _data(4, 2)
    out = get_method("ga", epochs=3, lr=0.05, batch_size=100)(model, retain, (xf, yf), _ctx(model)).model
    step = lambda m: _grads(m, -F.cross_entropy(m(xf), yf))  # noqa: E731
    _close(out, _sgd_momentum_steps(model, [step] * 3, 0.05, 0.9, 5e-4))
    with torch.no_grad():
        assert F.cross_entropy(out(xf), yf) > F.cross_entropy(model(xf), yf)


def test_boundary_shrink_relabels_with_the_plain_argmax_after_fgsm():
    model, (xf, yf) = _net(), _data(40, 2)
    eps = 0.3
    labels, _ = fgsm_neighbour_labels(model, xf, yf, eps)              # the default: as released
    runner, _ = fgsm_neighbour_labels(model, xf, yf, eps, relabel="runner-up")
    want = []
    for i in range(len(yf)):    # the released step: x' = x + ε·sign(∇_x CE); label = argmax f(x')
        xi = xf[i:i + 1].clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(F.cross_entropy(model(xi), yf[i:i + 1]), xi)
        want.append(int(model(xi.detach() + eps * gx.sign()).argmax()))
    assert labels.tolist() == want
    kept = labels == yf
    assert 0 < int(kept.sum()) < len(yf)           # some steps cross, some do not (those keep their label)
    assert torch.equal(runner[~kept], labels[~kept]) and bool((runner[kept] != yf[kept]).all())
    assert get_method("boundary-shrink").relabel == "argmax"
    # one full-batch SGD epoch on (x, argmax labels), the released optimiser settings
    out = get_method("boundary-shrink", eps=eps, epochs=1, lr=0.1, batch_size=100)(
        model, _data(4, 1), (xf, yf), _ctx(model, forget_class=0)).model
    step = lambda m: _grads(m, F.cross_entropy(m(xf), labels))  # noqa: E731
    _close(out, _sgd_momentum_steps(model, [step], 0.1, 0.9, 5e-4))


def _ssd_data():
    """A balanced 10-class set of 200 samples and its first class as D_f: N_f/N = 0.1."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(200, 4, generator=g, dtype=torch.float64)
    y = torch.arange(200) % 10
    x = x + 0.8 * F.one_hot(y % 4, 4).double()
    return (x[y != 0], y[y != 0]), (x[y == 0], y[y == 0])


def test_ssd_importance_is_the_squared_mean_batch_gradient_and_selects_at_alpha_10_with_a_tenth_forgotten():
    model = _net(c=10)
    (xr, yr), (xf, yf) = retain, forget = _ssd_data()
    assert len(yf) / (len(yf) + len(yr)) == 0.1
    meth = get_method("ssd")
    assert (meth.importance, meth.selection_threshold, meth.dampening_constant) == ("batch", 10.0, 1.0)
    ctx = _ctx(model, c=10)
    f_d, f_f = meth.importances(model, as_stream(retain), as_stream(forget), ctx)
    # the released estimator: for each batch of the shuffled D (and of the shuffled D_f), (∇ mean CE)², averaged
    g = seeded_generator(10_007 * ctx.seed + 309, torch.device("cpu"))
    bs = 64
    x_all, y_all = torch.cat([xr, xf]), torch.cat([yr, yf])
    order = torch.randperm(len(y_all), generator=g)
    want_d = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(0, len(order), bs):
        idx = order[i:i + bs]
        for acc, gr in zip(want_d, _grads(model, F.cross_entropy(model(x_all[idx]), y_all[idx]))):
            acc += gr ** 2
    nb = -(-len(order) // bs)
    for (name, _), w in zip(model.named_parameters(), want_d):
        torch.testing.assert_close(f_d[name], w / nb, rtol=1e-9, atol=1e-15)
    g_f = _grads(model, F.cross_entropy(model(xf), yf))      # D_f fits one batch
    for (name, _), gr in zip(model.named_parameters(), g_f):
        torch.testing.assert_close(f_f[name], gr ** 2, rtol=1e-9, atol=1e-15)
    # selection at α = 10: the released estimator selects, the per-sample Fisher cannot (F_D ≥ 0.1·F_f)
    res = meth(model, retain, forget, ctx)
    assert res.ok and res.info["ssd_selected_fraction"] > 0
    for (name, p0), p1 in zip(model.named_parameters(), res.model.parameters()):
        sel = f_f[name] > 10 * f_d[name]
        factor = torch.where(sel, torch.clamp(f_d[name] / f_f[name], max=1.0), torch.ones_like(p0))
        torch.testing.assert_close(p1, p0 * factor, rtol=1e-9, atol=1e-15)
    fisher = get_method("ssd", importance="fisher")(model, retain, forget, ctx)
    assert not fisher.ok and fisher.info["ssd_selected_fraction"] == 0


def test_scrub_defaults_are_the_small_scale_configuration_and_its_schedule():
    meth = Scrub()
    assert (meth.T, meth.lr, meth.weight_decay, meth.kl_weight, meth.ce_weight, meth.msteps, meth.epochs) == (
        2.0, 5e-4, 0.1, 0.5, 1.0, 3, 10)
    assert (meth.retain_batch, meth.forget_batch, meth.lr_decay_epochs) == (32, 64, (5, 8, 9))
    # the released adjust_learning_rate: lr·0.1^(number of decay epochs < epoch), epochs counted from 1
    assert [scrub_lr(1.0, e, (5, 8, 9), 0.1) for e in range(1, 11)] == pytest.approx(
        [1, 1, 1, 1, 1, 0.1, 0.1, 0.1, 0.01, 0.001])
    # the rate each step is taken with, seen through the optimiser
    model, retain, forget = _net(), _data(8, 1), _data(4, 2)
    meth = Scrub(epochs=4, msteps=1, lr=1e-2, retain_batch=8, forget_batch=4, lr_decay_epochs="1,3")
    rates = []
    orig = torch.optim.Adam.step

    def spy(self, *a, **k):
        rates.append(self.param_groups[0]["lr"])
        return orig(self, *a, **k)

    torch.optim.Adam.step = spy
    try:
        meth.run(model, as_stream(retain), as_stream(forget), _ctx(model))
    finally:
        torch.optim.Adam.step = orig
    assert rates == pytest.approx([1e-2, 1e-2, 1e-3, 1e-3, 1e-4])   # epoch 1: max + min; then one min-step each


def test_scrub_first_epoch_is_the_released_max_then_min_step_with_adam():
    model, (xr, yr), (xf, yf) = _net(), _data(8, 1), _data(4, 2)
    T, lr, wd = 2.0, 1e-2, 0.1
    out, _, _ = Scrub(epochs=1, msteps=1, lr=lr, retain_batch=8, forget_batch=4).run(
        model, as_stream((xr, yr)), as_stream((xf, yf)), _ctx(model))
    teacher = copy.deepcopy(model)

    def kl(s, t):   # DistillKL: KL(p_t ‖ p_s)·T²/B, summed over classes
        p_t = F.softmax(t / T, -1)
        return (p_t * (p_t.log() - F.log_softmax(s / T, -1))).sum() * T * T / len(s)

    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(ref.parameters(), lr=lr, weight_decay=wd)
    for loss_fn in (lambda: -kl(ref(xf), teacher(xf).detach()),
                    lambda: F.cross_entropy(ref(xr), yr) + 0.5 * kl(ref(xr), teacher(xr).detach())):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    _close(out, ref)


def test_salun_redraws_labels_every_batch_and_passes_over_forget_before_retain():
    model, (xr, yr), (xf, yf) = _net(), _data(8, 1), _data(6, 2)
    meth = get_method("salun")
    assert (meth.lr, meth.fraction, meth.epochs, meth.masked_decay) == (0.013, 0.5, 10, False)
    ctx, lr, bs = _ctx(model), 0.05, 3
    out = get_method("salun", epochs=1, lr=lr, batch_size=bs)(model, (xr, yr), (xf, yf), ctx).model
    mask = saliency_mask(forget_gradient(model, xf, yf), 0.5)
    # the released loop: one generator draws, in order, the D_f permutation, each D_f batch's labels, the D_r
    # permutation; each step masks the loss gradient, then SGD (momentum 0.9, decay 5e-4 on every weight)
    g = seeded_generator(10_007 * ctx.seed + 303, torch.device("cpu"))
    order_f = torch.randperm(len(yf), generator=g)
    batches = []
    for i in range(0, len(yf), bs):
        idx = order_f[i:i + bs]
        batches.append((xf[idx], torch.randint(3, (len(idx),), generator=g)))
    order_r = torch.randperm(len(yr), generator=g)
    batches += [(xr[order_r[i:i + bs]], yr[order_r[i:i + bs]]) for i in range(0, len(yr), bs)]
    assert not torch.equal(batches[0][1], batches[1][1])   # a fresh draw per batch
    fns = [lambda m, b=b: [gr * mk for gr, mk in zip(_grads(m, F.cross_entropy(m(b[0]), b[1])), mask.values())]
           for b in batches]
    _close(out, _sgd_momentum_steps(model, fns, lr, 0.9, 5e-4))


def test_bad_teacher_and_unsir_sizes_scale_with_the_data():
    # CIFAR-10 random-10 with the released batch of 256: 66 steps; a small set gets as many, in smaller batches
    n_cifar = int(0.3 * 40_500) + 4_500
    assert -(-n_cifar // 256) == 66 == -(-n_cifar // scaled_batch(n_cifar)) and scaled_batch(10 ** 6) == 256
    assert -(-185 // scaled_batch(185)) == 62 and scaled_batch(10) == 1
    assert scaled_noise_batch(45_000) == 32 and scaled_noise_batch(4_500) == 3 and scaled_noise_batch(400) == 1
    model, retain, forget = _net(), _data(400, 1), _data(40, 2)
    res = BadTeacher()(model, retain, forget, _ctx(model))
    assert res.info["bad_teacher_steps"] == -(-(120 + 40) // scaled_batch(160))
    res = get_method("unsir")(model, retain, _data(10, 3), _ctx(model, forget_class=0))
    assert res.info["unsir_noise_batch"] == 1.0
