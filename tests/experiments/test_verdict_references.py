"""Reference models on the paths users take: ``scrubnet.forget(references=, forget_ids=)`` (objects or the
directory they were saved to) and ``run_experiment(references=)`` / ``scrubnet run --references``."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scrubnet
from scrubnet.experiments.runner import run_experiment
from scrubnet.readouts.references import load_references, train_references
from tests.conftest import tiny_config

D, C = 20, 3


def _data(seed: int, n: int):
    mu = torch.randn(C, D, generator=torch.Generator().manual_seed(1000)) * 0.6
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, C, (n,), generator=g)
    x = mu[y] + torch.randn(n, D, generator=g)
    flip = torch.rand(n, generator=g) < 0.3
    return x, torch.where(flip, torch.randint(0, C, (n,), generator=g), y)


def _fit(x, y, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(D, 64), nn.ReLU(), nn.Linear(64, C))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(200):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return net.eval()


@pytest.fixture(scope="module")
def world():
    torch.set_num_threads(1)
    x, y = _data(0, 200)
    refs = train_references(lambda idx, s: _fit(x[idx], y[idx], s), 200, pairs=2, seed=1)
    return dict(x=x, y=y, model=_fit(x, y, 0), refs=refs, held=_data(100, 400))


def test_forget_takes_reference_models_or_their_directory(world, tmp_path):
    w = world
    args = (w["model"], (w["x"][10:], w["y"][10:]), (w["x"][:10], w["y"][:10]))
    _, raw = scrubnet.forget(*args, method="original", num_classes=C, test=w["held"])
    _, cal = scrubnet.forget(*args, method="original", num_classes=C, test=w["held"], references=w["refs"],
                             forget_ids=range(10))
    assert raw.forgetting.statistic in ("loss", "margin") and cal.forgetting.statistic == "calibrated"
    assert cal.forgetting.references == {"models": 4, "seconds": pytest.approx(w["refs"].seconds)}
    w["refs"].save(tmp_path / "refs", {"note": "test"})
    loaded = load_references(tmp_path / "refs", w["model"])
    assert loaded.meta["note"] == "test" and np.array_equal(loaded.members, w["refs"].members)
    _, again = scrubnet.forget(*args, method="original", num_classes=C, test=w["held"],
                               references=tmp_path / "refs", forget_ids=np.arange(10))
    assert again.forgetting.gap_before == pytest.approx(cal.forgetting.gap_before, abs=1e-9)
    with pytest.raises(ValueError, match="forget_ids"):
        scrubnet.forget(*args, method="original", num_classes=C, test=w["held"], references=w["refs"])
    with pytest.raises(ValueError, match="one position per forget example"):
        scrubnet.forget(*args, method="original", num_classes=C, test=w["held"], references=w["refs"],
                        forget_ids=range(9))


def test_run_trains_references_per_seed_and_calibrates_every_verdict():
    res = run_experiment(tiny_config(methods=["original"]), None, progress=False, references=1)
    assert res["protocol"]["0"]["references_s"] > 0
    for d in res["methods"].values():
        v = d["runs"][0]["forgetting"]
        assert v["statistic"] == "calibrated" and v["references"]["models"] == 2, v


def test_run_warnings_are_grouped_one_short_line_per_kind_in_the_terminal():
    from scrubnet.experiments.report import group_warnings, report_warnings
    long = "the forgetting verdict could not judge this scrub: inconclusive (" + "x" * 300 + ")"
    results = {"config": {"resolved": {}}, "methods": {
        m: {"runs": [{"seed": s, "readouts": {}, "warnings": [long]} for s in (0, 1, 2)]}
        for m in ("finetune", "neggrad")}}
    results["methods"]["newton"] = {"runs": [{"seed": 0, "readouts": {}, "warnings": ["the Newton step was damped"]}]}
    full = report_warnings(results)
    assert len(full) == 7 and all(long in w for w in full[:6])  # report.md keeps each in full
    lines = group_warnings(full, width=120)
    assert lines[0].startswith("the forgetting verdict could not judge this scrub: 6 runs")
    assert "`finetune` (0, 1, 2)" in lines[0] and "`neggrad` (0, 1, 2)" in lines[0]
    assert lines[1] == "the Newton step was damped: 1 run — `newton` (0)"
    assert len(lines) == 2 and all(len(w) <= 120 and "\n" not in w for w in lines)
