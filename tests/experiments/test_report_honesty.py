"""Honest reports: epoch cap, readouts that cannot rank methods, a degenerate membership attack, a step that
raised its own objective, the tables' units in the figures, and `scrubnet report` on every kind of run."""
import json

import pytest
from typer.testing import CliRunner

from scrubnet.cli import app
from scrubnet.experiments.ml_protocols import run_ml_protocol
from scrubnet.experiments.report import plot_readouts, render_report, report_warnings
from tests.conftest import tiny_config


def _s(mean, std):
    return {"mean": mean, "std": std}


def _results(**over):
    """A results dict: original and retrain separated on loss_forget, overlapping on error_forget."""
    summ = {
        "original": {"loss_forget": _s(0.05, 0.01), "error_forget": _s(0.30, 0.02), "mia_forget": _s(0.9, 0.05)},
        "retrain": {"loss_forget": _s(0.20, 0.02), "error_forget": _s(0.31, 0.02), "mia_forget": _s(0.7, 0.05)},
        "finetune": {"loss_forget": _s(0.06, 0.01), "error_forget": _s(0.30, 0.02), "mia_forget": _s(0.88, 0.05)},
    }
    runs = {m: [{"seed": 0, "time_s": 1.0, "readouts": {k: v["mean"] for k, v in s.items()}}] for m, s in summ.items()}
    res = {"config": {"data": {"dataset": "mnist1d"}, "model": "mlp", "seeds": [0]},
           "methods": {m: {"runs": runs[m], "summary": summ[m], "band": "retrain"} for m in summ},
           "checks": {"finetune_inside_band": {"band": "retrain", "readouts": {"loss_forget": False,
                                                                               "error_forget": True,
                                                                               "mia_forget": False}},
                      "finetune_loss_forget": {"distance_to_original": 0.01, "distance_to_retrain": 0.14,
                                               "closer_to": "original", "inside_retrain_band": False}},
           "protocol": {"0": {"time_s": 1.0, "original_epochs": 200, "retrain_epochs": 120,
                              "original_zero_error_epoch": None, "retrain_zero_error_epoch": 115,
                              "original_train_error": 0.04, "retrain_train_error": 0.0}}}
    res.update(over)
    return res


def test_epoch_cap_is_reported():
    res = _results()
    md = render_report(res)
    assert "## Warnings" in md
    assert "seed 0: fine-tuning of the original model hit the epoch cap (200 epochs) before zero training error " \
           "(4.0 % left)" in md
    assert not any("retrain model hit" in w for w in report_warnings(res))


def test_a_failed_method_is_reported():
    res = _results()
    res["methods"]["finetune"]["runs"][0]["failed"] = ["CG stopped after 3 of at most 3 iterations"]
    assert "seed 0: method finetune failed: CG stopped after 3 of at most 3 iterations" in report_warnings(res)
    assert not any("failed" in w for w in report_warnings(_results()))


def test_unseparated_readout_cannot_rank_methods():
    md = render_report(_results())
    assert "overlap on error_forget: these readouts cannot rank methods" in md
    # error_forget is not counted as "inside the band"; it is listed as unable to rank
    assert "`finetune` inside the `retrain` band on 0/2 readouts that can rank methods; cannot rank methods on " \
           "error_forget" in md
    # an untouched original passes nothing that can rank
    res = _results()
    res["checks"]["original_like_inside_band"] = {"band": "retrain",
                                                  "readouts": {"loss_forget": False, "error_forget": True}}
    assert "`original_like` inside the `retrain` band on 0/1" in render_report(res)


def test_degenerate_membership_attack_is_flagged():
    res = _results()
    for d in res["methods"].values():
        d["runs"][0]["readouts"]["mia_degenerate"] = 1.0
    md = render_report(res)
    assert "membership attack is degenerate" in md
    assert "| degenerate |" in md
    assert "mia_forget" not in md.split("inside the `retrain` band")[1].split("can rank methods")[0]
    # older results without the flag: every model at exactly 100 % is flagged too
    res = _results()
    for d in res["methods"].values():
        d["runs"][0]["readouts"]["mia_forget"] = 1.0
    assert "membership attack is degenerate" in render_report(res)
    assert "degenerate" not in render_report(_results())


def test_objective_raised_is_flagged():
    res = _results()
    res["methods"]["finetune"]["runs"][0]["readouts"].update(objective_before=1.0, objective_after=1.5)
    assert any("`finetune` raised its own objective" in w for w in report_warnings(res))
    res["methods"]["finetune"]["runs"][0]["readouts"].update(objective_before=1.0, objective_after=0.5)
    assert not any("raised its own objective" in w for w in report_warnings(res))


def test_figures_use_the_tables_units(tmp_path, monkeypatch):
    import matplotlib.axes
    calls = []
    real = matplotlib.axes.Axes.errorbar

    def spy(self, x, y, *a, **k):
        calls.append((self, y[0]))
        return real(self, x, y, *a, **k)

    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", spy)
    plot_readouts(_results(), tmp_path / "r.png")
    seen = {}
    for ax, y in calls:  # titles are set after the points are drawn
        seen.setdefault(ax.get_title(), []).append(y)
    assert seen["membership attack on D_f (%)"][0] == pytest.approx(90.0)
    assert seen["error D_f (%)"][0] == pytest.approx(30.0)
    assert seen["loss D_f (nats)"][0] == pytest.approx(0.05)


def test_report_rerenders_protocol_runs(tmp_path):
    cfg = tiny_config(seeds=[0], method_options={"mlforget": {"sigma": 1e-4, "cg_tol": 1e-5}})
    run_ml_protocol("class", cfg, tmp_path, progress=False)
    before = (tmp_path / "report.md").read_text()
    (tmp_path / "report.md").unlink()
    for f in tmp_path.glob("class_*.png"):
        f.unlink()
    r = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "report.md").read_text() == before
    assert (tmp_path / "class_loss_forget.png").is_file()
    assert json.loads((tmp_path / "results.json").read_text())["protocol"] == "class"
