"""The matrix-free NTK machinery against the dense Jacobian (torch.func.jacrev of the whole batch)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from scrubnet.curvature.ntk import (iter_jacobian_rows, jacobian_jvp, jacobian_vjp, ntk_diag_blocks,
                                    ntk_gram, ntk_gram_flops, ntk_matvec, solve_gram, solve_ntk_cg)
from scrubnet.models.zoo import build_model
from tests import dense_refs

C = 3


def _randomise_bn(model: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(5)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g, dtype=m.running_mean.dtype))
            m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=g, dtype=m.running_var.dtype))
            with torch.no_grad():
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g, dtype=m.weight.dtype))
    return model


CASES = [("mlp", (20,), {"hidden": 12}), ("cnn1d", (20,), {"channels": 4}), ("cnn2d", (1, 6, 6), {"channels": 3})]


def _case(name, shape, kw, n=6, seed=0):
    model = _randomise_bn(build_model(name, shape, C, seed=1, **kw).double())
    model.train()  # the NTK is the eval-mode function whatever mode the model is left in
    x = torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return model, x


@pytest.mark.parametrize("name,shape,kw", CASES)
@pytest.mark.parametrize("method", ["explicit", "ghost"])
def test_gram_equals_dense(name, shape, kw, method):
    model, x = _case(name, shape, kw)
    jac = dense_refs.dense_jacobian(model, x)
    dense = jac @ jac.T
    for budget in (1 << 30, 20_000):  # all rows held at once / many held chunks and micro-batches
        gram = ntk_gram(model, x, memory_budget_bytes=budget, method=method)
        assert gram.shape == (len(x) * C, len(x) * C)
        assert torch.allclose(gram, dense, rtol=1e-10, atol=1e-10 * float(dense.abs().max()))
    assert model.training  # mode restored
    bn = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert all(m.training for m in bn)


def test_gram_resnet_auto_mixes_both_contractions():
    """Residual blocks, BatchNorm (eval) and the per-layer explicit/ghost choice, with chunking."""
    model, x = _case("resnet18", (3, 6, 6), {"width": 0.05}, n=4)
    jac = dense_refs.dense_jacobian(model, x)
    gram = ntk_gram(model, x, memory_budget_bytes=60_000)
    assert torch.allclose(gram, jac @ jac.T, rtol=1e-10, atol=1e-10 * float(gram.abs().max()))


def test_gram_bn_buffers_untouched_and_differs_from_train_mode():
    model, x = _case("cnn2d", (1, 6, 6), {"channels": 3})
    before = {k: v.clone() for k, v in model.named_buffers()}
    gram = ntk_gram(model, x)
    for k, v in model.named_buffers():
        assert torch.equal(v, before[k]), k
    # the Gram is the eval-mode one, and eval mode matters here: with batch statistics it differs
    j_eval, j_train = dense_refs.dense_jacobian(model, x), dense_refs.dense_jacobian(model, x, mode="train")
    assert torch.allclose(gram, j_eval @ j_eval.T, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(gram, j_train @ j_train.T, rtol=1e-3, atol=1e-6)


def test_cross_gram():
    model, x = _case("cnn1d", (20,), {"channels": 4})
    x2 = torch.randn(4, 20, dtype=torch.float64)
    got = ntk_gram(model, x, x2, memory_budget_bytes=15_000)
    want = dense_refs.dense_jacobian(model, x) @ dense_refs.dense_jacobian(model, x2).T
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)


class _Odd(nn.Module):
    """A model with parameters outside supported layers (LayerNorm, a free scale): generic fallback."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 7)
        self.norm = nn.LayerNorm(7)
        self.scale = nn.Parameter(torch.tensor([1.5, -0.5, 2.0]))
        self.head = nn.Linear(7, C)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.lin(x)))) * self.scale


def test_generic_fallback_for_unsupported_modules():
    torch.manual_seed(0)
    model = _Odd().double()
    x = torch.randn(5, 5, dtype=torch.float64)
    jac = dense_refs.dense_jacobian(model, x)
    assert torch.allclose(ntk_gram(model, x, memory_budget_bytes=4000), jac @ jac.T, rtol=1e-10, atol=1e-12)


