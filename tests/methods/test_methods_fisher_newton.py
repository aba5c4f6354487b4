"""Fisher forgetting (noise rules, empirical scale, white-box bound) and the Newton scrub (exact on quadratics)."""
import copy
import math

import pytest
import torch
from torch import nn

from scrubnet.curvature.fisher import fisher_diag
from scrubnet.curvature.params import get_flat, set_flat
from scrubnet.methods import get_method
from scrubnet.methods.fisher import (CLAMP_MAX, CLAMP_MAX_HEAD, FORGOTTEN_ROW_VAR, fisher_noise,
                                     fisher_noise_variance, head_param_names)
from scrubnet.data.embedded import digits_pools
from scrubnet.methods.newton import _retain_objective, newton_noise_variance, pull_mask_and_anchor
from scrubnet.models import build_model
from scrubnet.experiments.runner import noise_information
from scrubnet.readouts.information import weight_information, weight_step_geometry
from scrubnet.training import TrainConfig, finetune, train_epochs
from tests.conftest import protocol_ctx
from tests import dense_refs


def _linear_problem(seed=0, n=40, n_forget=6, d=5, k=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, k, (n,), generator=g)
    torch.manual_seed(seed)
    model = nn.Linear(d, k).double()
    w0 = {name: torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.1
          for name, p in model.named_parameters()}
    return model, x, y, w0, n_forget


def _ridge_mse(x, y, k, wd, w0):
    """Closed-form minimiser of mean ½‖Wx + b − onehot(y)‖² + (wd/2)‖(W,b) − (W0,b0)‖², as (W, b)."""
    start = torch.cat([w0["weight"], w0["bias"][:, None]], 1)
    wb = dense_refs.ridge_closed_form(x, torch.nn.functional.one_hot(y, k).to(x.dtype), start, wd)
    return wb[:, :-1], wb[:, -1]


def test_newton_scrub_equals_retraining_on_linear_mse_model():
    model, x, y, w0, nf = _linear_problem()
    wd = 0.1
    # the "original": the exact minimiser on all of D
    w_d, b_d = _ridge_mse(x, y, 3, wd, w0)
    with torch.no_grad():
        model.weight.copy_(w_d)
        model.bias.copy_(b_d)
    retain = (x[nf:], y[nf:])
    w_r, b_r = _ridge_mse(*retain, 3, wd, w0)
    retrained = copy.deepcopy(model)
    with torch.no_grad():
        retrained.weight.copy_(w_r)
        retrained.bias.copy_(b_r)
    ctx = protocol_ctx(w0=w0, config=TrainConfig(wd=wd), loss="mse", num_classes=3, seed=0)
    before = get_flat(model)
    res = get_method("newton", tol=1e-12, max_iter=100)(model, retain, (x[:nf], y[:nf]), ctx)
    assert torch.equal(get_flat(model), before)  # input untouched
    assert res.info["newton_cg_converged"] == 1.0 and res.info["newton_cg_iterations"] <= 18
    assert torch.allclose(res.model.weight, w_r, atol=1e-9)
    assert torch.allclose(res.model.bias, b_r, atol=1e-9)
    geometry = weight_step_geometry(dict(model.named_parameters()), dict(res.model.named_parameters()),
                                    dict(retrained.named_parameters()))
    assert geometry["weight_distance_ratio"] < 1e-8 and geometry["weight_step_cosine"] == pytest.approx(1.0)
    assert float(torch.linalg.vector_norm(w_d - w_r)) > 1e-2  # forgetting actually moved the weights
    # the forget set really changed the model: not a no-op test
    assert res.info["newton_objective_after"] < res.info["newton_objective_before"]
    assert res.info["objective_after"] == res.info["newton_objective_after"]
    assert res.info["newton_step_length"] == 1.0 and res.info["newton_damping_tries"] == 0.0  # full step taken


