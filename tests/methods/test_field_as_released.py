"""Each field method's defaults and its update against a transcription of the *released* code (one test per method,
named ``..._released...`` so that ``pytest -k released`` selects them), on a fixed small float64 network.

Every transcription is written here from the release's algorithm, step by step with torch primitives (the release's
own optimiser, torch's SGD or Adam, is written out where it is SGD; Adam is the release's ``torch.optim.Adam``),
independently of scrubnet's code: the loaders' order and batch sizes, the loss (with its reduction and any
proximal term), what is put back after a step. Where the release shuffles, the transcription draws the same
permutations from the method's seeded generator (``seeded_generator(10_007·seed + offset)``) so that one update
can be compared exactly. The releases read (at their current heads): OPTML-Group/Unlearn-Saliency
(``unlearn/GA.py``, ``FT.py`` (``FT_l1``), ``RL.py``, ``boundary_sh.py``, ``generate_mask.py``; ``--batch_size``
256, SGD momentum 0.9, wd 5e-4), meghdadk/SCRUB (``small_scale_unlearning.ipynb``: ``run_neggrad_epoch``,
``l2_penalty``, ``DistillKL``, ``adjust_learning_rate``), if-loops/selective-synaptic-dampening (``ssd.py``,
``forget_full_class_main.py``, ``forget_full_class_strategies.py`` (``blindspot``, ``UNSIR``), ``unlearn.py``).
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scrubnet.data.stream import as_stream
from scrubnet.device import seeded_generator
from scrubnet.methods.bad_teacher import BadTeacher, random_initialisation, scaled_batch
from scrubnet.methods.base import ForgetContext, get_method
from scrubnet.methods.boundary_shrink import fgsm_neighbour_labels
from scrubnet.methods.scrub import Scrub, scrub_lr
from scrubnet.methods.unsir import scaled_noise_batch
from scrubnet.recipe import TrainingRecipe

CPU = torch.device("cpu")


def _net(seed=0, c=3, d=4):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 6), nn.Tanh(), nn.Linear(6, c)).double()


def _data(n, seed, c=3, d=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randint(c, (n,), generator=g)


def _ctx(model, forget_class=None, seed=0, c=3):
    return ForgetContext.from_recipe(model, TrainingRecipe(batch_size=64), num_classes=c, seed=seed,
                                     forget_class=forget_class)


def _gen(offset, seed=0):
    """The method's seeded generator (the draws the release makes with its own RNG)."""
    return seeded_generator(10_007 * seed + offset, CPU)


def _grads(model, loss):
    return torch.autograd.grad(loss, list(model.parameters()))


class _SGD:
    """torch.optim.SGD written out: d = g + wd·w; b = μ·b + d (b = d at the first step); w ← w − lr·b."""

    def __init__(self, model, lr, momentum=0.0, wd=0.0):
        self.model, self.lr, self.momentum, self.wd, self.bufs = model, lr, momentum, wd, None

    @torch.no_grad()
    def step(self, grads):
        ds = [g + self.wd * p for g, p in zip(grads, self.model.parameters())]
        self.bufs = ds if self.bufs is None else [self.momentum * b + d for b, d in zip(self.bufs, ds)]
        for p, b in zip(self.model.parameters(), self.bufs):
            p -= self.lr * b


def _close(a: nn.Module, b: nn.Module, rtol=1e-9, atol=1e-12):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol)


def _moved(a: nn.Module, b: nn.Module) -> bool:
    return any(not torch.allclose(p, q) for p, q in zip(a.parameters(), b.parameters()))


