"""The guide's bench results are the committed docs/guides/bench.json (rendered by scripts/bench_guide.py), and
one unit of that file reproduces: its jobs re-run on the same configuration give the recorded metrics."""
import importlib.util
import json
from pathlib import Path

import pytest

from scrubnet.experiments import bench as B
from scrubnet.experiments.config import ExperimentConfig

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "guides" / "bench.json"
#: the methods re-run on one unit: fast ones, of every kind (no-op anchor, a one-shot edit, SGD, Adam, relabelling)
REPRODUCE = ("original", "ssd", "ga", "neggrad-plus", "salun", "boundary-shrink", "unsir")
#: metrics are fractions of at most 500 samples; the same code on another CPU may round differently
TOLERANCE = 0.02


def _script():
    spec = importlib.util.spec_from_file_location("bench_guide", ROOT / "scripts" / "bench_guide.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_guides_results_section_is_rendered_from_the_committed_bench_json():
    mod = _script()
    results = json.loads(RESULTS.read_text())
    section = mod.render(results)
    guide = (ROOT / "docs" / "guides" / "bench.md").read_text()
    inside = guide.split(mod.BEGIN, 1)[1].split(mod.END, 1)[0]
    assert inside.strip("\n") == "\n".join(section).strip("\n")
    assert mod.main(["--check"]) == 0
    # every setting's table carries intervals and tie groups, and the file has them for every row
    for s, summ in results["summary"].items():
        assert summ["ties"] and summ["best"] == summ["ties"][0][0]
        for r in summ["rows"]:
            assert r["avg_gap"]["n"] == len(summ["units"]) and r["avg_gap"]["half"] is not None
            assert r["family"] == "anchor" or r["tie_group"] >= 1
    assert any("±" in ln and "[" in ln for ln in section)


def test_one_unit_of_the_committed_bench_reproduces(monkeypatch):
    monkeypatch.delenv("SCRUBNET_TINY", raising=False)
    results = json.loads(RESULTS.read_text())
    cfg = ExperimentConfig.from_dict(results["config"])
    runs = [r for r in results["runs"] if r["setting"] == "class" and r["forget_set"] == 0
            and r["seed"] == results["seeds"][0] and r["method"] in REPRODUCE]
    assert {r["method"] for r in runs} == set(REPRODUCE)
    scfg = B.setting_config(cfg, "class", "test", 0)
    for r in runs:
        job = {k: r[k] for k in ("setting", "role", "forget_set", "seed", "method", "options")}
        again = B.run_job(scfg, job)
        assert again["ok"] == r["ok"], r["method"]
        for k in ("ua", "ra", "ta", "mia_efficacy", "avg_gap"):
            assert again["metrics"][k] == pytest.approx(r["metrics"][k], abs=TOLERANCE), (r["method"], k)