def test_newton_scrub_on_softmax_regression_is_the_closed_form_newton_step():
    model, x, y, w0, nf = _linear_problem(seed=1)
    wd, damping = 0.05, 0.02
    retain = (x[nf:], y[nf:])
    w = get_flat(model)
    anchor = torch.cat([w0["weight"].reshape(-1), w0["bias"]])

    def objective(flat):
        wt, b = flat[:15].view(3, 5), flat[15:]
        logits = retain[0] @ wt.T + b
        return torch.nn.functional.cross_entropy(logits, retain[1]) + 0.5 * wd * ((flat - anchor) ** 2).sum()

    g = torch.autograd.functional.jacobian(objective, w)
    h = torch.autograd.functional.hessian(objective, w)  # exact: GGN = Hessian for a model linear in w
    want = w - torch.linalg.solve(h + damping * torch.eye(len(w), dtype=w.dtype), g)
    ctx = protocol_ctx(w0=w0, config=TrainConfig(wd=wd), num_classes=3, seed=0)
    res = get_method("newton", damping=damping, tol=1e-12, max_iter=200)(model, retain, (x[:nf], y[:nf]), ctx)
    assert torch.allclose(get_flat(res.model), want, atol=1e-9)
    assert res.info["newton_damping"] == damping and res.info["newton_max_iter"] == 200
    assert res.info["newton_step_length"] == 1.0
    # every safeguard takes the full step unchanged when it decreases the objective as the model predicts
    for safeguard in ("backtrack", "none"):
        other = get_method("newton", damping=damping, tol=1e-12, max_iter=200, safeguard=safeguard)(
            model, retain, (x[:nf], y[:nf]), ctx)
        assert torch.equal(get_flat(other.model), get_flat(res.model))


def _bn_cnn_on_digits():
    """A small BatchNorm CNN (eval-mode BN, frozen during fine-tuning) on 300 digits, where the
    Gauss–Newton model of the retain objective is poor: the undamped Newton step increases it."""
    x, y, _, _ = digits_pools()
    x, y = x[:300], y[:300]
    start = build_model("cnn2d", (1, 8, 8), 10, seed=0, channels=8).train()
    train_epochs(start, x, y, lr=0.05, momentum=0.9, batch_size=64, epochs=3,
                 generator=torch.Generator().manual_seed(0))
    start.eval()
    wd = 0.1
    original, _ = finetune(start, x, y, TrainConfig(wd=wd, max_epochs=60), seed=0)
    w0 = {k: v.detach().clone() for k, v in start.named_parameters()}
    ctx = protocol_ctx(w0=w0, config=TrainConfig(wd=wd), num_classes=10, seed=0)
    return original, (x[30:], y[30:]), (x[:30], y[:30]), ctx


def _retain_error(model, retain):
    with torch.no_grad():
        return float((model.eval()(retain[0]).argmax(1) != retain[1]).float().mean())


def test_safeguarded_newton_lowers_the_retain_objective_where_the_plain_step_raises_it():
    original, retain, forget, ctx = _bn_cnn_on_digits()
    plain = get_method("newton", safeguard="none")(original, retain, forget, ctx)
    assert plain.info["objective_after"] > 1.5 * plain.info["objective_before"]  # the failure
    assert _retain_error(plain.model, retain) > 0.3
    for safeguard in ("lm", "backtrack"):
        res = get_method("newton", safeguard=safeguard)(original, retain, forget, ctx)
        info = res.info
        assert info["objective_before"] == pytest.approx(plain.info["objective_before"], rel=1e-6)
        assert info["objective_after"] < info["objective_before"]
        assert _retain_error(res.model, retain) <= _retain_error(original, retain) + 0.02
        # the reported objective is the model's: recompute L_r at the returned weights
        mask, anchor = pull_mask_and_anchor(original, ctx.center(original))
        assert _retain_objective(res.model, get_flat(res.model), retain, loss="ce", wd=0.1, mask=mask,
                                 anchor=anchor, batch_size=512) == pytest.approx(info["objective_after"], rel=1e-6)
        if safeguard == "lm":
            assert info["newton_damping"] > 0 and info["newton_damping_tries"] >= 1
        else:
            assert info["newton_damping"] == 0 and 0 < info["newton_step_length"] < 1


def test_newton_rejects_unknown_safeguard():
    with pytest.raises(ValueError, match="safeguard"):
        get_method("newton", safeguard="trust")


