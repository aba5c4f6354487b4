"""The default experiment reproduces: seed 0 of ``scrubnet run`` (a reduced method list, to stay within the
test budget) gives the readouts stored in ``tests/fixtures/default_seed0.json``.

Machine dependence (measured, docs/decisions/conventions.md "Numbers that reproduce"): fine-tuning amplifies rounding, so
the readouts depend on the BLAS kernels. On one machine the same command gives the same bits; switching MKL's
code path on the same machine (``MKL_CBWR=COMPATIBLE`` instead of the CPU's own AVX2 kernels) moves seed 0's
Fisher error on D_f from 4 % to 12 % and its loss on D_f from 0.228 to 0.385 nats. So the test runs the
experiment in a child process pinned to MKL's conditional-numerical-reproducibility path
(``MKL_CBWR=COMPATIBLE``, one MKL/OpenMP/torch thread), which gives the same bits on every x86-64 CPU MKL
supports, and the fixture was written that way. The tolerance covers float noise only: relative 2e-3
(absolute 1e-6) on continuous readouts, one sample of D_f / D_r / D_test on the count-based errors and the
attack, one epoch on ``relearn_epochs``. A torch build without MKL (e.g. ARM) takes other kernels: skipped.

Regenerate the fixture (only when a change of the numbers is intended, and say so in the commit):
``python tests/test_reproduce.py --write``.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scrubnet.experiments.config import ExperimentConfig
from scrubnet.experiments.runner import run_experiment
from tests.hang_guard import HANG_GUARD_S

FIXTURE = Path(__file__).parents[1] / "fixtures" / "default_seed0.json"
METHODS = ["original", "retrain", "finetune", "neggrad", "fisher"]
#: readouts compared (the rest are timings and solver diagnostics)
READOUTS = ("error_retain", "error_forget", "error_test", "loss_retain", "loss_forget", "loss_test", "mia_forget",
            "relearn_epochs", "activation_l1_retain", "activation_l1_forget", "activation_l1_test",
            "weight_distance_ratio", "weight_step_cosine", "weight_step_ratio", "info_weights_nats",
            "info_activations_nats_forget")
REL_TOL, ABS_TOL = 2e-3, 1e-6


def readouts_seed0() -> dict:
    cfg = ExperimentConfig.from_dict({"seeds": [0], "methods": METHODS})
    res = run_experiment(cfg, None, progress=False)
    sizes = res["config"]["resolved"]
    out = {"sizes": {"n_retain": sizes["n_retain"], "n_forget": sizes["n_forget"], "n_test": sizes["n_test"]},
           "methods": {}}
    for m, d in res["methods"].items():
        r = d["runs"][0]["readouts"]
        out["methods"][m] = {k: r[k] for k in READOUTS if k in r}
    return out


def allowed(readout: str, sizes: dict) -> float:
    """The absolute difference a readout may show across machines (module docstring)."""
    step = {"error_forget": 1 / sizes["n_forget"], "mia_forget": 1 / sizes["n_forget"],
            "error_retain": 1 / sizes["n_retain"], "error_test": 1 / sizes["n_test"], "relearn_epochs": 1.0}
    return step.get(readout, 0.0)


def differences(got: dict, want: dict) -> list[str]:
    bad = []
    for m, rs in want["methods"].items():
        for k, v in rs.items():
            g = got["methods"].get(m, {}).get(k)
            if g is None:
                bad.append(f"{m}.{k}: missing")
            elif isinstance(v, float) and math.isinf(v):
                if g != v:
                    bad.append(f"{m}.{k}: {g} vs {v}")
            elif abs(g - v) > max(allowed(k, want["sizes"]) + 1e-12, ABS_TOL + REL_TOL * abs(v)):
                bad.append(f"{m}.{k}: {g!r} vs stored {v!r}")
    return bad


def test_difference_rule_catches_a_changed_readout():
    want = {"sizes": {"n_retain": 475, "n_forget": 25, "n_test": 500},
            "methods": {"m": {"loss_forget": 0.2, "error_forget": 0.04, "relearn_epochs": 10.0}}}
    same = {"methods": {"m": {"loss_forget": 0.2002, "error_forget": 0.08, "relearn_epochs": 11.0}}}
    assert differences(same, want) == []
    off = {"methods": {"m": {"loss_forget": 0.201, "error_forget": 0.12, "relearn_epochs": 12.0}}}
    assert len(differences(off, want)) == 3


PINNED_ENV = {"MKL_CBWR": "COMPATIBLE", "MKL_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def readouts_in_pinned_child() -> dict:
    """:func:`readouts_seed0` in a child process whose MKL is pinned to its compatible code path (the
    variable is read when MKL loads, so it cannot be set in this process)."""
    env = {**os.environ, **PINNED_ENV, "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
           "PYTHONWARNINGS": "ignore"}
    env.pop("SCRUBNET_TINY", None)
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--print"], env=env, capture_output=True,
                       text=True, timeout=HANG_GUARD_S)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="the fixture was made with MKL's kernels")
def test_default_experiment_seed0_matches_the_stored_results():
    want = json.loads(FIXTURE.read_text())
    got = readouts_in_pinned_child()
    assert got["sizes"] == want["sizes"]
    assert set(got["methods"]) == set(want["methods"])
    bad = differences(got, want)
    assert not bad, "the default experiment no longer reproduces tests/fixtures/default_seed0.json:\n" + "\n".join(bad)


if __name__ == "__main__":
    if sys.argv[1:] not in (["--write"], ["--print"]):
        sys.exit("usage: python tests/test_reproduce.py --write   (rewrites the fixture)")
    if os.environ.get("MKL_CBWR") != PINNED_ENV["MKL_CBWR"]:  # re-run pinned (MKL reads it at load time)
        sys.exit(subprocess.call([sys.executable, *sys.argv], env={**os.environ, **PINNED_ENV}))
    torch.set_num_threads(1)
    got = readouts_seed0()
    if sys.argv[1] == "--print":
        print(json.dumps(got))
    else:
        got["environment"] = {**PINNED_ENV, "torch_threads": 1}
        FIXTURE.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"wrote {FIXTURE}")
