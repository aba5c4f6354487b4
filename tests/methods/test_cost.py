"""The cost model: estimates against measured CPU time and memory, budgets refused before any work, the CLI."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import scrubnet
from scrubnet.cli import app
from scrubnet.cost_guard import estimate
from scrubnet.training.cost import BudgetExceeded, check_budget, forward_flops
from scrubnet.models import build_model
from tests.conftest import protocol_ctx
from tests.cli.test_cli import train_tiny_checkpoint
from tests.hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()

# one fresh process per size: builds the model and data, then reports the CPU seconds and the resident
# high-water mark above the resident size just before the Fisher diagonal
MEASURE = textwrap.dedent("""
    import json, sys, time, torch
    torch.set_num_threads(1)
    from scrubnet.models import build_model
    from scrubnet.curvature.fisher import fisher_diag
    n, width = int(sys.argv[1]), float(sys.argv[2])
    m = build_model("resnet18", (3, 16, 16), 10, seed=0, width=width).eval()
    x = torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    def kib(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])
    fisher_diag(m, x[:2])                       # first-call set-up (thread pools, allocator) is not the method's
    open("/proc/self/clear_refs", "w").write("5")
    base = kib("VmRSS")
    t0 = time.process_time()
    fisher_diag(m, x)
    print(json.dumps({"seconds": time.process_time() - t0, "bytes": (kib("VmHWM") - base) * 1024}))
