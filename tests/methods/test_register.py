"""Adding a method touches one module: a method defined in this file, registered, is seen by the cost model
(`scrubnet.estimate`), the experiment runner, the audit's method list and the CLI, and goes through the same
scrub path and failure rules everywhere."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

import scrubnet
from scrubnet.audit.run import Audit, default_plan
from scrubnet.cli import app
from scrubnet.experiments.runner import get_split, resolve_methods, run_experiment
from scrubnet.methods import base
from scrubnet.methods.base import ForgettingMethod, Option, ScrubResult, available_methods, get_method, register
from scrubnet.training.cost import CostEstimate
from tests.conftest import tiny_config
from tests.cli.test_cli import runner, train_tiny_checkpoint

NAME = "shrink-test"


class Shrink(ForgettingMethod):
    """Multiply every trainable weight by ``factor`` (no data pass: a test of the seam, not of forgetting)."""

    needs_retain = False
    options = {"factor": Option(float, "(0, 1]", default=0.9)}

    def __init__(self, factor: float = 0.9):
        self.factor = factor

    def scrub(self, model, retain, forget, ctx) -> ScrubResult:
        out = copy.deepcopy(model)
        with torch.no_grad():
            for p in out.parameters():
                p.mul_(self.factor)
        return ScrubResult(out.eval(), {"shrink_factor": self.factor})

    @classmethod
    def cost(cls, model, x1, n_retain, n_forget, num_classes, config, *, factor: float = 0.9) -> CostEstimate:
        p = sum(q.numel() for q in model.parameters())
        return CostEstimate(NAME, float(p), 1e-9 * p, 4 * p, 0.0)


@pytest.fixture
def shrink():
    register(NAME)(Shrink)
    yield NAME
    base._REGISTRY.pop(NAME)


def test_registered_method_is_built_with_its_options_checked(shrink):
    assert shrink in available_methods() and shrink in base.costed_methods()
    assert get_method(shrink, factor=1).factor == 1.0  # an int is accepted for a float option
    with pytest.raises(ValueError, match=r"method 'shrink-test': option factor: expected a finite number in \(0, 1\]"):
        get_method(shrink, factor=2.0)
    with pytest.raises(ValueError, match="unknown option.*frobnicate; allowed: factor"):
        get_method(shrink, frobnicate=1)
    # the built-ins declare their rules the same way
    with pytest.raises(ValueError, match="option max_iter"):
        get_method("newton", max_iter=0)
    with pytest.raises(ValueError, match="unknown option.*wd"):
        get_method("newton", wd=0.1)  # the decay is the recipe's, never a method option


def test_estimate_dispatches_to_the_class(shrink):
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    est = scrubnet.estimate(model, 10, 2, method=shrink, in_shape=(6,))
    assert est.method == shrink and est.flops == 6 * 4 + 4 + 4 * 3 + 3 and est.peak_bytes == 4 * 43
    with pytest.raises(ValueError, match="option factor"):
        scrubnet.estimate(model, 10, 2, method=shrink, in_shape=(6,), factor=0.0)


def test_runner_and_audit_see_the_method(shrink, tmp_path):
    cfg = tiny_config(methods=["original", "retrain", shrink])
    split = get_split(cfg)
    assert shrink in resolve_methods(tiny_config(), split)  # a default run picks it up by its traits
    cfg.method_options = {shrink: {"factor": 1.0}}
    res = run_experiment(cfg, progress=False)
    runs = res["methods"][shrink]["runs"]
    assert len(runs) == 1 and runs[0]["readouts"]["shrink_factor"] == 1.0 and "failed" not in runs[0]
    # factor 1 leaves the original: every readout of the model itself equals the original's
    orig = res["methods"]["original"]["runs"][0]["readouts"]
    for k in ("error_retain", "error_forget", "loss_forget", "loss_test", "mia_forget", "activation_l1_forget"):
        assert runs[0]["readouts"][k] == orig[k]
    assert res["methods"][shrink]["band"] == "retrain"
    # the audit: the method's scrubs are planned on every split and forget set, the anchors are not scrubs
    plan = default_plan(["original", shrink], pool=4, eps_models=3)
    assert plan.pairs[shrink] == 2 and plan.eps_models[shrink] == 3
    audit = Audit(cfg, ["original", shrink], plan, tmp_path / "cache")
    ids = {r["id"] for g in audit.scrub_runs() for r in g["runs"]}
    assert {f"scrub/{shrink}/{s}/{f}" for s in range(4) for f in range(2)} <= ids
    assert {f"eps/{shrink}/{u}" for u in range(3)} <= ids and not any(i.startswith("scrub/original") for i in ids)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return train_tiny_checkpoint(tmp_path_factory.mktemp("ckpt")) / "model" / "original.safetensors"


def test_cli_runs_the_method_and_applies_the_retain_error_rule(shrink, checkpoint, tmp_path):
    ids = tmp_path / "ids.txt"
    ids.write_text("0 3 5")
    args = ["forget", "--checkpoint", str(checkpoint), "--forget-ids", str(ids), "--method", shrink]
    r = runner.invoke(app, args + ["--dry-run", "--json", str(tmp_path / "dry.json")])  # no --out needed
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "dry.json").read_text())["method"] == shrink  # the class's own cost estimate
    out = tmp_path / "half.safetensors"
    r = runner.invoke(app, args + ["--out", str(out), "--option", "factor=0.5"])
    assert r.exit_code == 0, r.output
    before, after = load_file(str(checkpoint)), load_file(str(out))
    assert all(torch.equal(after[k], 0.5 * before[k]) for k in before if before[k].is_floating_point())
    # a scrub that wipes the weights costs the retain set far more than 5 points of error: the checkpoint
    # path fails it like scrubnet.forget does (exit 2, nothing written)
    bad = tmp_path / "bad.safetensors"
    r = runner.invoke(app, args + ["--out", str(bad), "--option", "factor=1e-6"])
    assert r.exit_code == 2 and "error:" in r.output and "retain error rose" in r.output, r.output
    assert not bad.exists()
    r = runner.invoke(app, args + ["--out", str(bad), "--option", "factor=2"])
    assert r.exit_code == 2 and "option factor" in r.output and not bad.exists()