# --------------------------------------------------------------------------------------------------- GA (OPTML)
def test_ga_released_ascends_the_forget_loss_with_optmls_sgd_and_batch():
    meth = get_method("ga")
    assert (meth.epochs, meth.lr, meth.momentum, meth.weight_decay, meth.batch_size) == (5, 1e-4, 0.9, 5e-4, 256)
    model, retain, (xf, yf) = _net(), _data(8, 1), _data(4, 2)
    out = get_method("ga", epochs=3, lr=0.05)(model, retain, (xf, yf), _ctx(model)).model
    # GA.py: for each batch of the forget loader (one batch of 256 holds D_f): loss = −CE; SGD(0.9, 5e-4) step
    ref = copy.deepcopy(model)
    opt = _SGD(ref, 0.05, 0.9, 5e-4)
    for _ in range(3):
        opt.step(_grads(ref, -F.cross_entropy(ref(xf), yf)))
    _close(out, ref)
    with torch.no_grad():
        assert F.cross_entropy(out(xf), yf) > F.cross_entropy(model(xf), yf)


# ------------------------------------------------------------------------------------ NegGrad+ (Kurmanji's code)
def test_neggrad_plus_released_has_the_proximal_term_and_replays_the_forget_batches():
    meth = get_method("neggrad-plus")
    assert (meth.beta, meth.init_decay, meth.momentum, meth.weight_decay) == (0.95, 0.1, 0.0, 0.0)
    assert (meth.batch_size, meth.forget_batch, meth.forget_order, meth.mode) == (128, 64, "cycle", "eval")
    model, (xr, yr), (xf, yf) = _net(), _data(8, 1), _data(4, 2)
    lr, wd, beta = 0.1, 0.1, 0.95
    out = get_method("neggrad-plus", epochs=1, lr=lr, batch_size=2, forget_batch=2)(
        model, (xr, yr), (xf, yf), _ctx(model)).model
    # run_neggrad_epoch: zip(retain_loader, cycle(forget_loader)): the retain loader's shuffle, then the forget
    # loader's; cycle replays the forget loader's first pass (f1, f2, f1, f2); model.eval(); loss =
    # β·(CE_r + (wd/2)·‖w − w_init‖²) − (1 − β)·CE_f; plain SGD
    g = _gen(301)
    order_r, order_f = torch.randperm(8, generator=g), torch.randperm(4, generator=g)
    f_batches = [order_f[0:2], order_f[2:4]]
    ref, init = copy.deepcopy(model), [p.detach().clone() for p in model.parameters()]
    opt = _SGD(ref, lr)
    for i in range(4):
        r, f = order_r[2 * i:2 * i + 2], f_batches[i % 2]
        l2 = sum(((p - p0) ** 2).sum() for p, p0 in zip(ref.parameters(), init)) * (wd / 2)
        loss = beta * (F.cross_entropy(ref(xr[r]), yr[r]) + l2) - (1 - beta) * F.cross_entropy(ref(xf[f]), yf[f])
        opt.step(_grads(ref, loss))
    _close(out, ref)
    # the proximal term matters: without it the same batches end elsewhere
    plain = get_method("neggrad-plus", epochs=1, lr=lr, batch_size=2, forget_batch=2, init_decay=0.0)(
        model, (xr, yr), (xf, yf), _ctx(model)).model
    assert _moved(plain, out)


# ------------------------------------------------------------------------------------------ ℓ1-sparse (FT_l1)
def test_l1_sparse_released_penalty_decays_linearly_and_uses_optmls_sgd():
    meth = get_method("l1-sparse")
    assert (meth.gamma, meth.epochs, meth.lr, meth.momentum, meth.weight_decay, meth.batch_size) == (
        5e-5, 10, 0.01, 0.9, 5e-4, 256)
    model, (xr, yr), forget = _net(), _data(8, 1), _data(4, 2)
    gamma, lr, epochs = 0.02, 0.1, 3
    out = get_method("l1-sparse", gamma=gamma, epochs=epochs, lr=lr)(model, (xr, yr), forget, _ctx(model)).model
    # FT_l1: epoch e: current_alpha = α·(1 − e/E); loss = CE + current_alpha·‖cat(params)‖₁; one batch of 256
    ref = copy.deepcopy(model)
    opt = _SGD(ref, lr, 0.9, 5e-4)
    for e in range(epochs):
        alpha = gamma * (1 - e / epochs)
        l1 = torch.linalg.norm(torch.cat([p.view(-1) for p in ref.parameters()]), ord=1)
        opt.step(_grads(ref, F.cross_entropy(ref(xr), yr) + alpha * l1))
    _close(out, ref)


