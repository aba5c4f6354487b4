"""The forgetting verdict wired into the scrub path (scrubnet.forget, `scrubnet forget`, `scrubnet run`) and the
report warnings that keep results from misleading: a Newton step damped to a near no-op, an original stopped
above 0 % training error, a run without its anchors, an audit whose game cannot rank methods."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from typer.testing import CliRunner

import scrubnet
from scrubnet.audit.report import audit_warnings, game_power
from scrubnet.checkpoint import read_meta
from scrubnet.cli import app
from scrubnet.experiments.report import render_report, report_warnings
from scrubnet.experiments.runner import run_experiment
from scrubnet.methods import base
from scrubnet.methods.base import ForgettingMethod, ScrubResult, register
from scrubnet.readouts.forgetting import VERDICTS
from scrubnet.recipe import TrainingRecipe
from scrubnet.scrub import ScrubFailed
from tests.conftest import tiny_config

D, C = 20, 3
KEEP = "keep-test"

NET_PY = f'''
from torch import nn


def make_net():
    return nn.Sequential(nn.Linear({D}, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, {C}))
'''


class Keep(ForgettingMethod):
    """Returns the model unchanged while claiming to forget (``forgets`` is the default True)."""

    needs_retain = False
    options = {}

    def scrub(self, model, retain, forget, ctx) -> ScrubResult:
        return ScrubResult(copy.deepcopy(model).eval())


@pytest.fixture
def keep():
    register(KEEP)(Keep)
    yield KEEP
    base._REGISTRY.pop(KEEP)


def _data(seed: int, n: int, noise: float = 0.3):
    """Three Gaussian classes in 20 dimensions, 30 % of labels redrawn: a fitted MLP memorises them."""
    mu = torch.randn(C, D, generator=torch.Generator().manual_seed(1000)) * 0.6
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, C, (n,), generator=g)
    x = mu[y] + torch.randn(n, D, generator=g)
    flip = torch.rand(n, generator=g) < noise
    return x, torch.where(flip, torch.randint(0, C, (n,), generator=g), y)


def _fit(model: nn.Module, x, y, steps: int = 300) -> nn.Module:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def world():
    """A model that memorised D_f (25 of 200 noisy samples; before AUC ≈ 0.75) and 500 held-out samples."""
    torch.set_num_threads(1)
    x, y = _data(0, 200)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(D, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, C))
    return dict(x=x, y=y, forget=(x[:25], y[:25]), retain=(x[25:], y[25:]), held=_data(100, 500),
                model=_fit(net, x, y))


# --- scrubnet.forget -------------------------------------------------------------------------------------------

def test_forget_with_test_data_fails_a_scrub_that_did_not_forget(world, keep):
    w = world
    with pytest.raises(ScrubFailed) as e:
        scrubnet.forget(w["model"], w["retain"], w["forget"], method=keep, num_classes=C, test=w["held"])
    r = e.value.result
    assert not r.ok and r.forgetting.verdict == "did_not_forget"
    assert any("did_not_forget" in s and "AUC" in s for s in r.reasons), r.reasons  # the numbers in the reason
    assert r.forgetting.auc_after == r.forgetting.auc_before > 0.6  # memorised, and left memorised
    # asked for a warning instead: ok, the verdict kept, the warning says it
    _, r = scrubnet.forget(w["model"], w["retain"], w["forget"], method=keep, num_classes=C, test=w["held"],
                           on_not_forgotten="warn")
    assert r.ok and r.reasons == [] and r.forgetting.verdict == "did_not_forget"
    assert len(_said(r)) == 1 and "did_not_forget" in _said(r)[0]


def _said(r):
    """The result's warnings other than the measured cost (a tiny model's fixed costs exceed its retraining)."""
    return [w for w in r.warnings if not w.startswith("cost more than retraining")]


def test_forget_verdict_only_with_test_data_and_only_fails_forgetting_methods(world, keep):
    w = world
    _, r = scrubnet.forget(w["model"], w["retain"], w["forget"], method=keep, num_classes=C)
    assert r.ok and r.forgetting is None and _said(r) == []  # no held-out data: nothing to judge with
    # the original anchor is not a forgetting method: the same verdict does not fail it
    _, r = scrubnet.forget(w["model"], w["retain"], w["forget"], method="original", num_classes=C, test=w["held"])
    assert r.ok and r.forgetting.verdict == "did_not_forget" and _said(r) == []
    with pytest.raises(ValueError, match="on_not_forgotten"):
        scrubnet.forget(w["model"], w["retain"], w["forget"], method=keep, num_classes=C, test=w["held"],
                        on_not_forgotten="ignore")


def test_forget_verdict_reads_forgot_for_a_scrub_that_retrains(world):
    """A method returning the model refitted on D_r alone (another init): the verdict is forgot, ok stays."""
    w = world
    torch.manual_seed(50)
    refit = _fit(nn.Sequential(nn.Linear(D, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, C)),
                 *w["retain"])

    class Refit(Keep):
        def scrub(self, model, retain, forget, ctx):
            return ScrubResult(copy.deepcopy(refit))

    register("refit-test")(Refit)
    try:
        _, r = scrubnet.forget(w["model"], w["retain"], w["forget"], method="refit-test", num_classes=C,
                               test=w["held"], retain_error_tolerance=1.0)
    finally:
        base._REGISTRY.pop("refit-test")
    assert r.ok and r.forgetting.verdict == "forgot", r.forgetting.summary
    assert abs(r.forgetting.auc_after - 0.5) < abs(r.forgetting.auc_before - 0.5)


def _step(model, after, retain, forget, held, **kw):
    """The scrub path's verdict step on a result whose method (Keep: a forgetting method) returned ``after``."""
    from scrubnet.scrub import ForgetResult, verdict_step
    out = ForgetResult(ok=True, reasons=[], method=KEEP, recipe=TrainingRecipe(), scrub=ScrubResult(after))
    verdict_step(out, Keep(), model, retain, forget, held, "fail", **kw)
    return out


