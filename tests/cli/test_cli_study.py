"""``scrubnet study critical-periods`` end to end on a tiny configuration (seconds), and its bad input."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from scrubnet.cli import app
from scrubnet.experiments.critical_periods import FIGURES

TINY = """
datasets = ["digits"]
seeds = [0, 1]
epochs = 3
onsets = [0, 1]
window = 1
window_onsets = [1]
gap_anchors = [0, 2]
probe_size = 16
digits_train = 40
digits_channels = 3
snapshot_every = 1
"""


def test_study_cli_tiny(tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    out = tmp_path / "cp"
    res = CliRunner().invoke(app, ["study", "critical-periods", "--config", str(cfg), "--out", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    for f in FIGURES + ("report.md", "results.json"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    data = json.loads((out / "results.json").read_text())
    # distinct WD windows: none, [0,3) (always / delayed@0), [0,1) (interrupted@1), [1,3) (delayed@1),
    # [1,2) (window@1) — each trained once per seed
    keys = sorted({r["key"] for r in data["runs"]})
    assert keys == sorted(["none", "wd[0,3)", "wd[0,1)", "wd[1,3)", "wd[1,2)"])
    assert len(data["runs"]) == 2 * 5
    run = data["runs"][0]
    assert run["fisher"]["times"] == [0, 1, 2, 3] and len(run["weights"]["sq_norm"]) == 4
    assert run["fisher"]["peak"] == max(run["fisher"]["trace"])
    an = data["analysis"]["digits"]
    assert set(an["correlations"]) == {"peak_fisher", "final_fisher", "initial_effective_lr", "final_effective_lr"}
    assert an["correlations"]["peak_fisher"]["n"] == 10
    assert all(v["verdict"] in ("reproduces", "does not reproduce", "not testable") for v in an["verdicts"])
    assert [r["schedule"] for r in data["readiness"]["digits"]] == ["none", "wd[0,3)"]
    assert set(data["readiness"]["digits"][0]["gap_from_anchor"]) == {"0", "2"}
    assert len(data["pca"]["digits"]["paths"]["none"]) == 4
    report = (out / "report.md").read_text()
    assert "Pearson" in report and "verdict" in report
    # the same command twice gives the same numbers
    out2 = tmp_path / "cp2"
    res = CliRunner().invoke(app, ["study", "critical-periods", "--config", str(cfg), "--out", str(out2), "--quiet"])
    assert res.exit_code == 0 and json.loads((out2 / "results.json").read_text()) == data


def test_study_cli_bad_input(tmp_path):
    out = tmp_path / "cp"
    for args, msg in ((["--datasets", "cifar10"], "datasets"), (["--seeds", "0"], "seeds"),
                      (["--epochs", "1"], "epochs"), (["--config", str(tmp_path / "missing.toml")], "not found")):
        res = CliRunner().invoke(app, ["study", "critical-periods", "--out", str(out), *args])
        assert res.exit_code == 2 and "error:" in res.output and msg in res.output, (args, res.output)
        assert not out.exists()


def test_tiny_mode_shrinks_the_study_defaults_and_explicit_values_win(monkeypatch):
    from scrubnet.experiments.critical_periods import TINY_CRITICAL_PERIODS, CriticalPeriodsConfig
    monkeypatch.delenv("SCRUBNET_TINY", raising=False)
    full = CriticalPeriodsConfig.from_dict({})
    assert full.epochs == 30 and full.seeds == [0, 1, 2]
    monkeypatch.setenv("SCRUBNET_TINY", "1")
    tiny = CriticalPeriodsConfig.from_dict({})
    assert tiny.epochs == TINY_CRITICAL_PERIODS["epochs"] < full.epochs and tiny.seeds == [0]
    assert CriticalPeriodsConfig.from_dict({"epochs": 8, "seeds": [0, 1]}).epochs == 8