# ------------------------------------------------------------------------------------------- SalUn (RL, 2026)
def _released_mask(model, xf, yf, fraction):
    """generate_mask.py: |Σ_batches ∇(−CE)| in eval mode, ranked over all tensors; 1 where rank < int(p·frac)."""
    grads = _grads(model, -F.cross_entropy(model(xf), yf))
    flat = -torch.cat([g.abs().flatten() for g in grads])
    ranks = torch.argsort(torch.argsort(flat))
    keep = (ranks < int(len(flat) * fraction)).double()
    out, at = [], 0
    for g in grads:
        out.append(keep[at:at + g.numel()].reshape(g.shape))
        at += g.numel()
    return out


def test_salun_released_puts_the_unmasked_weights_back_after_every_step():
    meth = get_method("salun")
    assert (meth.lr, meth.fraction, meth.epochs, meth.masked_decay, meth.batch_size) == (0.013, 0.5, 10, True, 256)
    model, (xr, yr), (xf, yf) = _net(), _data(8, 1), _data(6, 2)
    ctx, lr, bs, c = _ctx(model), 0.05, 3, 3
    out = get_method("salun", epochs=2, lr=lr, batch_size=bs)(model, (xr, yr), (xf, yf), ctx).model
    mask = _released_mask(model, xf, yf, 0.5)
    # RL.py (cifar10 branch), each epoch: the forget loader with labels torch.randint per batch, then the retain
    # loader; each step: grad *= mask; SGD(0.9, 5e-4); then _restore_masked_params: w ← m·w + (1 − m)·θ0 and the
    # momentum buffer *= m (θ0: the weights at the epoch's start)
    g = _gen(303)
    ref = copy.deepcopy(model)
    opt = _SGD(ref, lr, 0.9, 5e-4)
    for _ in range(2):
        theta0 = [p.detach().clone() for p in ref.parameters()]
        order_f = torch.randperm(len(yf), generator=g)
        batches = []
        for i in range(0, len(yf), bs):
            idx = order_f[i:i + bs]
            batches.append((xf[idx], torch.randint(c, (len(idx),), generator=g)))
        order_r = torch.randperm(len(yr), generator=g)
        batches += [(xr[order_r[i:i + bs]], yr[order_r[i:i + bs]]) for i in range(0, len(yr), bs)]
        for xb, yb in batches:
            opt.step([gr * m for gr, m in zip(_grads(ref, F.cross_entropy(ref(xb), yb)), mask)])
            with torch.no_grad():
                for p, m, p0 in zip(ref.parameters(), mask, theta0):
                    p.copy_(p * m + p0 * (1 - m))
                opt.bufs = [b * m for b, m in zip(opt.bufs, mask)]
    _close(out, ref)
    for p0, p1, m in zip(model.parameters(), out.parameters(), mask):
        assert torch.equal(p1[m == 0], p0[m == 0])
    # the 2024 release (decay on every weight, nothing put back) moves the weights outside the mask
    old = get_method("salun", epochs=2, lr=lr, batch_size=bs, masked_decay=False)(model, (xr, yr), (xf, yf), ctx).model
    assert any(not torch.equal(p1[m == 0], p0[m == 0]) for p0, p1, m in zip(model.parameters(), old.parameters(),
                                                                             mask))


# ---------------------------------------------------------------------------------------- SCRUB (small scale)
def test_scrub_released_defaults_are_the_small_scale_configuration_and_its_schedule():
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


