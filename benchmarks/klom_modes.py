"""How far KLoM's default is from data-unlearning-bench's code, one documented choice at a time.

A constructed pool shaped like the audit's ε pool (U = R = 32 models per side, margins of a few nats):
per example, the oracle's margins ~ N(μ_j, σ_j²), and the unlearned ensemble is one of four regimes —
the same law (retraining), a shifted and rescaled law (an approximate scrub), a point mass (a deterministic
method from one original) and margins beyond the ±100 clip. For each choice of ``KLOM_MODES`` it switches that
choice alone from the default to the reference and reports the per-example max |Δ| (nats), how many examples
move by more than 1e-9 and how many become NaN; then all three together (= ``mode="reference"``).

Run: ``python benchmarks/klom_modes.py [--examples N] [--seed S]`` (one JSON object on stdout).
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from scrubnet.audit.stats import KLOM_MODES, klom


def constructed_pool(n: int = 2000, models: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(unlearned ``[models, n]``, oracle ``[models, n]``, regime ``[n]`` names) of the pool described above."""
    rng = np.random.default_rng(seed)
    mu, sd = rng.normal(4, 3, n), rng.uniform(0.3, 2.0, n)
    oracle = mu + sd * rng.normal(size=(models, n))
    regime = rng.choice(np.array(["same_law", "shifted", "point_mass", "clipped"]), n, p=[0.4, 0.3, 0.2, 0.1])
    shift, scale = rng.normal(0, 2, n), rng.uniform(0.3, 1.5, n)
    unl = np.where(regime == "same_law", mu + sd * rng.normal(size=(models, n)),
                   mu + shift + scale * sd * rng.normal(size=(models, n)))
    unl = np.where(regime == "point_mass", (mu + shift)[None, :], unl)
    big = regime == "clipped"
    unl[:, big] += 100.0
    oracle[:, big] += 100.0
    return unl, oracle, regime


def measure(unl: np.ndarray, oracle: np.ndarray, regime: np.ndarray) -> dict:
    base = klom(unl, oracle)
    out: dict = {"examples": int(base.size), "regimes": {k: int(v) for k, v in zip(*np.unique(regime,
                                                                                                return_counts=True))}}
    variants = {k: {k: v} for k, v in KLOM_MODES["reference"].items()}
    variants["all (reference mode)"] = dict(KLOM_MODES["reference"])
    for name, ch in variants.items():
        v = klom(unl, oracle, choices=ch)
        ok = np.isfinite(v)
        d = np.abs(v - base)[ok]
        row = {"max_abs_delta": float(d.max()) if d.size else None, "moved": int((d > 1e-9).sum()),
               "nan": int((~ok).sum()), "nan_default_values": sorted({round(float(x), 3) for x in base[~ok]})}
        row["max_by_regime"] = {r: float(np.abs(v - base)[ok & (regime == r)].max(initial=0.0))
                                for r in np.unique(regime)}
        out[name] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fixtures", default="tests/fixtures/audit-references/klom.npz",
                    help="also measure on the stored reference cases ('' to skip)")
    a = ap.parse_args()
    out = {"constructed": measure(*constructed_pool(a.examples, seed=a.seed))}
    if a.fixtures:
        z = np.load(a.fixtures)
        cases = [str(c) for c in z["cases"]]
        unl = np.concatenate([z[f"{c}/unlearned"][:8] for c in cases], 1)  # 8 models: every case has ≥ 8
        orc = np.concatenate([z[f"{c}/oracle"][:8] for c in cases], 1)
        reg = np.concatenate([[c] * z[f"{c}/unlearned"].shape[1] for c in cases])
        out["fixtures_first_8_models"] = measure(unl, orc, reg)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
