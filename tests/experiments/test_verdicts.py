"""The verdict layer on synthetic results whose verdict is known: summaries over seeds, the original/retrain
separation (2σ), the bands, the closer-to checks, the report's formatting; plus the guards a verdict relies
on (the data fingerprint of a checkpoint, the seed of the noise, the pull mask of the Newton step)."""
import json

import numpy as np
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from scrubnet.cli import app
from scrubnet.experiments.report import render_report
from scrubnet.experiments.runner import CORE_READOUTS, inside_band, separation_checks, summarise
from scrubnet.methods import get_method
from scrubnet.training import TrainConfig
from tests.conftest import protocol_ctx
from tests import dense_refs
from tests.cli.test_cli import TINY_TOML


def _runs(per_seed: dict[str, list[float]]) -> list[dict]:
    seeds = range(len(next(iter(per_seed.values()))))
    return [{"seed": s, "time_s": 0.5, "readouts": {k: v[s] for k, v in per_seed.items()}} for s in seeds]


def _results(methods: dict[str, dict[str, list[float]]], bands: dict[str, str] | None = None) -> dict:
    out = {"config": {"data": {"dataset": "mnist1d"}, "model": "mlp", "seeds": [0, 1, 2], "retrain_mode": "replace",
                      "resolved": {"n_retain": 475, "n_forget": 25, "n_test": 500, "n_core": 0}},
           "methods": {}}
    for m, per_seed in methods.items():
        runs = _runs(per_seed)
        out["methods"][m] = {"runs": runs, "summary": summarise(runs), "band": (bands or {}).get(m, "retrain")}
    out["checks"] = separation_checks(out)
    return out


# retrain: loss_forget mean 0.2, std 0.04 (values 0.16, 0.2, 0.24 → std = 0.04·√(2/3) with ddof 0)
RETRAIN = {"loss_forget": [0.16, 0.20, 0.24], "error_forget": [0.04, 0.08, 0.12], "mia_forget": [0.7, 0.75, 0.8]}
STD = float(np.std([0.16, 0.20, 0.24]))


def test_summary_is_mean_and_population_std_over_seeds():
    s = summarise(_runs({"loss_forget": [0.16, 0.20, 0.24], "only_some": [1.0, 2.0, 3.0]}))
    assert s["loss_forget"]["mean"] == pytest.approx(0.2)
    assert s["loss_forget"]["std"] == pytest.approx(np.sqrt(((0.04 ** 2) * 2) / 3))  # ddof = 0
    runs = _runs({"a": [1.0, 2.0]})
    del runs[1]["readouts"]["a"]
    assert "a" not in summarise(runs)  # a readout missing in one seed has no summary


@pytest.mark.parametrize("gap_in_std, separated", [(1.5, False), (2.5, True), (1.99, False), (2.01, True)])
def test_separation_needs_more_than_two_retrain_std(gap_in_std, separated):
    orig = [0.2 - gap_in_std * STD] * 3
    res = _results({"original": {**RETRAIN, "loss_forget": orig}, "retrain": RETRAIN})
    c = res["checks"]["band_separated_loss_forget"]
    assert c["separated"] is separated
    assert c["gap"] == pytest.approx(gap_in_std * STD) and c["two_std_retrain"] == pytest.approx(2 * STD)


def test_bands_and_closer_to():
    near = {"loss_forget": [0.19, 0.2, 0.21], "error_forget": [0.5, 0.5, 0.5], "mia_forget": [0.75, 0.75, 0.75]}
    far = {"loss_forget": [0.06, 0.07, 0.08], "error_forget": [0.0, 0.0, 0.0], "mia_forget": [0.99, 0.99, 0.99]}
    res = _results({"original": {"loss_forget": [0.05] * 3, "error_forget": [0.0] * 3, "mia_forget": [1.0] * 3},
                    "retrain": RETRAIN, "near": near, "far": far})
    assert inside_band(res, "near") == {"loss_forget": True, "error_forget": False, "mia_forget": True}
    assert inside_band(res, "far") == {"loss_forget": False, "error_forget": False, "mia_forget": False}
    assert res["checks"]["near_loss_forget"]["closer_to"] == "retrain"
    assert res["checks"]["near_loss_forget"]["inside_retrain_band"] is True
    assert res["checks"]["far_loss_forget"]["closer_to"] == "original"
    assert res["checks"]["far_loss_forget"]["inside_retrain_band"] is False
    assert res["checks"]["far_loss_forget"]["distance_to_original"] == pytest.approx(0.02)
    # the band edge is inclusive: mean exactly at retrain mean + std
    edge = {"loss_forget": [0.2 + STD] * 3}
    assert inside_band(_results({"retrain": RETRAIN, "edge": edge}), "edge") == {"loss_forget": True}