# ----------------------------------------------------------------------------------------------- SSD (ssd.py)
def _class_data():
    """10 classes, 20 samples each, D_r in a shuffled order (so the release's class sort matters); D_f = class 0."""
    g = torch.Generator().manual_seed(5)
    y = torch.arange(200) % 10
    x = torch.randn(200, 4, generator=g, dtype=torch.float64) + 0.8 * F.one_hot(y % 4, 4).double()
    perm = torch.randperm(200, generator=g)
    x, y = x[perm], y[perm]
    return (x[y != 0], y[y != 0]), (x[y == 0], y[y == 0])


def _released_importance(model, x, y, bs):
    """calc_importance over an unshuffled DataLoader(batch_size=bs): Σ_batches (∇ mean CE)² / number of batches."""
    imp = [torch.zeros_like(p) for p in model.parameters()]
    n = 0
    for i in range(0, len(y), bs):
        for acc, gr in zip(imp, _grads(model, F.cross_entropy(model(x[i:i + bs]), y[i:i + bs]))):
            acc += gr ** 2
        n += 1
    return [v / n for v in imp]


def test_ssd_released_importance_reads_the_class_sorted_retain_set_then_the_forget_set_unshuffled():
    model = _net(c=10)
    retain, forget = _class_data()
    (xr, yr), (xf, yf) = retain, forget
    meth = get_method("ssd")
    assert (meth.importance, meth.order, meth.selection_threshold, meth.dampening_constant, meth.batch_size) == (
        "batch", "released", 10.0, 1.0, None)
    ctx = _ctx(model, forget_class=0, c=10)
    res = meth(model, retain, forget, ctx)
    # forget_full_class_main.py: retain_train built class by class (get_classwise_ds), batch -b 64;
    # full_train_dl = DataLoader(ConcatDataset((retain, forget)), 64) unshuffled; forget_train_dl unshuffled;
    # ssd_tuning: model.eval(); importances of D_f, then of D; modify_weight
    alpha, lam, bs = 10.0, 1.0, 64
    sort = torch.sort(yr, stable=True).indices
    x_d, y_d = torch.cat([xr[sort], xf]), torch.cat([yr[sort], yf])
    f_imp = _released_importance(model, xf, yf, bs)
    o_imp = _released_importance(model, x_d, y_d, bs)
    ref = copy.deepcopy(model)
    n_sel = 0
    with torch.no_grad():
        for p, oimp, fimp in zip(ref.parameters(), o_imp, f_imp):
            locations = torch.where(fimp > oimp * alpha)
            update = ((oimp * lam) / fimp)[locations]
            update[torch.where(update > 1)] = 1
            p[locations] = p[locations] * update
            n_sel += len(locations[0])
    _close(res.model, ref)
    total = sum(p.numel() for p in model.parameters())
    assert res.info["ssd_selected_fraction"] == pytest.approx(n_sel / total)
    # the order is what the release's estimate depends on: the former shuffled reading gives other importances
    f_d_released, _ = meth.importances(model, as_stream(retain), as_stream(forget), ctx)
    f_d_shuffled, _ = get_method("ssd", order="shuffled").importances(model, as_stream(retain), as_stream(forget),
                                                                        ctx)
    for (name, _), w in zip(model.named_parameters(), o_imp):
        torch.testing.assert_close(f_d_released[name], w, rtol=1e-9, atol=1e-15)
    assert any(not torch.allclose(f_d_released[k], f_d_shuffled[k]) for k in f_d_released)


def test_ssd_per_sample_fisher_variant_cannot_select_with_a_tenth_forgotten():
    model = _net(c=10)
    retain, forget = _class_data()
    ctx = _ctx(model, c=10)        # random forgetting: the release reads D_r in random_split's (random) order
    res = get_method("ssd")(model, retain, forget, ctx)
    assert res.ok and res.info["ssd_selected_fraction"] > 0
    fisher = get_method("ssd", importance="fisher")(model, retain, forget, ctx)
    assert not fisher.ok and fisher.info["ssd_selected_fraction"] == 0