def test_newton_optimal_noise_scale_and_information():
    model, x, y, w0, nf = _linear_problem(seed=2)
    wd, alpha = 0.1, 1e-4
    retain = (x[nf:], y[nf:])
    mean, var = newton_noise_variance(model, retain, alpha=alpha, wd=wd, w0=w0)
    f = fisher_diag(model, retain[0])
    for k in var:  # Σ = √(λσ_h²)·B^{-1/2}, B = diag F + wd
        assert torch.allclose(var[k], math.sqrt(alpha) / torch.sqrt(f[k] + wd), rtol=1e-12)
    ref = copy.deepcopy(model)  # (a common shift of all biases would be invisible: softmax is shift-invariant)
    set_flat(ref, get_flat(model) + 0.3 * torch.randn(get_flat(model).shape, dtype=torch.float64,
                                                      generator=torch.Generator().manual_seed(1)))
    ctx = protocol_ctx(w0=w0, config=TrainConfig(wd=wd), num_classes=3, seed=0)
    method = get_method("newton", alpha=alpha, tol=1e-10)
    res = method(model, retain, (x[:nf], y[:nf]), ctx)
    info = noise_information(method, res, ref, retain, (x[:nf], y[:nf]), ctx)
    assert info["info_weights_nats"] > 0 and math.isfinite(info["info_weights_nats"])
    det_method = get_method("newton", tol=1e-10)
    det = det_method(model, retain, (x[:nf], y[:nf]), ctx)
    noise = get_flat(res.model) - get_flat(det.model)
    assert 0 < float(noise.abs().max()) < 1.0
    # the Gaussian is centred on the Newton step; the deterministic scrub has none and no bound
    assert torch.allclose(get_flat(det.model), torch.cat([res.noise.mean[k].reshape(-1) for k, _ in
                                                          model.named_parameters()]))
    assert det.noise is None and noise_information(det_method, det, ref, retain, (x[:nf], y[:nf]), ctx) == {}


def _small_mlp():
    return build_model("mlp", (3,), 2, seed=0, hidden=4, depth=1)  # features.1: 4×3, head: 2×4


def _hand_fisher(model):
    g = torch.Generator().manual_seed(5)
    f = {k: torch.rand(p.shape, generator=g, dtype=torch.float64) for k, p in model.named_parameters()}
    f["features.1.weight"][0, 0] = 0.0      # 1/(0 + 1e-8) → clamped at 1e3
    f["head.weight"][1, 2] = 1e-9           # head clamp 1e2
    f["features.1.bias"][1] = 0.0
    return {k: v.float() for k, v in f.items()}


@pytest.mark.parametrize("form", ["code", "paper"])
def test_fisher_noise_variance_follows_the_authors_rules(form):
    model, alpha = _small_mlp(), 1e-3
    fisher = _hand_fisher(model)
    assert head_param_names(model, 2) == {"head.weight", "head.bias"}
    mean, var = fisher_noise_variance(model, fisher, alpha=alpha, num_classes=2, form=form)

    def base(fv, cap):
        inv = min(1.0 / (fv + 1e-8), cap)
        return alpha * inv if form == "code" else math.sqrt(alpha * inv)

    fw = fisher["features.1.weight"].double()
    for i in range(4):  # ndim 2, not head: average over dim 1 of the clamped values, no boost
        want = sum(base(float(fw[i, j]), CLAMP_MAX) for j in range(3)) / 3
        assert torch.allclose(var["features.1.weight"][i].double(), torch.full((3,), want, dtype=torch.float64),
                              rtol=1e-5)
    for i in range(4):  # 1-D: ×10
        want = 10 * base(float(fisher["features.1.bias"][i]), CLAMP_MAX)
        assert float(var["features.1.bias"][i]) == pytest.approx(want, rel=1e-5)
    hw = fisher["head.weight"].double()
    for i in range(2):  # head: clamp 1e2, averaged, ×10
        want = 10 * sum(base(float(hw[i, j]), CLAMP_MAX_HEAD) for j in range(4)) / 4
        assert torch.allclose(var["head.weight"][i].double(), torch.full((4,), want, dtype=torch.float64), rtol=1e-5)
    for i in range(2):
        want = 10 * base(float(fisher["head.bias"][i]), CLAMP_MAX_HEAD)
        assert float(var["head.bias"][i]) == pytest.approx(want, rel=1e-5)
    for k, p in model.named_parameters():
        assert torch.equal(mean[k], p.detach())
    # class forgetting: the forgotten row has mean 0 and variance 1e-4
    mean_c, var_c = fisher_noise_variance(model, fisher, alpha=alpha, num_classes=2, forget_class=1, form=form)
    assert torch.all(mean_c["head.weight"][1] == 0) and float(mean_c["head.bias"][1]) == 0.0
    assert torch.allclose(var_c["head.weight"][1], torch.full((4,), FORGOTTEN_ROW_VAR))
    assert torch.equal(var_c["head.weight"][0], var["head.weight"][0])
    # switches
    _, var_raw = fisher_noise_variance(model, fisher, alpha=alpha, num_classes=2, form=form, clamp=False,
                                       per_output_mean=False, boost=1.0)
    want = base(0.0, math.inf)
    assert float(var_raw["features.1.weight"][0, 0]) == pytest.approx(want, rel=1e-5)