def test_verdict_step_uses_reference_models_and_never_passes_silently(world):
    """Reference models reach the verdict (calibrated scores, their cost recorded); an undecided verdict of a
    forgetting method is a warning with its reason; a class without held-out examples is nothing_to_measure
    with the reason, not a silent ok."""
    from scrubnet.readouts.references import train_references
    w = world

    def fit(idx, seed):
        torch.manual_seed(seed)
        return _fit(nn.Sequential(nn.Linear(D, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, C)),
                    w["x"][idx], w["y"][idx])
    refs = train_references(fit, 200, seed=3)
    out = _step(w["model"], copy.deepcopy(w["model"]), w["retain"], w["forget"], w["held"], references=refs,
                forget_ids=np.arange(25))
    v = out.forgetting
    assert v.statistic == "calibrated" and v.references["models"] == 4 and v.verdict == "did_not_forget"
    assert not out.ok and "did_not_forget" in out.reasons[0]
    unseen = _data(7, 12)  # a "D_f" the model never trained on: no membership to establish, undecided
    out = _step(w["model"], w["model"], w["retain"], unseen, w["held"])
    assert out.forgetting.verdict in ("inconclusive", "nothing_to_measure"), out.forgetting.summary
    assert out.ok and any("could not judge" in x for x in out.warnings)
    cls = w["y"] == 2
    hx, hy = w["held"]
    out = _step(w["model"], w["model"], (w["x"][~cls], w["y"][~cls]), (w["x"][cls], w["y"][cls]),
                (hx[hy != 2], hy[hy != 2]))
    assert out.forgetting.verdict == "nothing_to_measure" and out.forgetting.request == "class"
    assert out.ok and any("no held-out example of the forgotten class 2" in x for x in out.warnings)


def test_method_traits_say_which_methods_forget():
    assert not base.method_class("original").forgets and not base.method_class("retrain").forgets
    assert not base.method_class("hiding").forgets and not base.method_class("mlforget-retrain").forgets
    assert all(base.method_class(m).forgets for m in ("finetune", "fisher", "newton", "ntk", "mlforget"))


# --- scrubnet forget (own model) -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def own(world, tmp_path_factory):
    d = tmp_path_factory.mktemp("own")
    (d / "net.py").write_text(NET_PY)
    np.savez(d / "data.npz", x_train=world["x"].numpy(), y_train=world["y"].numpy(),
             x_test=world["held"][0].numpy(), y_test=world["held"][1].numpy())
    torch.save(world["model"].state_dict(), d / "net.pt")
    (d / "forget.txt").write_text(" ".join(str(i) for i in range(25)))
    return d


def _own_args(d, method, out):
    return ["forget", "--model", f"{d / 'net.py'}:make_net", "--weights", str(d / "net.pt"), "--data",
            str(d / "data.npz"), "--forget-ids", str(d / "forget.txt"), "--method", method, "--out", str(out)]


def test_cli_forget_prints_the_verdict_and_fails_unless_warned(own, keep, tmp_path):
    runner = CliRunner()
    out = tmp_path / "kept.safetensors"
    r = runner.invoke(app, _own_args(own, keep, out))
    assert r.exit_code == 2 and "error:" in r.output and "did_not_forget" in r.output, r.output
    assert not out.exists()  # a failed scrub writes nothing
    r = runner.invoke(app, _own_args(own, keep, out) + ["--warn-not-forgotten"])
    assert r.exit_code == 0, r.output
    assert "forgetting verdict: did_not_forget" in r.output and "warning:" in r.output
    meta = read_meta(out)  # the sidecar records the verdict and the warning
    assert meta["forgetting"]["verdict"] == "did_not_forget" and "did_not_forget" in meta["warnings"][0]
    r = runner.invoke(app, _own_args(own, "original", tmp_path / "o.safetensors"))
    assert r.exit_code == 0 and "forgetting verdict: did_not_forget" in r.output and "warning:" not in r.output


