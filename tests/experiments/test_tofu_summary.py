"""The synthetic-TOFU summary: the issue's one-line result, the best approximate method under the utility floor,
the exact engine's pass count, and the markdown table, from a hand-written result."""
from __future__ import annotations

import numpy as np

from scrubnet.experiments.tofu import summarise, summary_line
from scrubnet.experiments.tofu_report import render_tofu


def _model(fq, u, **extra):
    m = {"forget_quality": fq, "forget_quality_paraphrase": fq, "model_utility": u, "forget/rouge": 0.5,
         "forget/recall": 0.1, "extraction_strength": 0.2, "exact_memorisation": 0.8,
         "probe/paraphrase/recall": 0.0, "probe/format/recall": 0.1, "probe/paraphrase/fq": 1.0,
         "probe/format/fq": 0.9, "probe/paraphrase/within": True, "probe/format/within": fq > 0.01}
    m.update(extra)
    return m


def _result():
    seeds = []
    for s, (fq_exact, r) in enumerate([(0.4, 0.5), (0.03, 0.5), (0.9, 0.5)]):
        seeds.append({"seed": s, "models": {
            "original": _model(1e-9, 0.40), "retain": _model(1.0, 0.41), "retain-seed2": _model(0.6, 0.42),
            "exact": _model(fq_exact, 0.39, request_vs_refinetune=r, engine="sharded"),
            "npo": _model(0.9, 0.10, lr=0.01),          # forgets, but wrecks utility: below the floor
            "simnpo": _model(0.2, 0.38, lr=0.001)}})
    res = {"config": {"methods": ["npo", "simnpo"], "split": "forget10", "n_private": 20, "size": "ci",
                      "seeds": [0, 1, 2], "exact": "sharded"},
           "seeds": seeds, "tuning": {"npo": {"lr": 0.01, "budget": 4}, "simnpo": {"lr": 0.001, "budget": 4}},
           "forget_people": [3, 7], "n_forget_questions": 40,
           "ulira": {"original": 0.9, "exact": 0.5, "npo": 0.6, "simnpo": 0.7}}
    res["summary"] = summarise(res)
    return res


def test_summary_and_line():
    res = _result()
    s = res["summary"]
    assert s["exact_passes"] == 2 and s["n_seeds"] == 3          # 0.03 < 0.05 fails
    assert s["best_approximate"] == "simnpo"                     # npo's utility 0.10 < 0.9 × 0.40
    assert s["retain_vs_retain_fq"] == 0.6 and s["request_vs_refinetune"] == 0.5
    assert np.isclose(s["mean"]["exact"]["forget_quality"], (0.4 + 0.03 + 0.9) / 3)
    assert s["mean"]["exact"]["probes_within"] == 6 and s["probes_total"] == 6
    assert summary_line(res) == ("tofu: exact FQ 0.443 (KS p >= 0.05 in 2/3 seeds), utility 0.390 vs ordinary "
                                 "LoRA 0.400; best approximate simnpo FQ 0.2, utility 0.380 (4 trials); "
                                 "retain-vs-retain FQ 0.6; request_vs_refinetune 0.50")


def test_table_has_every_model_and_the_line():
    md = render_tofu(_result())
    for name in ("original", "retain", "retain-seed2", "exact (sharded)", "npo", "simnpo"):
        assert f"| {name}" in md
    assert "| npo | 0.900 | 0.900 |" in md and "0.01 (4)" in md
    assert "tofu: exact FQ 0.443" in md
