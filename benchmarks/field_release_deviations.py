"""The measured effect of each deviation from the field methods' releases, on the embedded bench's settings.

For every method whose default is the release, runs the release's default and each named deviation (scrubnet's
former reading) on the same units of the bench (``scrubnet bench``'s splits of its default experiment: MNIST-1D,
MLP), and prints UA / RA / TA / MIA-efficacy / Avg. Gap (percent, against each unit's retrain) side by side, the
mean over the units and each unit's Avg. Gap. The figures of docs/decisions/field-methods.md ("Deviations from
the releases") come from

    python benchmarks/field_release_deviations.py --settings class,random-10 --units 2
    python benchmarks/field_release_deviations.py --settings class,random-10 --units 2 --tuned

(units: forget set 0 with seeds 0, 1, …; about 6 minutes each on a loaded 2-core machine). ``--tuned`` runs every
variant at the knob value the committed bench chose for that method and setting (docs/guides/bench.json), where
the released defaults (tuned for CIFAR-10) do too little to show a difference.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scrubnet.experiments import bench as B  # noqa: E402
from scrubnet.experiments.config import ExperimentConfig  # noqa: E402

#: per method: (label, options) — the release's default first, then each deviation
VARIANTS = {
    "ssd": [("release: unshuffled, class-sorted D_r, batch 64/128", {}),
            ("shuffled D, recipe batch 128 (former)", {"order": "shuffled", "batch_size": 128})],
    "unsir": [("release: 240 noise rows in 500/class", {}),
              ("scaled noise share, all of D_r (former)", {"impair_set": "scaled"})],
    "neggrad-plus": [("release: proximal wd 0.1, batches 128/64 cycled, eval", {}),
                     ("no proximal term", {"init_decay": 0.0}),
                     ("former (no proximal, batch 128 both, reshuffled, train)",
                      {"init_decay": 0.0, "batch_size": 128, "forget_batch": None, "forget_order": "reshuffle",
                       "mode": "train"})],
    "salun": [("release 2026: unmasked weights put back, batch 256", {}),
              ("2024 release: decay on every weight", {"masked_decay": False}),
              ("batch 128", {"batch_size": 128})],
    "bad-teacher": [("release: batch 256, KL mean over B·c", {}),
                    ("scaled batch (≈ 66 steps), KL per sample (former)", {"scale_batch": True, "kl": "batchmean"})],
    "ga": [("release: batch 256", {}), ("batch 128 (former)", {"batch_size": 128})],
    "l1-sparse": [("release: batch 256", {}), ("batch 128 (former)", {"batch_size": 128})],
    "boundary-shrink": [("release: batch 256", {}), ("batch 128 (former)", {"batch_size": 128})],
}
KEYS = ("ua", "ra", "ta", "mia_efficacy", "avg_gap")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", default="class,random-10")
    ap.add_argument("--units", type=int, default=2, help="seeds 0 … units−1 on forget set 0")
    ap.add_argument("--methods", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None, help="also write the per-unit results here")
    ap.add_argument("--tuned", action="store_true", help="at the committed bench's tuned knob values")
    a = ap.parse_args(argv)
    tuning = json.loads((ROOT / "docs" / "guides" / "bench.json").read_text())["tuning"] if a.tuned else {}
    cfg = ExperimentConfig()
    out = []
    for setting in a.settings.split(","):
        scfg = B.setting_config(cfg, setting, "test", 0)
        for seed in range(a.units):
            for m in a.methods.split(","):
                if not B.applies(m, setting):
                    continue
                t = tuning.get(setting, {}).get(m)
                knob = {t["option"]: t["chosen"]} if t else {}
                for label, opts in VARIANTS[m]:
                    job = {"setting": setting, "role": "eval", "forget_set": 0, "seed": seed, "method": m,
                           "options": {**knob, **opts}}
                    r = B.run_job(scfg, job)
                    out.append({"setting": setting, "seed": seed, "method": m, "variant": label, "ok": r["ok"],
                                **{k: r["metrics"][k] for k in KEYS}})
                    print(f"{setting} seed {seed} {m} [{label}]: gap {100 * r['metrics']['avg_gap']:.1f}",
                          file=sys.stderr, flush=True)
    if tuning:
        print("At the tuned values: " + "; ".join(f"{s} {m} {t['option']} {t['chosen']:g}"
                                                   for s in a.settings.split(",") for m, t in tuning[s].items()
                                                   if m in a.methods.split(",")))
    print("| setting | method | variant | UA % | RA % | TA % | MIA-eff. % | Avg. Gap % (per unit) |")
    print("|---|---|---|---|---|---|---|---|")
    for setting in a.settings.split(","):
        for m in a.methods.split(","):
            for label, _ in VARIANTS[m]:
                rs = [r for r in out if r["setting"] == setting and r["method"] == m and r["variant"] == label]
                if not rs:
                    continue
                mean = {k: 100 * sum(r[k] for r in rs) / len(rs) for k in KEYS}
                per = ", ".join(f"{100 * r['avg_gap']:.1f}" for r in rs)
                fails = sum(not r["ok"] for r in rs)
                print(f"| {setting} | {m} | {label} | {mean['ua']:.1f} | {mean['ra']:.1f} | {mean['ta']:.1f} | "
                      f"{mean['mia_efficacy']:.1f} | {mean['avg_gap']:.1f} ({per})"
                      + (f", {fails} failed" if fails else "") + " |")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