# --- report warnings -------------------------------------------------------------------------------------------

def test_newton_near_noop_is_measured_and_warned(world):
    """Tiny weight decay: the Gauss–Newton step at μ = wd is long (flat directions); the LM safeguard rejects
    it twice and the accepted step is < 0.1 of it (measured 0.092): D_f's loss stays near the original's."""
    w = world
    args = dict(method="newton", num_classes=C, recipe=TrainingRecipe(wd=1e-4), force=True, on_failure="return")
    # the full safeguarded method, not the CG-budgeted mode a call picks when the full one would cost more
    _, r = scrubnet.forget(w["model"], w["retain"], w["forget"], safeguard="lm", **args)
    rep = r.report
    frac = rep["newton_step_norm"] / rep["newton_undamped_step_norm"]
    assert rep["newton_step_fraction"] == pytest.approx(frac) and rep["newton_damping_tries"] >= 1
    assert frac < 0.1 and rep["newton_near_noop"] == 1.0 and rep["newton_step_length"] == 1.0
    assert r.ok and len(_said(r)) == 1 and "near no-op" in _said(r)[0]  # ok, but said
    # the plain step (no safeguard) is the undamped step itself: fraction 1, nothing to warn
    _, r = scrubnet.forget(w["model"], w["retain"], w["forget"], safeguard="none", **args)
    assert r.report["newton_step_fraction"] == pytest.approx(1.0) and r.report["newton_near_noop"] == 0.0
    assert _said(r) == []


def test_report_warns_of_an_original_above_zero_training_error():
    results = {"config": {"resolved": {}}, "methods": {},
               "protocol": {"1": {"original_zero_error_epoch": 126, "original_train_error": 0.002,
                                  "original_epochs": 131, "retrain_zero_error_epoch": 125,
                                  "retrain_train_error": 0.0}}}
    warns = report_warnings(results)
    assert len(warns) == 1 and "seed 1" in warns[0] and "0.2 % training error" in warns[0]
    results["protocol"]["1"]["original_train_error"] = 0.0
    assert report_warnings(results) == []


def test_run_with_one_method_adds_the_anchors_and_carries_verdicts(tmp_path):
    cfg = tiny_config(methods=["finetune"])
    res = run_experiment(cfg, tmp_path, progress=False)
    assert list(res["methods"]) == ["original", "retrain", "finetune"]
    assert res["config"]["resolved"]["anchors_added"] == ["original", "retrain"]
    assert any("added (original, retrain)" in w for w in report_warnings(res))
    for m, d in res["methods"].items():
        run = d["runs"][0]
        assert run["forgetting"]["verdict"] in VERDICTS
        assert not any(k.startswith("auc") or k == "forgetting" for k in run["readouts"])  # kept out of readouts
        assert "forgetting" not in d["summary"]
    # the original's verdict is the identity's: the same AUC before and after
    v = res["methods"]["original"]["runs"][0]["forgetting"]
    assert v["auc_before"] == v["auc_after"]
    md = (tmp_path / "report.md").read_text()
    assert "## Forgetting verdict" in md and "| finetune |" in md.split("## Forgetting verdict")[1]
    assert "added (original, retrain)" in md
    assert md == render_report(json.loads((tmp_path / "results.json").read_text()))


def test_runner_report_carries_method_warnings():
    results = {"config": {"resolved": {}}, "methods": {"newton": {"runs": [
        {"seed": 0, "readouts": {}, "warnings": ["the Newton step was damped to a near no-op: …"]}]}}}
    warns = report_warnings(results)
    assert warns == ["seed 0: `newton`: the Newton step was damped to a near no-op: …"]


def _comparisons(game_sep: bool, klom_sep: bool) -> dict:
    def row(sep: bool) -> dict:
        return {"a": "original", "b": "retrain", "difference_ci95": [0.01, 0.2] if sep else [-0.05, 0.1],
                "distinguishable": sep}

    other = {"a": "original", "b": "finetune", "difference_ci95": [-0.1, 0.1], "distinguishable": False}
    return {"comparisons": {"ulira_game_balanced_accuracy": [row(game_sep), other],
                            "klom_forget": [row(klom_sep), other]}}


def test_audit_says_when_the_game_cannot_rank_and_names_what_can():
    p = game_power(_comparisons(False, True))
    assert p == {"can_rank": False, "difference_ci95": [-0.05, 0.1], "separating": ["klom_forget"]}
    (w,) = audit_warnings(_comparisons(False, True))
    assert "cannot rank methods" in w and "KLoM (forget) separate" in w and "[-0.050, 0.100]" in w
    (w,) = audit_warnings(_comparisons(False, False))
    assert "cannot rank methods" in w and "no compared statistic separates them" in w
    assert audit_warnings(_comparisons(True, False)) == []
    assert game_power({"comparisons": {"ulira_game_balanced_accuracy": []}}) is None  # no anchors: no claim
