"""The cost model: estimates against measured CPU time and memory, budgets refused before any work, the CLI."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import scrubnet
from scrubnet.cli import app
from scrubnet.curvature.fisher import fisher_diag
from scrubnet.methods.cost import BudgetExceeded, check_budget, estimate
from scrubnet.models import build_model
from tests.test_cli import TINY_TOML

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
def test_fisher_estimate_within_2x_of_measured_cpu_time_and_memory(n, width):
    out = subprocess.run([sys.executable, "-c", MEASURE, str(n), str(width)], capture_output=True, text=True,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert out.returncode == 0, out.stderr
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    torch.set_num_threads(1)
    m = build_model("resnet18", (3, 16, 16), 10, seed=0, width=width).eval()
    est = scrubnet.estimate(m, n, 0, method="fisher", in_shape=(3, 16, 16))
    assert 0.5 <= est.seconds / measured["seconds"] <= 2.0, (est.seconds, measured)
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
    d = tmp_path_factory.mktemp("ckpt")
    cfg = d / "tiny.toml"
    cfg.write_text(TINY_TOML)
    r = runner.invoke(app, ["train", "--config", str(cfg), "--out", str(d / "model")])
    assert r.exit_code == 0, r.output
    ids = d / "ids.txt"
    ids.write_text("0 3 5")
    return d


def _forget(trained, out, *extra):
    return runner.invoke(app, ["forget", "--checkpoint", str(trained / "model" / "original.safetensors"),
                               "--forget-ids", str(trained / "ids.txt"), "--method", "fisher",
                               "--out", str(out), *extra])


def test_cli_dry_run_prints_the_estimate_and_writes_nothing(trained, tmp_path):
    out = tmp_path / "x.safetensors"
    r = _forget(trained, out, "--dry-run")
    assert r.exit_code == 0, r.output
    assert "estimate: fisher:" in r.output and "passes over the data" in r.output
    assert '"peak_bytes"' in r.output and not out.exists()


def test_cli_refuses_over_budget_before_any_work(trained, tmp_path, monkeypatch):
    import scrubnet.cli as cli

    class NoWork:
        def __call__(self, *a, **k):
            raise AssertionError("the method ran despite the refusal")

    real_get = cli.get_method
    monkeypatch.setattr(cli, "get_method", lambda name, **o: (real_get(name, **o), NoWork())[1])
    out = tmp_path / "x.safetensors"
    for extra, needle in ((["--max-seconds", "1e-9"], "estimated"), (["--memory", "1KB"], "peak memory")):
        r = _forget(trained, out, *extra)
        assert r.exit_code == 2, r.output
        assert "refused before any work" in r.output and needle in r.output and "TFLOP" in r.output
        assert not out.exists()
    r = _forget(trained, out, "--memory", "lots")
    assert r.exit_code == 2 and "cannot read" in r.output