def test_fisher_noise_empirical_std_matches_sqrt_variance():
    model, alpha = _small_mlp(), 1e-4
    fisher = _hand_fisher(model)
    draws = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(3000):
        noisy, mean, var = fisher_noise(model, None, alpha=alpha, num_classes=2, fisher=fisher, generator=gen)
        draws.append(get_flat(noisy) - get_flat(model))
    d = torch.stack(draws).double()
    want_std = torch.cat([v.reshape(-1) for v in var.values()]).double().sqrt()
    ratio = d.std(0) / want_std
    assert float((ratio - 1).abs().max()) < 0.1         # 3000 draws: std of the ratio ≈ 1.3 %
    assert float((d.mean(0) / want_std).abs().max()) < 0.1
    # deterministic given the seed
    a, _, _ = fisher_noise(model, None, alpha=alpha, num_classes=2, fisher=fisher, seed=7)
    b, _, _ = fisher_noise(model, None, alpha=alpha, num_classes=2, fisher=fisher, seed=7)
    assert torch.equal(get_flat(a), get_flat(b))


def test_fisher_method_information_readout_and_bad_options():
    torch.manual_seed(0)
    model = build_model("mlp", (6,), 3, seed=0, hidden=8)
    x, y = torch.randn(30, 6), torch.randint(0, 3, (30,))
    retain, forget = (x[5:], y[5:]), (x[:5], y[:5])
    ref = copy.deepcopy(model)
    set_flat(ref, get_flat(model) + 0.01 * torch.randn(get_flat(model).shape))
    ctx = protocol_ctx(w0={}, num_classes=3, seed=0)
    before = get_flat(model)
    method = get_method("fisher", alpha=1e-6)
    res = method(model, retain, forget, ctx)
    assert torch.equal(get_flat(model), before)
    res.info.update(noise_information(method, res, ref, retain, forget, ctx))
    # recompute by hand: each model with its own Fisher on D_r
    fo, fr = fisher_diag(model, retain[0]), fisher_diag(ref, retain[0])
    mo, vo = fisher_noise_variance(model, fo, alpha=1e-6, num_classes=3)
    mr, vr = fisher_noise_variance(ref, fr, alpha=1e-6, num_classes=3)
    want = weight_information(mo, vo, mr, vr)
    assert res.info["info_weights_nats"] == pytest.approx(want["info_weights_nats"], rel=1e-5)
    assert res.info["info_weights_nats_code"] == pytest.approx(want["info_weights_nats_code"], rel=1e-5)
    assert res.info["info_weights_nats"] > 0
    # the scrub's Gaussian is the one it sampled from
    for k in mo:
        assert torch.allclose(res.noise.mean[k], mo[k]) and torch.allclose(res.noise.var[k], vo[k], rtol=1e-6)
    # more noise → less information
    big = get_method("fisher", alpha=1e-4)
    info_big = noise_information(big, big(model, retain, forget, ctx), ref, retain, forget, ctx)
    assert info_big["info_weights_nats"] < res.info["info_weights_nats"]
    # the same model as reference carries no information
    same = noise_information(method, res, model, retain, forget, ctx)
    assert same["info_weights_nats"] == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="alpha"):
        get_method("fisher", alpha=0.0)
    with pytest.raises(ValueError, match="form"):
        get_method("fisher", form="quartic")
    with pytest.raises(ValueError, match="seed"):
        fisher_noise(model, retain, alpha=1e-6, num_classes=3)
