"""The field's methods against their defining properties on tiny float64 models, and a smoke run of each on the
architectures scrubnet supports (MLP, BatchNorm CNN, residual CNN, attention model)."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scrubnet.curvature.fisher import fisher_diag_loop
from scrubnet.methods.bad_teacher import bad_teacher_targets, random_initialisation
import scrubnet.cost_guard
import scrubnet.methods.base as base
from scrubnet.methods.base import ForgetContext, get_method
from scrubnet.methods.boundary_shrink import fgsm_neighbour_labels
from scrubnet.methods.l1_sparse import l1_weight
from scrubnet.methods.salun import saliency_mask
from scrubnet.methods.scrub import Scrub
from scrubnet.methods.unsir import error_maximising_noise
from scrubnet.models import build_model
from scrubnet.recipe import TrainingRecipe
from tests.user_models import ResCNN, TinyViT, images

FIELD = ("neggrad-plus", "ga", "l1-sparse", "salun", "scrub", "ssd", "bad-teacher", "unsir", "boundary-shrink")


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _data(n, seed, cls=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    y = torch.randint(3, (n,), generator=g) if cls is None else torch.full((n,), cls)
    return x, y


def _ctx(model, forget_class=None, seed=0):
    return ForgetContext.from_recipe(model, TrainingRecipe(batch_size=64), num_classes=3, seed=seed,
                                     forget_class=forget_class)


def _grads(model, loss):
    return torch.autograd.grad(loss, list(model.parameters()))


def _ce(model, x, y):
    return F.cross_entropy(model(x), y)


@pytest.mark.parametrize("beta", [0.5, 0.8])
def test_neggrad_plus_step_is_beta_retain_minus_one_minus_beta_forget(beta):
    model, (xr, yr), (xf, yf) = _net(), _data(8, 1), _data(4, 2)
    g_r, g_f = _grads(model, _ce(model, xr, yr)), _grads(model, _ce(model, xf, yf))
    lr = 0.1
    out = get_method("neggrad-plus", beta=beta, epochs=1, lr=lr, momentum=0.0, weight_decay=0.0,
                     batch_size=100)(model, (xr, yr), (xf, yf), _ctx(model)).model
    for p0, p1, a, b in zip(model.parameters(), out.parameters(), g_r, g_f):
        torch.testing.assert_close(p1, p0 - lr * (beta * a - (1 - beta) * b), rtol=1e-10, atol=1e-12)


def test_a_diverging_ascent_stops_with_the_last_finite_weights_and_says_so():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))    # float32, unbounded: it overflows
    retain, forget = [(x.float(), y) for x, y in (_data(8, 1), _data(4, 2))]
    res = get_method("neggrad-plus", beta=0.05, epochs=200, lr=1e3, weight_decay=0.0)(model, retain, forget,
                                                                                    _ctx(model))
    assert not res.ok and "NegGrad+ diverged in epoch" in res.reasons[0]
    assert all(torch.isfinite(p).all() for p in res.model.parameters())


def test_l1_sparse_penalty_gradient_decays_linearly_over_epochs():
    assert [l1_weight(2.0, e, 4) for e in range(4)] == [2.0, 1.5, 1.0, 0.5]
    model, (xr, yr) = _net(), _data(8, 1)
    gamma, lr = 0.05, 0.1
    out = get_method("l1-sparse", gamma=gamma, epochs=2, lr=lr, momentum=0.0, weight_decay=0.0,
                     batch_size=100)(model, (xr, yr), _data(2, 3), _ctx(model)).model
    ref = copy.deepcopy(model)
    for e in range(2):   # the slow twin: one full-batch step per epoch, ∇CE + γ_e·sign(w)
        g = _grads(ref, _ce(ref, xr, yr))
        with torch.no_grad():
            for p, gp in zip(ref.parameters(), g):
                p -= lr * (gp + gamma * (1 - e / 2) * p.sign())
    for a, b in zip(out.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_salun_mask_is_the_top_fraction_of_forget_gradients_and_nothing_outside_moves():
    model, retain, (xf, yf) = _net(), _data(10, 1), _data(5, 2)
    grads = dict(zip([k for k, _ in model.named_parameters()], _grads(model, _ce(model, xf, yf))))
    fraction = 0.3
    mask = saliency_mask(grads, fraction)
    flat_g = torch.cat([g.abs().reshape(-1) for g in grads.values()])
    flat_m = torch.cat([m.reshape(-1) for m in mask.values()])
    assert int(flat_m.sum()) == int(fraction * flat_g.numel())
    assert float(flat_g[flat_m].min()) >= float(flat_g[~flat_m].max())
    out = get_method("salun", fraction=fraction, epochs=3, lr=0.05, batch_size=4, masked_decay=True)(
        model, retain, (xf, yf), _ctx(model)).model
    moved = torch.cat([(a != b).reshape(-1) for a, b in zip(model.parameters(), out.parameters())])
    assert not moved[~flat_m].any()             # momentum and (masked_decay) weight decay included
    assert moved[flat_m].float().mean() > 0.9


def test_ssd_dampens_exactly_the_selected_weights_by_the_stated_factor():
    model, (xr, yr), (xf, yf) = _net(), _data(30, 1), _data(2, 2)
    alpha, lam = 2.0, 0.7
    names = [k for k, _ in model.named_parameters()]
    f_d = fisher_diag_loop(model, torch.cat([xr, xf]), torch.cat([yr, yf]), kind="empirical")
    f_f = fisher_diag_loop(model, xf, yf, kind="empirical")
    out = get_method("ssd", selection_threshold=alpha, dampening_constant=lam, importance="fisher")(
        model, (xr, yr), (xf, yf), _ctx(model)).model
    n_sel = 0
    for name, p0, p1 in zip(names, model.parameters(), out.parameters()):
        sel = f_f[name] > alpha * f_d[name]
        n_sel += int(sel.sum())
        factor = torch.where(sel, torch.clamp(lam * f_d[name] / f_f[name], max=1.0), torch.ones_like(p0))
        torch.testing.assert_close(p1, p0 * factor, rtol=1e-9, atol=1e-12)
        assert torch.equal(p1[~sel], p0[~sel])
    assert 0 < n_sel < sum(p.numel() for p in model.parameters())


def test_ssd_batch_importance_is_the_squared_batch_gradient_and_no_selection_is_a_failure():
    model, (xr, yr), (xf, yf) = _net(), _data(30, 1), _data(2, 2)
    meth = get_method("ssd", importance="batch", batch_size=100)
    f_d, f_f = meth.importances(model, _as_stream((xr, yr)), _as_stream((xf, yf)), _ctx(model))
    g_d = _grads(model, _ce(model, torch.cat([xr, xf]), torch.cat([yr, yf])))
    g_f = _grads(model, _ce(model, xf, yf))
    for (name, _), a, b in zip(model.named_parameters(), g_d, g_f):
        torch.testing.assert_close(f_d[name], a ** 2)
        torch.testing.assert_close(f_f[name], b ** 2)
    # per-sample importances: F_D ≥ (N_f/N)·F_f, so α ≥ N/N_f selects nothing — reported, not silent
    res = get_method("ssd", selection_threshold=16.0, importance="fisher")(model, (xr, yr), (xf, yf), _ctx(model))
    assert not res.ok and "N_f/N = 2/32" in res.reasons[0]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), res.model.parameters()))


def _kl(t_logits, s_logits, T):
    p_t = F.softmax(t_logits / T, -1)
    return (p_t * (p_t.log() - F.log_softmax(s_logits / T, -1))).sum(-1).mean() * T * T


def test_scrub_alternates_max_steps_on_forget_and_min_steps_on_retain_with_the_stated_losses():
    model, retain, forget = _net(), _data(8, 1), _data(4, 2)
    T, alpha, gamma = 2.0, 0.3, 0.9
    meth = Scrub(epochs=3, msteps=2, lr=1e-2, T=T, kl_weight=alpha, ce_weight=gamma, retain_batch=4, forget_batch=2)
    teacher = copy.deepcopy(model)
    seen = []

    def hook(kind, loss, x, y, student):
        with torch.no_grad():
            t, s = teacher(x), student(x)
            want = -_kl(t, s, T) if kind == "max" else gamma * F.cross_entropy(s, y) + alpha * _kl(t, s, T)
            kl_f = _kl(teacher(forget[0]), student(forget[0]), T)
        torch.testing.assert_close(loss.detach(), want, rtol=1e-10, atol=1e-12)
        from_forget = bool((x[:, None, :] == forget[0][None]).all(-1).any(1).all())
        seen.append((kind, from_forget, float(kl_f)))

    student, counts, failed = meth.run(model, *[_as_stream(d) for d in (retain, forget)], _ctx(model), on_step=hook)
    assert [k for k, _, _ in seen] == ["max", "max", "min", "min"] * 2 + ["min", "min"]
    assert all(f == (k == "max") for k, f, _ in seen)   # max-steps see D_f, min-steps D_r
    assert counts == {"scrub_max_steps": 4.0, "scrub_min_steps": 6.0} and failed is None
    # the max-steps push the student away from the teacher on D_f: KL is 0 at the start, > 0 after them
    assert seen[0][2] < 1e-12 and seen[2][2] > 1e-6


def _as_stream(d):
    from scrubnet.data.stream import as_stream
    return as_stream(d)


def test_bad_teacher_targets_are_the_two_teachers_softmaxes_and_drive_the_step():
    model, (xr, yr), (xf, yf) = _net(), _data(6, 1), _data(3, 2)
    bad = random_initialisation(model, 7)
    assert all(not torch.equal(a, b) for a, b in zip(model.parameters(), bad.parameters()))
    x = torch.cat([xr, xf])
    is_f = torch.tensor([False] * 6 + [True] * 3)
    T = 2.0
    tgt = bad_teacher_targets(model, bad, x, is_f, T)
    with torch.no_grad():
        torch.testing.assert_close(tgt[:6], F.softmax(model(xr) / T, -1))
        torch.testing.assert_close(tgt[6:], F.softmax(bad(xf) / T, -1))
    # one Adam step from the original: Δw = −lr·g/(|g| + ε) with g the gradient of the mean KL to those targets
    lr, seed = 1e-3, 0
    out = get_method("bad-teacher", epochs=1, lr=lr, retain_fraction=1.0, T=T, batch_size=100)(
        model, (xr, yr), (xf, yf), _ctx(model, seed=seed)).model
    bad = random_initialisation(model, 10_007 * seed + 305)
    tgt = bad_teacher_targets(model, bad, x, is_f, T)
    s = model(x)
    # the release's F.kl_div reduction "mean": over the n·c terms
    g = _grads(model, F.kl_div(F.log_softmax(s / T, -1), tgt, reduction="sum") / tgt.numel())
    for p0, p1, gp in zip(model.parameters(), out.parameters(), g):
        torch.testing.assert_close(p1 - p0, -lr * gp / (gp.abs() + 1e-8), rtol=1e-5, atol=1e-9)


def test_unsir_noise_raises_the_forget_class_loss():
    torch.manual_seed(0)
    x, y, _ = images(60, 0)
    model = build_model("mlp", (1, 8, 8), 3, hidden=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(30):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    g = torch.Generator().manual_seed(3)
    noise, trace = error_maximising_noise(model.eval(), (16, 1, 8, 8), 0, steps=25, lr=0.1, reg=0.1, generator=g)
    start = torch.randn((16, 1, 8, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ce0 = float(F.cross_entropy(model(start), torch.zeros(16, dtype=torch.long)))
        ce1 = float(F.cross_entropy(model(noise), torch.zeros(16, dtype=torch.long)))
    assert trace[0] == pytest.approx(ce0) and trace[-1] == pytest.approx(ce1)
    assert ce1 > ce0 + 1.0
    assert all(p.requires_grad for p in model.parameters())


def test_boundary_shrink_labels_are_the_fgsm_neighbours():
    model, (xf, yf) = _net(), _data(12, 2)
    eps = 0.3
    labels, adv = fgsm_neighbour_labels(model, xf, yf, eps, relabel="runner-up")
    for i in range(len(yf)):    # the slow twin: one sample at a time
        xi = xf[i:i + 1].clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(F.cross_entropy(model(xi), yf[i:i + 1]), xi)
        xa = xi.detach() + eps * gx.sign()
        torch.testing.assert_close(adv[i:i + 1], xa)
        logits = model(xa)[0].detach()
        logits[yf[i]] = -math.inf
        assert int(labels[i]) == int(logits.argmax()) != int(yf[i])
    out = get_method("boundary-shrink", eps=eps, epochs=40, lr=0.1, relabel="runner-up")(
        model, _data(4, 1), (xf, yf), _ctx(model, forget_class=0)).model
    with torch.no_grad():
        assert float((out(xf).argmax(1) == labels).float().mean()) >= 0.75


class _BNCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = build_model("cnn2d", (1, 8, 8), 3, channels=4)

    def forward(self, x):
        return self.net(x)


ARCHS = {"mlp": lambda: build_model("mlp", (1, 8, 8), 3, hidden=16), "bn-cnn": _BNCNN, "res-cnn": ResCNN,
         "attention": TinyViT}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_field_method_runs_on_every_architecture(arch):
    torch.manual_seed(0)
    x, y, _ = images(36, 0)
    model = ARCHS[arch]()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(5):
        model.train()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval()
    forget = y == 0
    retain, fset = (x[~forget], y[~forget]), (x[forget], y[forget])
    ctx = ForgetContext.from_recipe(model, TrainingRecipe(batch_size=16), num_classes=3, forget_class=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for name in FIELD:
        # a whole class is 1/3 of D here: per-sample SSD can select weights only for α < N/N_f = 3
        res = get_method(name, **({"selection_threshold": 2.0} if name == "ssd" else {}))(model, retain, fset, ctx)
        assert res.ok, name
        assert all(torch.isfinite(v).all() for v in res.model.state_dict().values() if v.is_floating_point())
        assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), res.model.parameters())), name
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())   # the input is untouched


def test_every_field_method_has_a_cost_estimate_that_grows_with_its_epochs():
    estimate = scrubnet.cost_guard.estimate
    model = build_model("mlp", (1, 8, 8), 3, hidden=16)
    for name in FIELD:
        est = estimate(model, 200, 20, method=name, in_shape=(1, 8, 8))
        assert est.flops > 0 and est.seconds > 0 and est.peak_bytes > 0, name
        if name not in ("ssd", "unsir"):
            more = estimate(model, 200, 20, method=name, in_shape=(1, 8, 8), epochs=20)
            assert more.flops > est.flops, name


class _MapDataset(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "label": self.y[i]}


@pytest.mark.parametrize("name", ["neggrad-plus", "l1-sparse", "salun", "scrub", "bad-teacher"])
def test_a_streamed_dataset_gives_the_same_scrub_as_tensors(name):
    model, retain, forget = _net(), _data(20, 1), _data(4, 2)
    opts = {"epochs": 2, "batch_size": 8} if name != "scrub" else {"epochs": 2, "retain_batch": 8}
    a = get_method(name, **opts)(model, retain, forget, _ctx(model)).model
    b = get_method(name, **opts)(model, _MapDataset(*retain), forget, _ctx(model)).model
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_class_only_methods_refuse_random_forgetting_and_mixed_methods_refuse_a_loader():
    model, retain, forget = _net(), _data(20, 1), _data(4, 2)
    for name in ("unsir", "boundary-shrink"):
        with pytest.raises(ValueError, match="class forgetting only"):
            get_method(name)(model, retain, forget, _ctx(model))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*retain), batch_size=5)
    # a loader over a map-style data set is read by index (its collate_fn kept): the same result as its data set
    a = get_method("salun", epochs=1)(model, loader, forget, _ctx(model)).model
    b = get_method("salun", epochs=1)(model, retain, forget, _ctx(model)).model
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))

    class _Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(zip(*retain))

    # a method that draws D_r and other samples into one batch needs samples by index: an iterable loader is refused
    with pytest.raises(ValueError, match="map-style Dataset"):
        get_method("ssd")(model, torch.utils.data.DataLoader(_Stream(), batch_size=5), forget, _ctx(model))
    # one that passes over D_r alone takes the iterable loader's own batches
    assert get_method("salun", epochs=1)(model, torch.utils.data.DataLoader(_Stream(), batch_size=5), forget,
                                         _ctx(model)).model is not None
    # a loader is fine where D_r is read alone: its own batches
    get_method("neggrad-plus", epochs=1)(model, loader, forget, _ctx(model))