""")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to measure memory")
@pytest.mark.parametrize("n,width", [(24, 0.25), (64, 0.5)])
def test_fisher_estimate_within_2x_of_measured_memory(n, width):
    """Memory only: the time estimate is checked against measured CPU time in ``benchmarks/cost_check.py``
    (a time ratio on a shared machine is a benchmark's figure, not a test's)."""
    out = subprocess.run([sys.executable, "-c", MEASURE, str(n), str(width)], capture_output=True, text=True,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    torch.set_num_threads(1)
    m = build_model("resnet18", (3, 16, 16), 10, seed=0, width=width).eval()
    est = scrubnet.estimate(m, n, 0, method="fisher", in_shape=(3, 16, 16), alpha=3e-6)   # the diagonal only
    assert est.seconds > 0
    assert 0.5 <= est.peak_bytes / measured["bytes"] <= 2.0, (est.peak_bytes, measured)
    assert est.passes == 10


def test_estimates_grow_as_the_method_says():
    m = build_model("cnn2d", (1, 8, 8), 4, seed=0, channels=4)
    a = estimate(m, 100, 10, method="fisher", in_shape=(1, 8, 8))
    b = estimate(m, 200, 10, method="fisher", in_shape=(1, 8, 8))
    assert b.flops == pytest.approx(2 * a.flops, rel=1e-9)             # linear in N_r
    mc = estimate(m, 100, 10, method="fisher", in_shape=(1, 8, 8), kind="mc")
    assert mc.passes == 1 and mc.flops < a.flops
    small = estimate(m, 100, 10, method="ntk", in_shape=(1, 8, 8))
    big = estimate(m, 400, 40, method="ntk", in_shape=(1, 8, 8))
    assert big.details["gram_rows"] == 4 * small.details["gram_rows"] and big.flops > 4 * small.flops
    cg = estimate(m, 100, 10, method="ntk", in_shape=(1, 8, 8), memory_budget_bytes=1000)
    assert cg.details["solver"] == "cg"                                # Gram over the budget: CG
    with pytest.raises(ValueError, match="no cost model"):
        estimate(m, 100, 10, method="nonsense", in_shape=(1, 8, 8))


def test_check_budget_refuses_with_the_estimate():
    m = build_model("mlp", (10,), 3, seed=0, hidden=8)
    est = estimate(m, 50, 5, method="fisher", in_shape=(10,))
    check_budget(est, max_seconds=1e9, max_bytes=1e15)
    with pytest.raises(BudgetExceeded, match="refused before any work.*TFLOP"):
        check_budget(est, max_seconds=1e-12)
    with pytest.raises(BudgetExceeded, match="peak memory"):
        check_budget(est, max_bytes=1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = train_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    ids = d / "ids.txt"
    ids.write_text("0 3 5")
    return d


def _forget(trained, out, *extra):
    return runner.invoke(app, ["forget", "--checkpoint", str(trained / "model" / "original.safetensors"),
                               "--forget-ids", str(trained / "ids.txt"), "--method", "fisher",
                               "--out", str(out), *extra])


def test_cli_dry_run_prints_the_estimate_and_writes_nothing(trained, tmp_path):
    out = tmp_path / "x.safetensors"
    r = _forget(trained, out, "--dry-run", "--json", str(tmp_path / "est.json"))
    assert r.exit_code == 0, r.output
    assert "cost of fisher against retraining" in r.output and "passes over D_r" in r.output
    assert "peak_bytes" in json.loads((tmp_path / "est.json").read_text()) and not out.exists()
    r = _forget(trained, out, "--json", str(tmp_path / "est2.json"))   # --json without --dry-run: refused
    assert r.exit_code == 2 and "--json" in r.output and not out.exists()


def test_cli_refuses_over_budget_before_any_work(trained, tmp_path, monkeypatch):
    import scrubnet.cli.forget as cli

    class NoWork:
        def __call__(self, *a, **k):
            raise AssertionError("the method ran despite the refusal")

    real_get = cli.protocol_method
    monkeypatch.setattr(cli, "protocol_method", lambda name, **o: (real_get(name, **o), NoWork())[1])
    out = tmp_path / "x.safetensors"
    for extra, needle in ((["--max-seconds", "1e-9"], "estimated"), (["--memory", "1KB"], "peak memory")):
        r = _forget(trained, out, *extra)
        assert r.exit_code == 2, r.output
        assert "refused before any work" in r.output and needle in r.output and "TFLOP" in r.output
        assert not out.exists()
    r = _forget(trained, out, "--memory", "lots")
    assert r.exit_code == 2 and "cannot read" in r.output


# ---- what the estimates count, checked without timing: FLOPs against FlopCounterMode, passes against the
# iterations the method ran, the work-fixing options against proportionality ---------------------------------

def _counted(fn) -> float:
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


@pytest.mark.parametrize("name,shape,c,kw", [("mlp", (40,), 5, {}), ("cnn2d", (1, 8, 8), 4, {"channels": 4})])
def test_training_estimate_counts_the_flops_of_the_steps_it_runs(name, shape, c, kw):
    from scrubnet.training import TrainConfig, retrain, sgd_loop
    torch.manual_seed(0)
    m = build_model(name, shape, c, seed=0, **kw).eval()
    n, batch = 96, 32
    x, y = torch.randn(n, *shape), torch.randint(c, (n,))
    # one measured epoch of the shared SGD loop (3 steps of 32) = the finetune estimate at epochs=1
    step = _counted(lambda: sgd_loop(m, x, y, lr=0.01, momentum=0.9, batch_size=batch, max_epochs=1,
                                     generator=torch.Generator().manual_seed(0)))
    est = estimate(m, n, 0, method="finetune", in_shape=shape, num_classes=c, epochs=1)
    assert est.flops == pytest.approx(step, rel=1e-9)
    assert estimate(m, n, 0, method="finetune", in_shape=shape, epochs=7).flops == pytest.approx(7 * step, rel=1e-9)
    # retrain: max_epochs epochs (random labels: zero training error is never reached), the error check after
    # every epoch and the final loss: the estimate counts exactly what ran, over D_r ("remove") or D ("replace")
    cfg = TrainConfig(max_epochs=3, batch_size=batch)
    forget = torch.arange(n - 16, n)
    ran = _counted(lambda: retrain(m, x, y, forget, cfg, seed=0, mode="remove"))
    r = estimate(m, n - 16, 16, method="retrain", in_shape=shape, num_classes=c, config=cfg, mode="remove")
    assert r.flops == pytest.approx(ran, rel=1e-9) and r.passes == 3
    replace = estimate(m, n - 16, 16, method="retrain", in_shape=shape, num_classes=c, config=cfg)
    assert replace.flops == pytest.approx(r.flops * n / (n - 16), rel=1e-9)
    # NegGrad and Random labels train on all of D, the protocol's 10 epochs unless told
    ng = estimate(m, n - 16, 16, method="neggrad", in_shape=shape, num_classes=c)
    assert ng.flops == pytest.approx(10 * step, rel=1e-9) and ng.passes == 10


def test_newton_passes_are_its_cg_iterations_and_scale_with_max_iter():
    from scrubnet.methods import get_method
    m = build_model("mlp", (10,), 3, seed=0, hidden=16).eval()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(60, 10, generator=g), torch.randint(3, (60,), generator=g)
    ctx = protocol_ctx(w0={k: v.detach().clone() for k, v in m.named_parameters()}, num_classes=3)
    for k in (3, 7):
        res = get_method("newton", max_iter=k, tol=1e-30, safeguard="none", retain_loss_tolerance=None,
                         retain_error_tolerance=None)(m, (x[:50], y[:50]), (x[50:], y[50:]), ctx)
        est = estimate(m, 50, 10, method="newton", in_shape=(10,), max_iter=k, safeguard="none")
        assert res.info["newton_cg_iterations"] == k                      # the tolerance is never reached
        assert est.passes == 1 + 2 * res.info["newton_cg_iterations"]     # gradient + 2 per GGN product
    a, b, c = (estimate(m, 50, 10, method="newton", in_shape=(10,), max_iter=k, safeguard="none")
               for k in (10, 20, 40))
    assert c.flops - b.flops == pytest.approx(2 * (b.flops - a.flops), rel=1e-9)   # linear in the iterations
    # the upper bound is linear in the cap; the typical estimate stops at NEWTON_TYPICAL_CG_ITERATIONS (30)
    assert c.seconds_upper - b.seconds_upper == pytest.approx(2 * (b.seconds_upper - a.seconds_upper), rel=1e-9)
    assert c.seconds < c.seconds_upper
    assert (b.flops - a.flops) / 10 == pytest.approx(2 * 50 * 3 * (a.flops / 50 / 21 / 3), rel=1e-9)


def test_ntk_cg_estimate_scales_with_its_iteration_cap_and_the_gram_with_its_rows():
    m = build_model("cnn2d", (1, 8, 8), 4, seed=0, channels=4)
    one, two = (estimate(m, 40, 10, method="ntk", in_shape=(1, 8, 8), solver="cg", cg_max_iter=k) for k in (5, 10))
    base = estimate(m, 40, 10, method="ntk", in_shape=(1, 8, 8), solver="cg", cg_max_iter=0)
    assert two.flops - base.flops == pytest.approx(2 * (one.flops - base.flops), rel=1e-9)
    assert two.passes - base.passes == 2 * (one.passes - base.passes) == 40   # 2 solves × (VJP + JVP) × 10
    fwd = forward_flops(m, torch.zeros(1, 1, 8, 8))
    # per iteration a VJP and a JVP (≈ 3 forwards each) over D (50 samples) and over D_r (40)
    assert one.flops - base.flops == pytest.approx(5 * 2 * 3 * fwd * (50 + 40), rel=1e-9)
    assert one.details["gram_flops"] == 0 and one.details["product_flops"] == one.flops
    chol = estimate(m, 40, 10, method="ntk", in_shape=(1, 8, 8), solver="cholesky")
    assert chol.details["gram_flops"] > 0 and chol.flops == chol.details["gram_flops"] + chol.details["product_flops"]
