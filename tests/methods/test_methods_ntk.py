"""NTK scrubbing: matrix-free δw vs the dense computation, vs Proposition 2 (corrected), and exactness on a
linear model with MSE, where linearised training *is* training."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from scrubnet.curvature.params import flatten, get_flat
from scrubnet.experiments.runner import noise_information
from scrubnet.methods import get_method
from scrubnet.methods.ntk import ntk_direction, residuals, trapezium_scale
from scrubnet.models.zoo import build_model
from scrubnet.readouts.information import weight_step_geometry
from scrubnet.training import TrainConfig
from tests.conftest import protocol_ctx
from tests import dense_refs

C = 3


def _data(n, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g, dtype=torch.float64)
    y = torch.randint(0, C, (n,), generator=g)
    return x, y


def _tiny(name="cnn1d"):
    if name == "cnn1d":
        model = build_model("cnn1d", (12,), C, seed=3, channels=3).double()
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
        shape = (12,)
    else:
        model = build_model("mlp", (6,), C, seed=3, hidden=8).double()
        shape = (6,)
    start = copy.deepcopy(model)
    with torch.no_grad():  # the "trained" weights: a perturbation of w_0
        g = torch.Generator().manual_seed(9)
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.eval(), start.eval(), shape


def _dense_delta(lin, x_r, y_r, x_f, y_f, w0, lam_d, lam_r, loss="ce", pull="point"):
    """δw with J materialised: Jᵀ(Θ + λ_D)⁻¹ b − J_rᵀ(Θ_rr + λ_r)⁻¹ b_r, and the retain displacement."""
    x, y = torch.cat([x_r, x_f]), torch.cat([y_r, y_f])
    jac = dense_refs.dense_jacobian(lin, x)
    with torch.no_grad():
        b = residuals(lin(x), y, loss, C).reshape(-1)
    delta0 = get_flat(lin) - w0
    if pull == "w0":
        b = b - jac @ delta0
    nr = len(y_r) * C
    jr = jac[:nr]
    a = torch.linalg.solve(jac @ jac.T + lam_d * torch.eye(len(b), dtype=jac.dtype), b)
    a_r = torch.linalg.solve(jr @ jr.T + lam_r * torch.eye(nr, dtype=jac.dtype), b[:nr])
    disp = -jr.T @ a_r - (delta0 if pull == "w0" else 0.0)
    return jac.T @ a - jr.T @ a_r, disp


@pytest.mark.parametrize("name", ["cnn1d", "mlp"])
@pytest.mark.parametrize("pull", ["point", "w0"])
@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_matrix_free_delta_equals_dense(name, pull, loss):
    model, start, shape = _tiny(name)
    x, y = _data(10, shape)
    xr, yr, xf, yf = x[:7], y[:7], x[7:], y[7:]
    w0 = get_flat(start)
    wd = 0.05
    step = ntk_direction(model, (xr, yr), (xf, yf), wd=wd, w0=w0, num_classes=C, loss=loss, pull=pull,
                         memory_budget_bytes=20_000)  # small budget: chunked Gram
    want, disp = _dense_delta(model, xr, yr, xf, yf, w0, wd * 10, wd * 7, loss, pull)
    assert float((step.delta_w - want).norm() / want.norm()) < 1e-6
    assert float((step.retain_displacement - disp).norm() / disp.norm()) < 1e-6
    if name == "mlp" and loss == "ce":  # the matrix-free CG path (Θ never formed) on a subset of the grid
        cg = ntk_direction(model, (xr, yr), (xf, yf), wd=wd, w0=w0, num_classes=C, loss=loss, pull=pull,
                           solver="cg", cg_tol=1e-12)
        assert float((cg.delta_w - want).norm() / want.norm()) < 1e-6


@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_equals_corrected_proposition_2(loss):
    """δw = P J_fᵀ M V_c with P = I − J_rᵀ(Θ_rr + λ)⁻¹J_r, M = (Θ_ff + λ − Θ_fr(Θ_rr + λ)⁻¹Θ_rf)⁻¹,
    V_c = r_f − Θ_fr(Θ_rr + λ)⁻¹ r_r  (= (f_0(D_f) − Y_f) + Θ_rfᵀ Θ_rr⁻¹(Y_r − f_0(D_r)) for MSE), same λ."""
    model, start, shape = _tiny("cnn1d")
    x, y = _data(9, shape, seed=1)
    xr, yr, xf, yf = x[:6], y[:6], x[6:], y[6:]
    lam = 0.7
    step = ntk_direction(model, (xr, yr), (xf, yf), wd=0.1, w0=get_flat(start), num_classes=C, loss=loss,
                         pull="point", ridge="fixed", ridge_value=lam)
    jac = dense_refs.dense_jacobian(model, x)
    nr = 6 * C
    jr, jf = jac[:nr], jac[nr:]
    with torch.no_grad():
        r = residuals(model(x), y, loss, C).reshape(-1)
    eye = lambda k: torch.eye(k, dtype=torch.float64)  # noqa: E731
    t_rr, t_rf, t_ff = jr @ jr.T + lam * eye(nr), jr @ jf.T, jf @ jf.T + lam * eye(jf.shape[0])
    p_mat = eye(jac.shape[1]) - jr.T @ torch.linalg.solve(t_rr, jr)
    m_mat = torch.linalg.inv(t_ff - t_rf.T @ torch.linalg.solve(t_rr, t_rf))
    v_c = r[nr:] - t_rf.T @ torch.linalg.solve(t_rr, r[:nr])
    want = p_mat @ jf.T @ m_mat @ v_c
    assert float((step.delta_w - want).norm() / want.norm()) < 1e-6
    # the printed V (retain term with the other sign) is a different vector
    v_printed = r[nr:] + t_rf.T @ torch.linalg.solve(t_rr, r[:nr])
    wrong = p_mat @ jf.T @ m_mat @ v_printed
    assert float((step.delta_w - wrong).norm() / want.norm()) > 1e-3


def _set_linear(model, wb):
    with torch.no_grad():
        model.head.weight.copy_(wb[:, :-1])
        model.head.bias.copy_(wb[:, -1])
    return model


@pytest.mark.parametrize("options", [dict(pull="w0"), dict(pull="point", linearize_at="w0"),
                                     dict(pull="w0", linearize_at="w0"), dict(pull="w0", solver="cg", cg_tol=1e-13)])
def test_linear_mse_scrub_equals_retrained_model(options):
    d, n, nf, wd = 5, 14, 4, 0.2
    start = build_model("mlp", (d,), C, seed=2, depth=0).double().eval()  # Flatten + Linear: a linear model
    x, y = _data(n, (d,), seed=4)
    t = torch.nn.functional.one_hot(y, C).double()
    w_start = torch.cat([start.head.weight, start.head.bias[:, None]], dim=1).detach()
    original = _set_linear(copy.deepcopy(start), dense_refs.ridge_closed_form(x, t, w_start, wd))
    retrained = _set_linear(copy.deepcopy(start), dense_refs.ridge_closed_form(x[:n - nf], t[:n - nf], w_start, wd))
    # the closed form is the converged training: the gradient of the training objective vanishes there
    model = copy.deepcopy(original).train()
    loss = 0.5 * ((model(x) - t) ** 2).sum(1).mean() + 0.5 * wd * sum(
        ((p - q) ** 2).sum() for p, q in zip(model.parameters(), start.parameters()))
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert max(float(g.abs().max()) for g in grads) < 1e-12
    ctx = protocol_ctx(w0={k: v.detach().clone() for k, v in start.named_parameters()},
                        config=TrainConfig(wd=wd), loss="mse", num_classes=C, seed=0)
    method = get_method("ntk", trapezium=False, **options)
    res = method(original, (x[:n - nf], y[:n - nf]), (x[n - nf:], y[n - nf:]), ctx)
    got, want = get_flat(res.model), get_flat(retrained)
    assert float((got - want).norm() / want.norm()) < 1e-8
    geometry = weight_step_geometry(dict(original.named_parameters()), dict(res.model.named_parameters()),
                                    dict(retrained.named_parameters()))
    assert geometry["weight_step_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert geometry["weight_step_cosine"] == pytest.approx(1.0, abs=1e-8)


def test_trapezium_scale_formula():
    scale, cos = trapezium_scale(torch.tensor([1.0, 0.0], dtype=torch.float64),
                                 torch.tensor([3.0, 4.0], dtype=torch.float64))
    assert cos == pytest.approx(0.6) and scale == pytest.approx(1 + 2 * 0.6 * 5 / 1)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        dw = torch.randn(7, generator=g, dtype=torch.float64)
        m = torch.randn(7, generator=g, dtype=torch.float64)
        # the authors' two-branch code
        c = float(dw @ m / (dw.norm() * m.norm()))
        if c < 0:
            norm = float(dw.norm()) + 2 * math.sin(math.acos(c) - math.pi / 2) * float(m.norm())
        else:
            norm = float(dw.norm()) + 2 * math.cos(math.acos(c)) * float(m.norm())
        assert trapezium_scale(dw, m)[0] == pytest.approx(norm / float(dw.norm()), rel=1e-10)


def test_method_applies_trapezium_and_leaves_input_alone():
    model, start, shape = _tiny("mlp")
    x, y = _data(10, shape, seed=5)
    xr, yr, xf, yf = x[:7], y[:7], x[7:], y[7:]
    wd = 0.05
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.01)
    ctx = protocol_ctx(w0={k: v.detach().clone() for k, v in start.named_parameters()}, config=TrainConfig(wd=wd),
                        num_classes=C, seed=0)
    before = get_flat(model).clone()
    res = get_method("ntk", trapezium=True)(model, (xr, yr), (xf, yf), ctx)
    assert torch.equal(get_flat(model), before)
    delta, disp = _dense_delta(model, xr, yr, xf, yf, get_flat(start), wd * 10, wd * 7, "ce", "w0")
    m = (before - get_flat(start)) - disp
    cos = float(delta @ m / (delta.norm() * m.norm()))
    scale = 1 + 2 * abs(cos) * float(m.norm()) / float(delta.norm())
    assert res.info["scale"] == pytest.approx(scale, rel=1e-6)
    assert torch.allclose(get_flat(res.model), before + scale * delta, rtol=1e-6, atol=1e-9)
    true = get_flat(reference) - before
    geometry = weight_step_geometry(dict(model.named_parameters()), dict(res.model.named_parameters()),
                                    dict(reference.named_parameters()))
    assert geometry["weight_step_ratio"] == pytest.approx(float(true.norm() / (scale * delta.norm())), rel=1e-6)
    assert geometry["weight_step_cosine"] == pytest.approx(float(delta @ true / (delta.norm() * true.norm())),
                                                           rel=1e-6)
    off = get_method("ntk", trapezium=False)(model, (xr, yr), (xf, yf), ctx)
    assert off.info["scale"] == 1.0 and off.info["trapezium_scale"] == pytest.approx(scale, rel=1e-6)
    assert off.info.get("cached") == 1.0  # the direction came from ctx.cache
    fixed = get_method("ntk", trapezium=True, step_scale=2.0)(model, (xr, yr), (xf, yf), ctx)
    assert fixed.info["scale"] == 2.0
    assert torch.allclose(get_flat(fixed.model), before + 2.0 * delta, rtol=1e-6, atol=1e-9)


def test_ntk_fisher_reports_information():
    model, start, shape = _tiny("mlp")
    x, y = _data(12, shape, seed=6)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(0.98)
    ctx = protocol_ctx(w0={k: v.detach().clone() for k, v in start.named_parameters()},
                        config=TrainConfig(wd=0.05), num_classes=C, seed=0)
    method = get_method("ntk-fisher", alpha=1e-6)
    res = method(model, (x[:9], y[:9]), (x[9:], y[9:]), ctx)
    det = get_method("ntk")(model, (x[:9], y[:9]), (x[9:], y[9:]), ctx)
    assert not torch.equal(get_flat(res.model), get_flat(det.model))  # the noise was added
    # the Gaussian is centred on the deterministic NTK scrub
    assert torch.equal(flatten(res.noise.mean), get_flat(det.model))
    info = noise_information(method, res, reference, (x[:9], y[:9]), (x[9:], y[9:]), ctx,
                             queries={"forget": x[9:], "retain": x[:9], "test": x[:4]})
    for part in ("forget", "retain", "test"):
        for suffix in ("", "_code"):
            v = info[f"info_activations_nats_{part}{suffix}"]
            assert math.isfinite(v) and v > 0
    assert info["info_weights_nats"] > 0 and res.info["alpha"] == 1e-6


def test_bad_options():
    for bad in (dict(linearize_at="middle"), dict(pull="zero"), dict(loss="hinge"), dict(solver="lu"),
                dict(memory_budget_bytes=0), dict(step_scale=-1.0)):
        with pytest.raises(ValueError):
            get_method("ntk", **bad)
    with pytest.raises(ValueError):
        get_method("ntk-fisher", alpha=0)
    model, start, shape = _tiny("mlp")
    x, y = _data(6, shape)
    ctx = protocol_ctx(w0={}, config=TrainConfig(wd=0.05), num_classes=C)
    with pytest.raises(ValueError):
        get_method("ntk")(model, (x[:4], y[:4]), (x[4:], y[4:]), ctx)
    # wd = 0 is the ridgeless (minimum-norm) limit, not an error: a tiny ridge relative to diag Θ, stated in info
    ctx = protocol_ctx(w0={k: v for k, v in start.named_parameters()}, config=TrainConfig(wd=0.0), num_classes=C)
    res = get_method("ntk")(model, (x[:4], y[:4]), (x[4:], y[4:]), ctx)
    assert res.info["ridgeless"] == 1.0 and 0 < res.info["ridge_full"] < 1e-3
    assert torch.isfinite(get_flat(res.model)).all()


def test_line_figures(tmp_path):
    from types import SimpleNamespace

    from scrubnet.experiments.ntk_figures import plot_ntk_lines
    from scrubnet.readouts.basic import activation_l1
    model, start, shape = _tiny("mlp")
    x, y = _data(12, shape, seed=7)
    split = SimpleNamespace(retain=(x[:8], y[:8]), forget=(x[8:10], y[8:10]), test=(x[10:], y[10:]))
    retrain = copy.deepcopy(start)
    ctx = protocol_ctx(w0={k: v.detach().clone() for k, v in start.named_parameters()},
                        config=TrainConfig(wd=0.05), num_classes=C)
    scrubbed = get_method("ntk")(model, split.retain, split.forget, ctx).model
    out = plot_ntk_lines(model, scrubbed, retrain, split, tmp_path, alphas=[0.0, 0.5, 1.0], betas=[0.0, 1.0])
    d = out["data"]
    assert d["l1_forget"][0] == pytest.approx(activation_l1(model, retrain, split.forget[0]))
    assert d["l1_retain"][2] == pytest.approx(activation_l1(scrubbed, retrain, split.retain[0]), rel=1e-9)
    with torch.no_grad():
        want = float(nn.functional.cross_entropy(retrain(split.test[0]), split.test[1]))
    assert d["loss_test"][1] == pytest.approx(want, rel=1e-9)
    for f in ("ntk_activation_line.png", "ntk_loss_line.png", "ntk_lines.json"):
        assert (tmp_path / f).stat().st_size > 0
