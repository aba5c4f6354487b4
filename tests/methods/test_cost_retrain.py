"""Cost against retraining: the reference in every estimate, its FLOPs counted, the ceiling refusing before any
work, the measured ratio in the result, retrain on a user's model from its initialisation, the CLI's dry run."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from typer.testing import CliRunner

import scrubnet
from scrubnet.cli import app
from scrubnet.methods import ForgetContext, get_method
from scrubnet.cost_guard import estimate, retrain_estimate
from scrubnet.methods.base import method_class
from scrubnet.models import build_model
from scrubnet.recipe import TrainingRecipe
from scrubnet.training.cost import BudgetExceeded
from tests.cli.test_cli import train_tiny_checkpoint

runner = CliRunner()


def _data(n=60, d=10, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, c, (n,), generator=g)


def test_estimate_carries_the_retraining_reference_and_the_ratio():
    m = build_model("mlp", (10,), 3, seed=0, hidden=8)
    recipe = TrainingRecipe(epochs=4, batch_size=16)
    for method in ("fisher", "newton", "finetune"):
        est = estimate(m, 50, 5, method=method, in_shape=(10,), recipe=recipe)
        assert est.retrain_seconds > 0 and est.retrain_flops > 0
        assert est.cost_vs_retrain == pytest.approx(est.seconds / est.retrain_seconds, rel=1e-12)
        ref = retrain_estimate(m, 50, in_shape=(10,), recipe=recipe)
        assert est.retrain_flops == ref.flops and est.retrain_seconds == pytest.approx(ref.seconds, rel=1e-9)
    # the reference is linear in the recipe's epochs; retrain on a user's model is the reference itself
    twice = retrain_estimate(m, 50, in_shape=(10,), recipe=TrainingRecipe(epochs=8, batch_size=16))
    assert twice.flops == pytest.approx(2 * ref.flops, rel=1e-12)
    r = estimate(m, 50, 5, method="retrain", in_shape=(10,), recipe=recipe)
    assert r.flops == ref.flops and r.cost_vs_retrain == pytest.approx(1.0, rel=1e-9)
    assert "× retraining" in r.summary()


def test_retrain_reference_flops_equal_a_count_of_the_recipes_training_loop():
    m = build_model("mlp", (10,), 3, seed=0, hidden=8)
    x, y = _data(53)                                   # a last batch of 5: the count is per sample
    recipe = TrainingRecipe(epochs=3, batch_size=16, wd=5e-4)
    ctx = ForgetContext.from_recipe(m, recipe, num_classes=3)
    with FlopCounterMode(display=False) as counter:
        get_method("retrain")(m, (x[:48], y[:48]), (x[48:], y[48:]), ctx)
    ran = float(counter.get_total_flops())
    assert ran > 0
    assert retrain_estimate(m, 48, x_probe=x, recipe=recipe).flops == pytest.approx(ran, rel=1e-9)


def test_ceiling_refuses_before_any_work(monkeypatch):
    m = build_model("mlp", (10,), 3, seed=0, hidden=8)
    x, y = _data()
    calls = []
    cls = method_class("newton")
    real = cls.scrub
    monkeypatch.setattr(cls, "scrub", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    with pytest.raises(BudgetExceeded, match=r"refused before any work: estimated .*× retraining > the 0.01×"):
        scrubnet.forget(m, (x[:50], y[:50]), (x[50:], y[50:]), method="newton", force=True,
                        max_cost_vs_retrain=0.01, max_iter=300)   # max_iter given: no budgeted mode
    assert calls == []
    # under a generous ceiling it runs, and the result records the measured ratio
    _, res = scrubnet.forget(m, (x[:50], y[:50]), (x[50:], y[50:]), method="newton", force=True,
                             max_cost_vs_retrain=1e9, on_failure="return")
    assert calls == [1]
    c = res.cost
    assert c["seconds"] > 0 and c["retrain_seconds_estimate"] > 0
    assert c["cost_vs_retrain"] == pytest.approx(c["seconds"] / c["retrain_seconds_estimate"], rel=1e-12)
    assert c["estimate_cost_vs_retrain"] > 0


def test_retrain_on_a_users_model_starts_from_a_seeded_initialisation():
    m = build_model("mlp", (10,), 3, seed=0, hidden=8)
    x, y = _data()
    recipe = TrainingRecipe(epochs=2, batch_size=16)
    a, ra = scrubnet.forget(m, (x[:50], y[:50]), (x[50:], y[50:]), method="retrain", recipe=recipe,
                            on_failure="return")
    b, _ = scrubnet.forget(m, (x[:50], y[:50]), (x[50:], y[50:]), method="retrain", recipe=recipe,
                           on_failure="return")
    c, _ = scrubnet.forget(m, (x[:50], y[:50]), (x[50:], y[50:]), method="retrain", recipe=recipe, seed=1,
                           on_failure="return")
    pa, pb, pc = (torch.cat([p.detach().reshape(-1) for p in n.parameters()]) for n in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)
    # the start is a fresh draw of the initialisation (not the trained weights), the same for the same seed
    from scrubnet.methods.baselines import reinitialised
    flat = lambda n: torch.cat([p.detach().reshape(-1) for p in n.parameters()])   # noqa: E731
    w, r0, r0b = flat(m), flat(reinitialised(m, 0)), flat(reinitialised(m, 0))
    assert torch.equal(r0, r0b) and not torch.allclose(r0, w) and not torch.equal(flat(reinitialised(m, 1)), r0)
    assert ra.report["retrain_epochs"] == 2 and ra.report["retrain_from_init"] == 1.0

    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(10, 3))

        def forward(self, x):
            return x @ self.w

    # a bare nn.Parameter is re-drawn too (truncated normal, std 0.02, |w| ≤ 0.04), the same for the same seed
    w1, w2 = reinitialised(Bare(), 0).w.detach(), reinitialised(Bare(), 0).w.detach()
    assert torch.equal(w1, w2) and bool(w1.ne(0).all()) and float(w1.abs().max()) <= 0.04 + 1e-7


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = train_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    (d / "ids.txt").write_text("0 3 5")
    return d


def test_dry_run_prints_the_estimate_beside_retraining_and_the_ceiling_refuses(trained, tmp_path):
    out = tmp_path / "x.safetensors"
    base = ["forget", "--checkpoint", str(trained / "model" / "original.safetensors"), "--forget-ids",
            str(trained / "ids.txt"), "--method", "newton", "--out", str(out)]
    est = tmp_path / "estimate.json"
    r = runner.invoke(app, [*base, "--dry-run", "--json", str(est)])
    assert r.exit_code == 0, r.output
    assert "retrain (recipe)" in r.output and "cost_vs_retrain:" in r.output
    assert "retrain_seconds" in json.loads(est.read_text()) and not out.exists()
    assert "{" not in r.output  # a table and short lines, no raw JSON on the screen
    r = runner.invoke(app, [*base, "--max-cost-vs-retrain", "1e-6"])
    assert r.exit_code == 2 and "× retraining > the 1e-06× allowed" in r.output and not out.exists()


def test_budgeted_mode_is_chosen_under_a_tiny_ceiling_and_reports_what_it_reached():
    m = build_model("mlp", (10,), 3, seed=0, hidden=8)
    x, y = _data(300)
    recipe = TrainingRecipe(epochs=3, batch_size=32)
    full = estimate(m, 280, 20, method="newton", x_probe=x, recipe=recipe)
    ceiling = 0.02 * full.ceiling_vs_retrain   # refusals and budgets judge the upper bound
    _, res = scrubnet.forget(m, (x[:280], y[:280]), (x[280:], y[280:]), method="newton", recipe=recipe, force=True,
                             max_cost_vs_retrain=ceiling, on_failure="return")
    k = int(res.cost["budgeted"].split("=")[1])
    assert res.cost["budgeted"].startswith("cg_budget=") and 1 <= k <= 300
    assert res.cost["estimate_cost_vs_retrain"] <= min(1.0, ceiling)
    assert res.report["newton_cg_budget"] == k and res.report["newton_cg_iterations"] <= k
    assert "newton_cg_relative_residual" in res.report
    # an option the budget replaces, given by the caller, keeps the full method (and the ceiling refuses it)
    with pytest.raises(BudgetExceeded):
        scrubnet.forget(m, (x[:280], y[:280]), (x[280:], y[280:]), method="newton", recipe=recipe, force=True,
                        max_cost_vs_retrain=ceiling, max_iter=300)


def test_fisher_subsample_is_the_mean_of_its_parts_with_its_standard_error():
    from scrubnet.curvature.fisher import fisher_diag
    from scrubnet.data.stream import as_stream
    from scrubnet.methods.fisher import subsample_fisher
    m = build_model("mlp", (10,), 3, seed=0, hidden=8)
    x, y = _data(64)
    full = fisher_diag(m, x)
    every, info = subsample_fisher(m, as_stream((x, y)), 64, "true", None, seed=0)   # all samples, permuted
    for k in full:
        torch.testing.assert_close(every[k], full[k], rtol=1e-5, atol=1e-8)
    assert info["fisher_subsample"] == 64 and 0 < info["fisher_trace_rel_se"] < 1
    half, info2 = subsample_fisher(m, as_stream((x, y)), 32, "true", None, seed=0)
    assert info2["fisher_trace_rel_se"] > 0 and not torch.equal(half[next(iter(half))], full[next(iter(full))])
    # the subsample's cost is the diagonal on k samples
    a = estimate(m, 64, 0, method="fisher", x_probe=x, alpha=1e-6, subsample=32)
    b = estimate(m, 32, 0, method="fisher", x_probe=x, alpha=1e-6)
    assert a.flops == pytest.approx(b.flops, rel=1e-12)


def test_ntk_cg_budget_stops_at_its_budget_and_reports_the_residual():
    m = build_model("mlp", (10,), 3, seed=0, hidden=8)
    x, y = _data(60)
    recipe = TrainingRecipe(wd=5e-4)
    _, res = scrubnet.forget(m, (x[:50], y[:50]), (x[50:], y[50:]), method="ntk", recipe=recipe, force=True,
                             cg_budget=2, cg_tol=1e-30, on_failure="return")
    assert res.ok, res.reasons                       # at its budget: reported, not failed
    assert res.report["ntk_cg_budget"] == 2 and res.report["solve_full_iterations"] == 2
    assert res.report["solve_full_relative_residual"] > 0
    _, full = scrubnet.forget(m, (x[:50], y[:50]), (x[50:], y[50:]), method="ntk", recipe=recipe, force=True,
                              solver="cg", cg_max_iter=2, cg_tol=1e-30, on_failure="return")
    assert not full.ok                               # the full method at the same cap says it failed
    a = estimate(m, 50, 10, method="ntk", x_probe=x, cg_budget=4)
    b = estimate(m, 50, 10, method="ntk", x_probe=x, solver="cg", cg_max_iter=4)
    assert a.flops == b.flops


def test_fisher_budgeted_by_subsample_through_forget_reports_its_variance():
    m = build_model("mlp", (10,), 3, seed=0, hidden=8)
    x, y = _data(420)
    recipe = TrainingRecipe(epochs=1, batch_size=64)
    full = estimate(m, 400, 20, method="fisher", x_probe=x, recipe=recipe, alpha=1e-6)
    _, res = scrubnet.forget(m, (x[:400], y[:400]), (x[400:], y[400:]), method="fisher", recipe=recipe, force=True,
                             alpha=1e-6, max_cost_vs_retrain=0.5 * full.cost_vs_retrain, on_failure="return")
    k = int(res.cost["budgeted"].split("=")[1])
    assert res.cost["budgeted"].startswith("subsample=") and 8 <= k < 400
    assert res.report["fisher_subsample"] == k and res.report["fisher_trace_rel_se"] > 0


def test_a_call_that_cost_more_than_retraining_says_so_in_its_warnings():
    """A one-epoch recipe on 60 samples retrains in microseconds by the estimate; a curvature call's fixed costs
    (probes, first functorch calls) are far above it: the measured ratio exceeds 1 and the result says so. A
    hundred-epoch recipe on the same call prices retraining above what the call costs: no such warning."""
    m = build_model("mlp", (10,), 3, seed=0, hidden=8)
    x, y = _data(64)
    for epochs, above in ((1, True), (100_000, False)):
        _, res = scrubnet.forget(m, (x[:60], y[:60]), (x[60:], y[60:]), method="fisher", force=True, alpha=1e-6,
                                 recipe=TrainingRecipe(epochs=epochs, batch_size=64), on_failure="return")
        said = [w for w in res.warnings if w.startswith("cost more than retraining")]
        assert (res.cost["cost_vs_retrain"] > 1.0) is above, res.cost
        assert bool(said) is above, res.warnings
        if above:
            assert f"{res.cost['cost_vs_retrain']:.2g}× one retraining" in said[0]


def test_budgeted_fisher_measures_its_alpha_search_on_a_sample_that_reads_like_all_of_d_r():
    """subsample=16 on N_r = 3,000: the α search's losses on 2,000 seeded samples (priced so), and the retain-loss
    rise it measured there is the rise on all of D_r to within 0.01 nats (a paired difference of means)."""
    from scrubnet.data.stream import as_stream
    from scrubnet.methods.fisher import LOSS_SAMPLE_MIN, _stream_mean_loss, loss_sample_size
    from scrubnet.training.cost import forward_flops
    torch.manual_seed(0)
    m = build_model("mlp", (10,), 3, seed=0, hidden=16)
    x, y = _data(3000)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(30):
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    assert loss_sample_size(3000, 16) == LOSS_SAMPLE_MIN and loss_sample_size(3000, None) == 3000
    est = estimate(m, 3000, 0, method="fisher", x_probe=x[:1], subsample=16)
    assert est.details["alpha_search_flops"] == pytest.approx(8 * LOSS_SAMPLE_MIN * forward_flops(m, x[:1]))
    ctx = ForgetContext.from_recipe(m, TrainingRecipe(), num_classes=3)
    res = get_method("fisher", subsample=16).scrub(m, as_stream((x, y)), as_stream((x[:5], y[:5])), ctx)
    assert res.info["retain_loss_samples"] == LOSS_SAMPLE_MIN
    rise_all = _stream_mean_loss(res.model, as_stream((x, y))) - _stream_mean_loss(m, as_stream((x, y)))
    assert abs(res.info["retain_loss_increase"] - rise_all) < 0.01, (res.info["retain_loss_increase"], rise_all)
