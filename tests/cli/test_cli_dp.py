"""``scrubnet dp`` on a tiny configuration: results.json layout, accounting, the checkpoint round trip."""
from __future__ import annotations

import json
import math

import torch
from typer.testing import CliRunner

from scrubnet.cli import app
from scrubnet.data import load_split
from scrubnet.experiments.mixdp import MixDPConfig, data_config
from scrubnet.privacy.accounting import Accounting
from scrubnet.privacy.model import load_private_classifier

TINY = """
seeds = [0]
epsilons = [1.0]
pretrain_epochs = 2
num_samples = 2000
private_per_class = 30
val_per_class = 10
test_per_class = 30
lr_grid = [8.0]
subspace_dim = 8
public_fit_iters = 50
paragon_iters = 50
"""


def test_dp_cli_tiny(tmp_path):
    cfg_file = tmp_path / "tiny.toml"
    cfg_file.write_text(TINY)
    out = tmp_path / "run"
    # an earlier run's files (with a checkpoint at an ε this run does not have) and a file of the user's
    (out / "checkpoints").mkdir(parents=True)
    stale = [out / "results.json", out / "checkpoints" / "adamix-eps3-seed0.safetensors",
             out / "checkpoints" / "adamix-eps3-seed0.safetensors.json"]
    for f in stale + [out / "notes.txt"]:
        f.write_text("earlier")
    res = CliRunner().invoke(app, ["dp", "--config", str(cfg_file), "--out", str(out), "--quiet"])
    assert res.exit_code == 2 and "--overwrite" in res.output, res.output
    assert all(f.read_text() == "earlier" for f in stale)
    res = CliRunner().invoke(app, ["dp", "--config", str(cfg_file), "--out", str(out), "--quiet", "--overwrite"])
    assert res.exit_code == 0, res.output
    assert not stale[1].exists() and not stale[2].exists() and (out / "notes.txt").read_text() == "earlier"
    data = json.loads((out / "results.json").read_text())
    assert set(data) >= {"config", "results"}
    rows = data["results"]
    assert sorted(r["method"] for r in rows) == sorted(["adamix", "noisygd", "public-init-dp", "only-public",
                                                         "paragon"])
    for r in rows:
        assert {"method", "eps", "seed", "test_error", "mia_auc", "mu", "steps"} <= set(r)
        assert 0 <= r["test_error"] <= 1 and 0 <= r["mia_auc"] <= 1
        if r["method"] in ("only-public", "paragon"):
            assert r["eps"] is None
        else:   # T_max(1, 1e-5, 20) = 28 full-batch steps, μ = √28/20, spent ε ≤ target
            assert r["eps"] == 1.0 and r["steps"] == 28
            assert r["mu"] == math.sqrt(28) / 20 and r["epsilon_spent"] <= 1.0
            assert r["pdp_epsilon_max"] <= r["epsilon_spent"] + 1e-9
            assert len(r["clip_thresholds"]) == 28 and min(r["clip_thresholds"]) > 0
    for f in ("report.md", "error_vs_eps.png", "pdp_hist.png"):
        assert (out / f).is_file()
    # the checkpoint is the trained classifier: reloaded, it has the recorded test error and accounting
    model, meta = load_private_classifier(out / "checkpoints" / "adamix-eps1-seed0.safetensors")
    acc = Accounting.from_dict(meta["accounting"])
    assert acc.steps == 28 and len(acc.clip_thresholds) == 28
    split = load_split(data_config(MixDPConfig.from_dict({k: v for k, v in data["config"].items()
                                                         if k in MixDPConfig.__dataclass_fields__})))
    with torch.no_grad():
        err = float((model(split.x_test).argmax(1) != split.y_test).double().mean())
    adamix = next(r for r in rows if r["method"] == "adamix")
    assert abs(err - adamix["test_error"]) < 1e-6


def test_dp_cli_bad_input_writes_nothing(tmp_path):
    out = tmp_path / "run"
    for args in (["--eps", "-1"], ["--eps", "a,b"], ["--delta", "2"], ["--seeds", "0"],
                 ["--config", str(tmp_path / "missing.toml")]):
        res = CliRunner().invoke(app, ["dp", *args, "--out", str(out)])
        assert res.exit_code == 2, (args, res.output)
        assert "error:" in res.output
        assert not out.exists()
    bad = tmp_path / "bad.toml"
    bad.write_text("unknown_knob = 3\n")
    res = CliRunner().invoke(app, ["dp", "--config", str(bad), "--out", str(out)])
    assert res.exit_code == 2 and "unknown" in res.output and not out.exists()


def test_dp_cli_out_of_range_and_unwritable_refused_before_any_work(tmp_path, monkeypatch):
    import scrubnet.cli.dp as cli_dp

    def must_not_run(*a, **k):
        raise AssertionError("the protocol ran")
    monkeypatch.setattr(cli_dp, "run_mixdp", must_not_run)
    out = tmp_path / "run"
    cases = [(["--sigma", "1e300"], "sigma (--sigma) must lie in [0.1, 1000], got 1e+300"),
             (["--eps", "1e300"], "epsilons (--eps) must lie in (0, 64], got 1e+300"),
             (["--eps", "nan"], "got [nan]"),
             (["--eps", "64", "--sigma", "100"], "allows T = 622804 noisy steps, more than the limit 50000"),
             (["--delta", "0.5"], "delta (--delta) must lie in [1e-12, 0.1], got 0.5"),
             (["--seeds", "1000"], "--seeds must lie in [1, 100], got 1000")]
    for args, needle in cases:
        res = CliRunner().invoke(app, ["dp", *args, "--out", str(out)])
        assert res.exit_code == 2 and needle in res.output, (args, res.output)
        assert "Traceback" not in res.output and not out.exists()
    # a path under a regular file cannot be created, even by root: refused before any work
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    res = CliRunner().invoke(app, ["dp", "--out", str(blocker / "run")])
    assert res.exit_code == 2 and f"{blocker} is not a directory" in res.output, res.output