# ---------------------------------------------------------------------------------- Bad-Teacher (blindspot)
def test_bad_teacher_released_step_is_adam_on_the_elementwise_mean_kl_in_batches_of_256():
    meth = BadTeacher()
    assert (meth.epochs, meth.lr, meth.retain_fraction, meth.T, meth.batch_size, meth.scale_batch, meth.kl) == (
        1, 1e-4, 0.3, 1.0, 256, False, "mean")
    model, (xr, yr), (xf, yf) = _net(), _data(40, 1), _data(6, 2)
    seed, c = 0, 3
    out = meth(model, (xr, yr), (xf, yf), _ctx(model, seed=seed)).model
    # blindspot: student = copy; retain subset: 30 % of D_r drawn at random; UnLearningData(forget, retain) in a
    # shuffled loader of 256 (one batch here); UnlearnerLoss: targets = softmax(incompetent/T) on forget rows,
    # softmax(competent/T) on retain rows; F.kl_div(log_softmax(s/T), targets) with reduction "mean" (÷ B·c);
    # Adam(lr 1e-4): the first step is w ← w − lr·g/(|g| + ε)
    g = _gen(306, seed)
    k = math.ceil(0.3 * len(yr))
    part = torch.randperm(len(yr), generator=g)[:k]
    incompetent = random_initialisation(model, 10_007 * seed + 305)    # any fresh initialisation of the network
    x = torch.cat([xr[part], xf])
    is_forget = torch.cat([torch.zeros(k), torch.ones(len(yf))])[:, None].double()
    with torch.no_grad():
        target = is_forget * F.softmax(incompetent(x), 1) + (1 - is_forget) * F.softmax(model(x), 1)
    s = F.log_softmax(model(x), 1)
    loss = (target * (target.log() - s)).sum() / (len(x) * c)
    for p0, p1, gp in zip(model.parameters(), out.parameters(), _grads(model, loss)):
        torch.testing.assert_close(p1 - p0, -1e-4 * gp / (gp.abs() + 1e-8), rtol=1e-7, atol=1e-13)
    # the former scaled batch makes ≈ 66 steps on any data (here ⌈18/1⌉)
    res = BadTeacher(scale_batch=True)(model, (xr, yr), (xf, yf), _ctx(model, seed=seed))
    assert res.info["bad_teacher_steps"] == -(-(k + len(yf)) // scaled_batch(k + len(yf))) > 1


# ---------------------------------------------------------------------------------------------- UNSIR (SSD repo)
def test_unsir_released_impairs_with_240_noise_rows_in_a_per_class_subset_then_repairs():
    meth = get_method("unsir")
    assert (meth.impair_set, meth.retain_per_class, meth.noise_steps, meth.noise_lr, meth.noise_reg, meth.lr) == (
        "released", 500, 25, 0.1, 0.1, 1e-4)
    c, fc, per = 4, 0, 5
    model = _net(c=c)
    (xr, yr), forget = _data(40, 1, c=c), _data(6, 2, c=c)
    xr, yr = xr[yr != fc], yr[yr != fc]
    lr = 1e-2                      # a larger step than the default so that the phases visibly move the weights
    res = get_method("unsir", retain_per_class=per, lr=lr)(model, (xr, yr), forget, _ctx(model, forget_class=fc,
                                                                                           c=c))
    # UNSIR: retain_samples = the first 500 (here 5) of every class ≠ forget class (class by class);
    # noise = UNSIR_noise(32, …) ~ N(0, 1), 25 Adam(0.1) steps on −CE(model(noise), c_f) + 0.1·mean Σ noise²;
    # UNSIR_create_noisy_loader: 80 × the first 3 noise inputs (240 rows) + retain_samples, shuffled batches of 32;
    # impair: fit_one_unlearning_cycle(1, lr 1e-4: Adam); repair: retain_samples in shuffled batches of 128, a new Adam
    g = _gen(307)
    keep = torch.cat([(yr == k).nonzero().flatten()[:per] for k in range(c) if k != fc])
    xs, ys = xr[keep], yr[keep]
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    noise = torch.randn(32, 4, generator=g, dtype=torch.float64).requires_grad_(True)
    opt_n = torch.optim.Adam([noise], lr=0.1)
    for _ in range(25):
        loss = -F.cross_entropy(ref(noise), torch.full((32,), fc)) + 0.1 * noise.pow(2).sum(1).mean()
        opt_n.zero_grad()
        loss.backward()
        opt_n.step()
    for p in ref.parameters():
        p.requires_grad_(True)
    rows = noise.detach()[:3].repeat(80, 1)
    x_imp, y_imp = torch.cat([xs, rows]), torch.cat([ys, torch.full((240,), fc)])
    for batch, order in ((32, torch.randperm(len(y_imp), generator=g)), ):
        opt = torch.optim.Adam(ref.parameters(), lr=lr)
        for i in range(0, len(order), batch):
            idx = order[i:i + batch]
            opt.zero_grad()
            F.cross_entropy(ref(x_imp[idx]), y_imp[idx]).backward()
            opt.step()
    opt = torch.optim.Adam(ref.parameters(), lr=lr)
    order = torch.randperm(len(ys), generator=g)
    for i in range(0, len(order), 128):
        idx = order[i:i + 128]
        opt.zero_grad()
        F.cross_entropy(ref(xs[idx]), ys[idx]).backward()
        opt.step()
    _close(res.model, ref, rtol=1e-7, atol=1e-10)
    assert (res.info["unsir_noise_rows"], res.info["unsir_retain_used"]) == (240.0, len(keep))
    # the former scaled reading: max(1, round(32/45,000·N_r)) noise inputs mixed into all of D_r
    old = get_method("unsir", impair_set="scaled")(model, (xr, yr), forget, _ctx(model, forget_class=fc, c=c))
    assert (old.info["unsir_noise_rows"], old.info["unsir_retain_used"]) == (1.0, len(yr))
    assert scaled_noise_batch(45_000) == 32 and scaled_noise_batch(4_500) == 3


# ------------------------------------------------------------------------------------ Boundary Shrink (OPTML)
def test_boundary_shrink_released_relabels_with_the_plain_argmax_after_fgsm():
    model, (xf, yf) = _net(), _data(40, 2)
    eps = 0.3
    labels, _ = fgsm_neighbour_labels(model, xf, yf, eps)              # the default: as released
    runner, _ = fgsm_neighbour_labels(model, xf, yf, eps, relabel="runner-up")
    want = []
    for i in range(len(yf)):    # boundary_sh.py: x' = x + ε·sign(∇_x CE); label = argmax f(x')
        xi = xf[i:i + 1].clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(F.cross_entropy(model(xi), yf[i:i + 1]), xi)
        want.append(int(model(xi.detach() + eps * gx.sign()).argmax()))
    assert labels.tolist() == want
    kept = labels == yf
    assert 0 < int(kept.sum()) < len(yf)           # some steps cross, some do not (those keep their label)
    assert torch.equal(runner[~kept], labels[~kept]) and bool((runner[kept] != yf[kept]).all())
    meth = get_method("boundary-shrink")
    assert (meth.relabel, meth.batch_size, meth.momentum, meth.weight_decay) == ("argmax", 256, 0.9, 5e-4)
    # one epoch: the forget loader (one batch of 256), CE(model(x), argmax labels), SGD(0.9, 5e-4)
    out = get_method("boundary-shrink", eps=eps, epochs=1, lr=0.1)(
        model, _data(4, 1), (xf, yf), _ctx(model, forget_class=0)).model
    ref = copy.deepcopy(model)
    _SGD(ref, 0.1, 0.9, 5e-4).step(_grads(ref, F.cross_entropy(ref(xf), labels)))
    _close(out, ref)
