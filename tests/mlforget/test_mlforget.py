"""ML-Forgetting against closed-form retraining of the user weights (float64, tiny network)."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scrubnet.mlforget import (
    MLConfig,
    SolverConfig,
    build_ml_model,
    forget_all,
    forget_request,
    remaining_information_bound,
    remaining_information_nats,
    retrain_user_weights,
)
from scrubnet.readouts.information import gaussian_kl_diag
from scrubnet.mlforget.objective import UserObjective
from scrubnet.training import TrainConfig
from tests import dense_refs
from tests.conftest import protocol_ctx

C = 3




def make_problem(seed=0, n=60, mu=0.05, linearize=None, **solver):
    torch.manual_seed(seed)
    core = nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.1), nn.Linear(8, C)).double().eval()
    x = torch.randn(n, 6, dtype=torch.float64)
    y = torch.randint(0, C, (n,))
    split = SimpleNamespace(x=x, y=y, forget_idx=torch.tensor([0, 1]), num_classes=C)
    solver = {"cg_max_iter": 2000, "weight_tol": 1e-11, **solver}
    cfg = MLConfig(mu=mu, sigma=0.0, core_fraction=0.3, user_data="rest", linearize=linearize,
                   solver=SolverConfig(**solver))
    state = build_ml_model(None, split, cfg, TrainConfig(), seed=seed, core_model=core)
    return core, x, y, state


def rel(a, b):
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def test_objective_matches_dense_quantities():
    core, x, y, state = make_problem()
    obj = UserObjective(state.model, x, y, C, 0.05)
    w = torch.randn(state.model.num_linearized, dtype=torch.float64)
    g, loss = obj.gradient(w)
    wg = w.clone().requires_grad_(True)
    f = core(x).detach() + state.model.jvp(x, wg)
    ref = 0.5 * ((f - 5 * F.one_hot(y, C).double()) ** 2).sum() / len(x) + 0.025 * (wg ** 2).sum()
    ref.backward()
    torch.testing.assert_close(g, wg.grad, rtol=1e-10, atol=1e-12)
    assert abs(loss - float(ref.detach())) < 1e-10
    H = obj.dense_hessian()
    torch.testing.assert_close(H, H.T, rtol=0, atol=1e-12)


def test_training_is_the_closed_form_minimiser():
    core, x, y, state = make_problem()
    ids = state.user_ids
    assert rel(state.model.delta_flat(), dense_refs.mixed_linear_closed_form(core, x[ids], y[ids], 0.05)) < 1e-8


def test_one_request_without_noise_equals_retraining():
    core, x, y, state = make_problem()
    request = state.deletable_ids()[:5]
    out = forget_request(state, x, y, request, sigma=0.0, noise_seed=3)
    rem = state.remaining_ids()
    assert not torch.isin(request, rem).any()
    assert len(rem) == len(state.user_ids) - 5
    expected = dense_refs.mixed_linear_closed_form(core, x[rem], y[rem], 0.05)
    assert rel(out.w_before_noise, expected) < 1e-5
    assert rel(state.model.delta_flat(), expected) < 1e-5
    # and the step was not trivial: the weights moved by much more than the tolerance
    before = dense_refs.mixed_linear_closed_form(core, x[state.user_ids], y[state.user_ids], 0.05)
    assert rel(before, expected) > 1e-3


def test_ten_sequential_requests_equal_retraining():
    core, x, y, state = make_problem(seed=1, n=80)
    deletable = state.deletable_ids()
    for k in range(10):
        forget_request(state, x, y, deletable[2 * k:2 * k + 2], sigma=0.0, noise_seed=k)
        rem = state.remaining_ids()
        assert rel(state.model.delta_flat(), dense_refs.mixed_linear_closed_form(core, x[rem], y[rem], 0.05)) < 1e-5
    assert len(state.forgotten_ids) == 20
    # retraining from scratch through the library gives the same weights
    assert rel(retrain_user_weights(state, x, y), state.model.delta_flat()) < 1e-8


def test_noise_is_sigma_scaled_and_remaining_information():
    core, x, y, state = make_problem()
    request = state.deletable_ids()[:3]
    out = forget_request(state, x, y, request, sigma=1e-3, noise_seed=7)
    noise = out.w_after - out.w_before_noise
    p = noise.numel()
    assert 0.7 < float(noise.pow(2).sum()) / (p * 1e-6) < 1.3
    w_hat = retrain_user_weights(state, x, y)
    info = remaining_information_nats(out.w_before_noise, w_hat, 1e-3)
    assert 0 <= info < 1e-6  # exact step: w' = ŵ up to the solver tolerance
    # the Gaussian KL with the ½, the same number as the readouts' KL of two isotropic Gaussians
    shifted = w_hat + 1e-3
    assert remaining_information_nats(shifted, w_hat, 1e-3) == pytest.approx(p / 2)
    var = torch.full_like(w_hat, 1e-6)
    assert remaining_information_nats(shifted, w_hat, 1e-3) == pytest.approx(gaussian_kl_diag(shifted, var, w_hat, var))
    assert remaining_information_bound(shifted, w_hat, 1e-3) == pytest.approx(p)


def test_reference_noise_common_random_numbers_or_independent():
    from scrubnet.mlforget.model import reference_noise
    core, x, y, state = make_problem()
    out = forget_request(state, x, y, state.deletable_ids()[:3], sigma=1e-3, noise_seed=7)
    w_hat = retrain_user_weights(state, x, y)
    coupled = reference_noise(MLConfig(sigma=1e-3), out, seed=1)
    assert torch.equal(coupled, out.w_after - out.w_before_noise)
    # scrub and reference then differ only by the solver error
    assert rel(out.w_after, w_hat + coupled) < 1e-8
    indep = reference_noise(MLConfig(sigma=1e-3, coupled_noise=False), out, seed=1)
    assert not torch.allclose(indep, coupled)
    assert 0.4 < float(indep.pow(2).mean()) / 1e-6 < 2.0  # ~80 weights: a loose check of the scale


def test_sgd_on_the_auxiliary_quadratic_approaches_the_newton_step():
    core, x, y, state = make_problem(mu=0.5)
    request = state.deletable_ids()[:5]
    rem = state.remaining_ids()
    rem = rem[~torch.isin(rem, request)]
    expected = dense_refs.mixed_linear_closed_form(core, x[rem], y[rem], 0.5)
    before = state.model.delta_flat()
    lam_max = float(torch.linalg.eigvalsh(UserObjective(state.model, x[rem], y[rem], C, 0.5).dense_hessian())[-1])
    state.config.solver = SolverConfig(solver="sgd", sgd_epochs=300, sgd_lr=1.0 / lam_max, sgd_momentum=0.9,
                                       sgd_lr_decay=1.0, sgd_batch_size=len(rem))
    out = forget_request(state, x, y, request, sigma=0.0)
    assert rel(out.w_before_noise, expected) < 1e-3 * rel(before, expected)
    assert out.info.relative_residual < 1e-2


@pytest.mark.parametrize("precond", ["kfac", "nystrom"])
def test_preconditioned_cg_gives_the_same_step(precond):
    core, x, y, state = make_problem(solver="cg", precond=precond, precond_rank=20)
    request = state.deletable_ids()[:4]
    out = forget_request(state, x, y, request, sigma=0.0)
    rem = state.remaining_ids()
    assert rel(out.w_before_noise, dense_refs.mixed_linear_closed_form(core, x[rem], y[rem], 0.05)) < 1e-5
    if precond == "nystrom":  # built once and reused by the next request
        pre = state.precond
        forget_request(state, x, y, state.deletable_ids()[:2], sigma=0.0)
        assert state.precond is pre
        rem = state.remaining_ids()
        assert rel(state.model.delta_flat(), dense_refs.mixed_linear_closed_form(core, x[rem], y[rem], 0.05)) < 1e-5


def test_forget_all_gives_the_core_model():
    core, x, y, state = make_problem()
    assert not torch.equal(state.model(x), core(x))
    forget_all(state)
    assert torch.equal(state.model(x), core(x))
    assert torch.equal(state.remaining_ids(), torch.zeros(0, dtype=torch.long))


def test_bad_requests_are_refused():
    core, x, y, state = make_problem()
    with pytest.raises(ValueError, match="core data"):
        forget_request(state, x, y, state.core_ids[:1])
    req = state.deletable_ids()[:2]
    forget_request(state, x, y, req)
    with pytest.raises(ValueError, match="already forgotten"):
        forget_request(state, x, y, req[:1])
    with pytest.raises(ValueError, match="empty"):
        forget_request(state, x, y, [])
    with pytest.raises(ValueError, match="duplicated"):
        forget_request(state, x, y, [int(state.deletable_ids()[0])] * 2)
    with pytest.raises(ValueError, match="not user data"):
        forget_request(state, x, y, [10_000])
    with pytest.raises(ValueError):
        MLConfig(mu=0.0)


def test_methods_mlforget_and_retrain_share_the_cached_ml_model():
    from scrubnet.methods import get_method
    from scrubnet.models import build_model

    torch.manual_seed(0)
    n = 40
    x, y = torch.randn(n, 6), torch.randint(0, C, (n,))
    split = SimpleNamespace(x=x, y=y, forget_idx=torch.tensor([1, 5, 9]), num_classes=C)
    start = build_model("mlp", (6,), C, seed=0, hidden=8)
    ctx = protocol_ctx(w0={}, config=TrainConfig(max_epochs=3, extra_epochs=0), num_classes=C, seed=0,
                        split=split, start=start)
    keep = torch.ones(n, dtype=torch.bool)
    keep[split.forget_idx] = False
    res = get_method("mlforget", sigma=1e-3, cg_tol=1e-8)(start, (x[keep], y[keep]), (x[~keep], y[~keep]), ctx)
    ret = get_method("mlforget-retrain", sigma=1e-3, cg_tol=1e-8)(start, (x[keep], y[keep]), (x[~keep], y[~keep]),
                                                                 ctx)
    assert len(ctx.cache) == 1 and res.original is ret.original
    assert [n for n, p in res.model.named_parameters() if p.requires_grad] == \
        [f"delta.{i}" for i in range(len(res.model.delta))]
    assert 0.0 <= res.info["info_weights_nats"] < 1.0  # float32 CG error ≪ σ
    d = (res.model.delta_flat() - ret.model.delta_flat()).norm() / (res.model.num_linearized ** 0.5)
    assert d < 3e-3  # the two differ by two noise draws of std 1e-3
    assert res.model(x).shape == (n, C)
    with pytest.raises(ValueError):
        get_method("mlforget", bogus=1)


@pytest.mark.parametrize("protocol", ["sequential", "class"])
def test_ml_protocols_write_results_and_track_the_retrain(protocol, tmp_path):
    import json

    from scrubnet.experiments.ml_protocols import run_ml_protocol
    from tests.conftest import tiny_config

    cfg = tiny_config(seeds=[0], method_options={"mlforget": {"sigma": 1e-4, "cg_tol": 1e-5}})
    res = run_ml_protocol(protocol, cfg, tmp_path, progress=False, n_requests=3, request_fraction=0.04)
    n_req = 3 if protocol == "sequential" else 1
    assert len(res["summary"]["mlforget"]) == n_req
    sizes = res["seeds"][0]["request_sizes"]
    # sequential: 3 requests of 4 % of the 100 samples of D; class: the whole class 0 (20 samples) at once
    assert sizes == ([4, 4, 4] if protocol == "sequential" else [cfg.data.n_train_per_class])
    for k in range(n_req):
        m, r = res["summary"]["mlforget"][k], res["summary"]["mlforget-retrain"][k]
        for key in ("error_forget", "error_test", "mia_forget"):
            assert abs(m[key]["mean"] - r[key]["mean"]) <= 0.02
        assert m["info_weights_nats"]["mean"] < 100
    if protocol == "class":  # a whole class forgotten: the retrain (and the scrub) get it all wrong
        assert res["summary"]["mlforget"][0]["error_forget"]["mean"] > 0.8
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["protocol"] == protocol
    assert (tmp_path / "report.md").is_file() and (tmp_path / f"{protocol}_loss_forget.png").is_file()
    with pytest.raises(ValueError, match="unknown ML protocol"):
        run_ml_protocol("nope", cfg, None, progress=False)


# ---- the exact solvers: dual (Schur complement on the eigendecomposed Gram) and warm-started CG ----------

def test_dual_coefficients_equal_a_dense_solve_of_the_retained_block():
    from scrubnet.mlforget.dual import DualFactor
    core, x, y, state = make_problem(n=40)
    fac = state.factor
    assert isinstance(fac, DualFactor) and state.train_info["train_solver"] == "dual"
    J = dense_refs.dense_jacobian(core, x[fac.ids])
    torch.testing.assert_close(fac.eigvecs @ torch.diag(fac.eigvals) @ fac.eigvecs.T, J @ J.T, rtol=1e-10, atol=1e-10)
    r = (core(x[fac.ids]).detach() - 5 * F.one_hot(y[fac.ids], C).double())
    g = torch.Generator().manual_seed(0)
    for drop in (0, 1, 5, 12):
        keep = torch.ones(len(fac.ids), dtype=torch.bool)
        keep[torch.randperm(len(keep), generator=g)[:drop]] = False
        a, info = fac.coefficients(keep)
        rows = keep.repeat_interleave(C)
        K = (J @ J.T)[rows][:, rows] + int(keep.sum()) * 0.05 * torch.eye(int(rows.sum()), dtype=torch.float64)
        expected = torch.linalg.solve(K, r[keep].reshape(-1))
        torch.testing.assert_close(a[keep].reshape(-1), expected, rtol=1e-10, atol=1e-12)
        assert torch.all(a[~keep] == 0) and info["relative_residual"] < 1e-12
        assert info["removed_rows"] == drop * C


@pytest.mark.parametrize("solver", ["dual", "cg"])
def test_exact_solvers_equal_retraining_over_sequential_requests(solver):
    """Each step equals the closed-form retrained weights to an absolute 1e-9; the steps compose."""
    core, x, y, state = make_problem(seed=2, n=70, solver=solver)
    deletable = state.deletable_ids()
    for k in range(4):
        out = forget_request(state, x, y, deletable[3 * k:3 * k + 3], sigma=0.0, noise_seed=k)
        assert out.info.solver == solver
        rem = state.remaining_ids()
        expected = dense_refs.mixed_linear_closed_form(core, x[rem], y[rem], 0.05)
        assert float((out.w_before_noise - expected).norm()) < 1e-9
        if solver == "cg":
            assert out.info.extra["weight_error_bound"] <= 1e-11 and out.info.extra["converged"]
        else:
            assert out.info.extra["removed_rows"] == 3 * (k + 1) * C and out.info.relative_residual < 1e-12
    w_hat, info = retrain_user_weights(state, x, y, return_info=True)
    assert float((w_hat - state.model.delta_flat()).norm()) < 1e-9
    assert info["train_solver"] == solver


def test_dual_with_a_subset_of_linearised_weights_and_noise_between_requests():
    """Only the head linearised; noise added after each request does not change the next exact step."""
    core, x, y, state = make_problem(seed=3, n=50, linearize=["2"])
    deletable = state.deletable_ids()
    for k in range(3):
        forget_request(state, x, y, deletable[2 * k:2 * k + 2], sigma=1e-2, noise_seed=k)
    out = forget_request(state, x, y, deletable[6:8], sigma=0.0)
    rem = state.remaining_ids()
    expected = dense_refs.mixed_linear_closed_form(core, x[rem], y[rem], 0.05, names=["2.weight", "2.bias"])
    assert float((out.w_before_noise - expected).norm()) < 1e-9


def test_dual_factor_is_rebuilt_when_missing_or_mostly_removed():
    core, x, y, state = make_problem(seed=4, n=40)
    deletable = state.deletable_ids()
    state.factor = None  # as after loading a checkpoint
    out = forget_request(state, x, y, deletable[:2], sigma=0.0)
    assert out.info.extra["factor_rebuilt"] == "missing" and out.info.extra["factor_build_s"] > 0
    assert len(state.factor.ids) == len(state.user_ids) - len(state.forgotten_ids) + 2
    out = forget_request(state, x, y, deletable[2:20], sigma=0.0)   # > half of the factor's rows
    assert out.info.extra["factor_rebuilt"] == "over half removed"
    rem = state.remaining_ids()
    assert torch.equal(state.factor.ids, rem)
    assert float((out.w_before_noise - dense_refs.mixed_linear_closed_form(core, x[rem], y[rem], 0.05)).norm()) < 1e-9


def test_auto_chooses_by_size_and_retraining_never_uses_the_factor():
    core, x, y, state = make_problem(n=40)          # 28 user samples × 3 classes = 84 rows
    assert state.exact_solver(28) == "dual"
    state.config.solver = SolverConfig(dual_max_rows=50, weight_tol=1e-11)
    assert state.exact_solver(28) == "cg"
    out = forget_request(state, x, y, state.deletable_ids()[:2], sigma=0.0)
    assert out.info.solver == "cg" and state.precond is not None
    state.config.solver = SolverConfig(weight_tol=1e-11)
    state.factor.residuals.zero_()  # a corrupted factor would change the scrub, never the yardstick
    w_hat = retrain_user_weights(state, x, y)
    rem = state.remaining_ids()
    assert float((w_hat - dense_refs.mixed_linear_closed_form(core, x[rem], y[rem], 0.05)).norm()) < 1e-9


def test_dual_fit_from_scratch_is_the_closed_form():
    from scrubnet.mlforget.dual import dual_fit
    core, x, y, state = make_problem(n=30)
    w, info = dual_fit(state.model, x[:20], y[:20], C, 0.05)
    assert float((w - dense_refs.mixed_linear_closed_form(core, x[:20], y[:20], 0.05)).norm()) < 1e-10
    assert info["dual_rows"] == 20 * C and info["relative_residual"] < 1e-12
