"""What a person reads in report tables: no ``± 0`` from a single seed, a unit on every reference row."""
from __future__ import annotations

import numpy as np

from scrubnet.experiments.report import _fmt, format_readout, readout_unit
from scrubnet.experiments.runner import summarise


def test_one_seed_shows_the_value_alone_and_several_seeds_their_spread():
    one = summarise([{"readouts": {"error_test": 0.25, "loss_forget": 0.5}}])
    assert one["error_test"]["n"] == 1
    assert _fmt("error_test", one["error_test"]) == "25.0 (1 seed)" and "±" not in _fmt("loss_forget", one["loss_forget"])
    three = summarise([{"readouts": {"error_test": v}} for v in (0.1, 0.2, 0.3)])
    assert _fmt("error_test", three["error_test"]) == f"20.0 ± {100 * np.std([0.1, 0.2, 0.3]):.1f}"


def test_reference_rows_carry_the_unit_of_their_readout():
    assert readout_unit("reference_error_retain") == readout_unit("error_retain") == "%"
    assert readout_unit("reference_loss_test") == "nats" and readout_unit("error_train") == "%"
    assert format_readout("reference_error_test", 0.125) == "12.5"