def test_a_method_is_judged_against_its_own_band():
    ml = {"loss_forget": [0.5, 0.5, 0.5]}
    ml_ret = {"loss_forget": [0.48, 0.5, 0.52]}
    res = _results({"original": {"loss_forget": [0.05] * 3}, "retrain": RETRAIN, "ml": ml, "ml-retrain": ml_ret},
                   bands={"ml": "ml-retrain"})
    assert res["checks"]["ml_inside_band"] == {"band": "ml-retrain", "readouts": {"loss_forget": True}}
    assert inside_band(res, "ml") == {"loss_forget": True}  # outside the DNN retrain band, inside its own
    assert "ml_loss_forget" not in res["checks"] and "ml-retrain_loss_forget" not in res["checks"]


def test_report_formats_percent_nats_and_verdicts():
    res = _results({"original": {**RETRAIN, "loss_forget": [0.05] * 3}, "retrain": RETRAIN,
                    "far": {"loss_forget": [0.06, 0.07, 0.08], "error_forget": [0.0] * 3, "mia_forget": [0.99] * 3}})
    md = render_report(res)
    assert "| **retrain** (target) | 0.50 |" in md
    assert f"{100 * 0.08:.1f} ± {100 * float(np.std([0.04, 0.08, 0.12])):.1f}" in md  # errors in %
    assert f"0.200 ± {STD:.3f}" in md  # losses in nats, three decimals
    assert "original vs retrain on `loss_forget`: |Δmean| = 0.1500, 2·std(retrain) = " \
           f"{2 * STD:.4f} → separated" in md
    assert "`far_loss_forget`: distance to original 0.0200, to retrain 0.1300 → closer to original" in md
    # the original equals retrain on error_forget and mia_forget: those readouts cannot rank methods
    assert "`far` inside the `retrain` band on 0/1 readouts that can rank methods; cannot rank methods on " \
           "error_forget, mia_forget" in md
    assert set(CORE_READOUTS) >= {"loss_forget", "error_forget", "mia_forget"}


def test_fingerprint_guard_refuses_a_checkpoint_of_other_data(tmp_path):
    runner = CliRunner()
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_TOML)
    r = runner.invoke(app, ["train", "--config", str(cfg), "--out", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    ids = tmp_path / "ids.txt"
    ids.write_text("0 1 2")
    sidecar = tmp_path / "m" / "original.safetensors.json"
    meta = json.loads(sidecar.read_text())
    meta["data_fingerprint"] = "0" * 64
    sidecar.write_text(json.dumps(meta))
    out = tmp_path / "scrubbed.safetensors"
    r = runner.invoke(app, ["forget", "--checkpoint", str(tmp_path / "m" / "original.safetensors"), "--forget-ids",
                            str(ids), "--method", "finetune", "--out", str(out)])
    assert r.exit_code == 2 and "other data" in r.output and not out.exists()


def test_fisher_noise_follows_the_seed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(20, 4), torch.randint(0, 3, (20,))
    retain, forget = (x[4:], y[4:]), (x[:4], y[:4])

    def scrub(seed):
        ctx = protocol_ctx(w0={}, num_classes=3, seed=seed)
        return torch.cat([p.detach().reshape(-1) for p in get_method("fisher")(model, retain, forget, ctx)
                          .model.parameters()])

    assert torch.equal(scrub(0), scrub(0))
    assert not torch.allclose(scrub(0), scrub(1))


def test_newton_pull_acts_only_on_parameters_in_w0():
    """Softmax regression with the pull on the weight only (the bias is absent from w0): the scrub is the
    closed-form Newton step of that objective, whose Hessian has wd on the weight block only."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(30, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (30,), generator=g)
    model = nn.Linear(4, 3).double()
    w0 = {"weight": 0.1 * torch.randn(3, 4, generator=g, dtype=torch.float64)}
    wd = 0.5
    want = dense_refs.newton_step_softmax_regression(model, x, y, wd=wd, pulled={"weight": w0["weight"]})
    ctx = protocol_ctx(w0=w0, config=TrainConfig(wd=wd), num_classes=3, seed=0)
    res = get_method("newton", safeguard="none", tol=1e-12, max_iter=200)(model, (x, y), (x[:0], y[:0]), ctx)
    got = torch.cat([res.model.weight.reshape(-1), res.model.bias]).detach()
    assert torch.allclose(got, want, atol=1e-9)
    pulled_all = dense_refs.newton_step_softmax_regression(
        model, x, y, wd=wd, pulled={"weight": w0["weight"], "bias": model.bias.detach()})
    assert not torch.allclose(got, pulled_all, atol=1e-6)  # the mask matters for this problem