def test_diag_blocks_weighted():
    model, x = _case("cnn2d", (1, 6, 6), {"channels": 3})
    jac = dense_refs.dense_jacobian(model, x).reshape(len(x), C, -1)
    v = torch.rand(jac.shape[-1], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = torch.einsum("nkp,p,nlp->nkl", jac, v, jac)
    got = ntk_diag_blocks(model, x, v, memory_budget_bytes=30_000)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    unweighted = ntk_diag_blocks(model, x)
    assert torch.allclose(unweighted, torch.einsum("nkp,nlp->nkl", jac, jac), rtol=1e-10)
    with pytest.raises(ValueError):
        ntk_diag_blocks(model, x, v[:-1])


def test_rows_iterator_covers_every_parameter_once():
    model, x = _case("cnn2d", (1, 6, 6), {"channels": 3})
    jac = dense_refs.dense_jacobian(model, x)
    rebuilt = torch.zeros_like(jac)
    for sl, (lo, hi), rows in iter_jacobian_rows(model, x, memory_budget_bytes=5000):
        rebuilt[sl.start * C:sl.stop * C, lo:hi] += rows
    assert torch.allclose(rebuilt, jac, rtol=1e-12, atol=1e-12)


def test_vjp_jvp_matvec():
    model, x = _case("cnn1d", (20,), {"channels": 4})
    jac = dense_refs.dense_jacobian(model, x)
    g = torch.Generator().manual_seed(2)
    a = torch.randn(len(x), C, generator=g, dtype=torch.float64)
    v = torch.randn(jac.shape[1], generator=g, dtype=torch.float64)
    assert torch.allclose(jacobian_vjp(model, x, a, batch_size=4), jac.T @ a.reshape(-1), rtol=1e-10, atol=1e-12)
    assert torch.allclose(jacobian_jvp(model, x, v, batch_size=4).reshape(-1), jac @ v, rtol=1e-10, atol=1e-12)
    assert torch.allclose(ntk_matvec(model, x, a, batch_size=4).reshape(-1), jac @ (jac.T @ a.reshape(-1)),
                          rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError):
        jacobian_vjp(model, x, a[:-1])


def test_solvers_cholesky_and_cg_agree():
    model, x = _case("mlp", (20,), {"hidden": 12}, n=5)
    theta = ntk_gram(model, x)
    rhs = torch.randn(len(x), C, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ridge = 0.3
    want = torch.linalg.solve(theta + ridge * torch.eye(theta.shape[0], dtype=torch.float64), rhs.reshape(-1))
    got, info = solve_gram(theta, rhs.reshape(-1), ridge)
    assert torch.allclose(got, want, rtol=1e-9)
    assert info.jitter == 0.0
    cg, cinfo = solve_ntk_cg(model, x, rhs, ridge, tol=1e-12, max_iter=500)
    assert cinfo.converged
    assert torch.allclose(cg.reshape(-1), want, rtol=1e-7, atol=1e-9)
    with pytest.raises(ValueError):
        solve_ntk_cg(model, x, rhs, 0.0)


def test_singular_gram_gets_reported_jitter():
    # more rows than parameters: Θ = J Jᵀ is singular, ridge 0 → Cholesky needs jitter, which is reported
    model = nn.Linear(2, C).double()
    x = torch.randn(6, 2, dtype=torch.float64)
    theta = ntk_gram(model, x)
    assert torch.linalg.matrix_rank(theta) < theta.shape[0]
    sol, info = solve_gram(theta, torch.ones(theta.shape[0], dtype=torch.float64), 0.0)
    assert info.jitter > 0 and torch.isfinite(sol).all()


def test_bad_inputs():
    model, x = _case("mlp", (20,), {"hidden": 12})
    with pytest.raises(ValueError):
        ntk_gram(model, x, method="magic")
    with pytest.raises(ValueError):
        ntk_gram(model, x, memory_budget_bytes=0)
    with pytest.raises(ValueError):
        ntk_gram(model, x[:0])
    with pytest.raises(ValueError):
        solve_gram(torch.eye(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64), -1.0)


def test_gram_flops_of_a_linear_model_by_hand():
    """One Linear layer d → c: the Jacobian pass is the forward (no layer output to back-propagate through),
    the Gram the cheaper of explicit ½R(R+1)·numel + R·numel and ghost ½(N²(d+1) + R²(c+1)) multiply-adds."""
    d, n = 7, 11
    model = nn.Linear(d, C).double()
    x = torch.randn(n, d, dtype=torch.float64)
    got = ntk_gram_flops(model, x)
    r, numel = n * C, (d + 1) * C
    explicit = 0.5 * r * (r + 1) * numel + r * numel
    ghost = 0.5 * (n * n * (d + 1) + r * r * (C + 1))
    assert got["jacobian_pass"] == pytest.approx(n * 2 * d * C)
    assert got["gram"] == pytest.approx(2 * min(explicit, ghost))
    assert got["total"] == pytest.approx(got["jacobian_pass"] + got["gram"])


@pytest.mark.parametrize("budget", [40_000, 300_000, 450_000, 600_000])
def test_gram_chunked_pairs_match_dense(budget):
    """Chunks held two at a time with the other samples streamed in chunk-sized blocks (uneven last block)
    give the same symmetric Gram as J Jᵀ; the budgets give chunks of 1, 2 and 3 samples and one chunk."""
    model, x = _case("resnet18", (3, 6, 6), {"width": 0.05}, n=7)
    jac = dense_refs.dense_jacobian(model, x)
    gram = ntk_gram(model, x, memory_budget_bytes=budget)
    assert torch.allclose(gram, jac @ jac.T, rtol=1e-10, atol=1e-10 * float(gram.abs().max()))


def _schedules(model, x, budgets):
    """{budget: [(number of layers, chunk)] per group} of the symmetric schedule at each budget."""
    from scrubnet.curvature import ntk as ntk_mod
    engine = ntk_mod.JacobianRows(model, x[:1])
    isz = x.element_size()
    return {b: [(len(p.layers), chunk) for p, chunk in
                ntk_mod._symmetric_schedule(engine, x, len(x), "auto", isz, 3 * b // 5)] for b in budgets}


def test_gram_layer_groups_match_dense():
    """When the factors of all samples do not fit, the layers are split into groups, each captured with a
    backward that stops at the group's earliest layer; the summed Gram still equals J Jᵀ."""
    model, x = _case("resnet18", (3, 6, 6), {"width": 0.05}, n=9)
    jac = dense_refs.dense_jacobian(model, x)
    dense = jac @ jac.T
    budgets = [int(b) for b in torch.linspace(20_000, 400_000, 40)]
    grouped = [b for b, sched in _schedules(model, x, budgets).items() if len(sched) > 1]
    assert grouped, "no budget chose layer groups"
    for b in grouped[:: max(1, len(grouped) // 3)]:
        gram = ntk_gram(model, x, memory_budget_bytes=b)
        assert torch.allclose(gram, dense, rtol=1e-10, atol=1e-10 * float(dense.abs().max()))


def test_gram_layer_groups_with_fallback_parameters():
    """Parameters outside registered layers (LayerNorm, a free scale) travel with one group only."""
    from scrubnet.curvature import ntk as ntk_mod
    torch.manual_seed(0)
    model = _Odd().double()
    x = torch.randn(12, 5, dtype=torch.float64)
    engine = ntk_mod.JacobianRows(model, x[:1])
    jac = dense_refs.dense_jacobian(model, x)
    seen = 0
    for held in (1000, 3000):   # one group chunked / both groups chunked (found by listing the schedules)
        schedule = ntk_mod._symmetric_schedule(engine, x, len(x), "auto", 8, held)
        assert len(schedule) == 2 and sum(bool(p.generic_names) for p, _ in schedule) == 1
        seen += sum(chunk < len(x) for _, chunk in schedule)
        got = torch.zeros(len(x) * C, len(x) * C, dtype=torch.float64)
        for plan, chunk in schedule:
            ntk_mod._symmetric_gram(plan, x, got, chunk, 2, 10_000)
        assert torch.allclose(got, jac @ jac.T, rtol=1e-10, atol=1e-12)
    assert seen == 3


def test_group_capture_stops_at_its_earliest_layer():
    """A capture of the last layers only gives the same output gradients as the full capture, for fewer
    FLOPs (the backward passes do not go through the earlier layers)."""
    from scrubnet.curvature import ntk as ntk_mod
    model, x = _case("resnet18", (3, 6, 6), {"width": 0.05}, n=3)
    engine = ntk_mod.JacobianRows(model, x[:1])
    late = engine.layers[-4:]
    full, part = engine.capture(x), engine.capture(x, layers=late)
    assert set(part.grads) == {lay.name for lay in late}
    for lay in late:
        assert torch.equal(full.grads[lay.name][0], part.grads[lay.name][0])
    assert ntk_mod._pass_flops(engine, x[:1], late, False) < 0.7 * ntk_mod._pass_flops(engine, x[:1], engine.layers, True)


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_snake_order_captures_each_chunk_pair_once(monkeypatch, k):
    """k chunks: 1 + k(k−1)/2 chunk captures (the last chunk streamed becomes the next held one), and the
    Gram is exact."""
    from scrubnet.curvature import ntk as ntk_mod
    model, x = _case("cnn2d", (1, 6, 6), {"channels": 3}, n=2 * k)
    engine = ntk_mod.JacobianRows(model, x[:1])
    plan = ntk_mod._GramPlan(engine, len(x), len(x), "auto", 8, 1 << 30)
    calls = []
    real = ntk_mod._GramPlan.hold
    monkeypatch.setattr(ntk_mod._GramPlan, "hold", lambda self, xb, micro: calls.append(len(xb)) or real(self, xb, micro))
    got = torch.zeros(len(x) * C, len(x) * C, dtype=torch.float64)
    ntk_mod._symmetric_gram(plan, x, got, 2, 1, 1 << 20)
    assert len(calls) == 1 + k * (k - 1) // 2
    assert ntk_mod._chunked_passes(k) * k == len(calls)
    # the schedule's cost model walks the same order: with no layer costs it counts the samples captured
    bare = ntk_mod._GramPlan(engine, len(x), len(x), "auto", 8, 1 << 30, layers=[], generic=False)
    assert ntk_mod._schedule_flops(bare, len(x), 2, 1.0, 1 << 20, 8) == sum(calls)
    jac = dense_refs.dense_jacobian(model, x)
    assert torch.allclose(got, jac @ jac.T, rtol=1e-10, atol=1e-10 * float(got.abs().max()))


@pytest.mark.parametrize("name", ["ResCNN", "TinyViT", "NormMLP"])
def test_gram_of_user_models_under_small_budgets(name):
    """Hand-written models (residual CNN, attention with LayerNorm, LayerNorm/GroupNorm MLP): the Gram is
    exact whatever schedule a small budget forces (layer groups, chunks, or all at once)."""
    from scrubnet.curvature import ntk as ntk_mod
    from tests import user_models
    torch.manual_seed(0)
    model = getattr(user_models, name)().double().eval()
    x = user_models.images(8, seed=1)[0].double()
    if name == "NormMLP":
        x = x.flatten(1)
    jac = dense_refs.dense_jacobian(model, x)
    dense = jac @ jac.T
    engine = ntk_mod.JacobianRows(model, x[:1])
    kinds = set()
    for budget in (2_000, 8_000, 30_000, 120_000, 1 << 30):
        sched = ntk_mod._symmetric_schedule(engine, x, len(x), "auto", 8, 3 * budget // 5, budget // 5)
        kinds.add("groups" if len(sched) > 1 else "chunks" if sched[0][1] < len(x) else "whole")
        gram = ntk_gram(model, x, memory_budget_bytes=budget)
        assert torch.allclose(gram, dense, rtol=1e-9, atol=1e-10 * float(dense.abs().max())), budget
    assert kinds == {"whole", "groups", "chunks"}


def test_gram_schedule_forecast_matches_the_run(monkeypatch):
    """``ntk_gram_schedule`` (what the cost model and --dry-run show) names the schedule ``ntk_gram`` runs:
    held at a large budget (no extra FLOPs), layer groups or chunks with extra captures at small ones."""
    from scrubnet.curvature import ntk as ntk_mod
    from scrubnet.curvature import ntk_gram as gram_mod
    model, x = _case("resnet18", (3, 6, 6), {"width": 0.05}, n=9)
    seen = set()
    for budget in (20_000, 60_000, 150_000, 1 << 30):
        forecast = ntk_mod.ntk_gram_schedule(model, x[:1], len(x), memory_budget_bytes=budget)
        ran = []
        real = gram_mod._symmetric_gram
        monkeypatch.setattr(gram_mod, "_symmetric_gram",
                            lambda plan, xx, th, chunk, micro, b: ran.append(-(-len(xx) // chunk)) or real(plan, xx, th, chunk, micro, b))
        ntk_gram(model, x, memory_budget_bytes=budget)
        monkeypatch.setattr(gram_mod, "_symmetric_gram", real)
        if forecast["schedule"] == "held":
            assert ran == [] and forecast["extra_flops"] == 0.0
        else:
            assert ran == forecast["chunks"] and forecast["groups"] == len(ran) and forecast["extra_flops"] > 0
        seen.add(forecast["schedule"])
    assert "held" in seen and len(seen) >= 2
