"""``scrubnet bench --dataset tofu-synthetic``: the dry run's plan and the refusals (one ``error:`` line, exit 2,
before any work)."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from scrubnet.cli import app

pytest.importorskip("faker")
pytest.importorskip("transformers")
runner = CliRunner()


def _bench(*args):
    return runner.invoke(app, ["bench", "--dataset", "tofu-synthetic", *args])


def test_dry_run_prints_the_plan_and_trains_nothing(tmp_path):
    r = _bench("--dry-run")
    assert r.exit_code == 0, r.output
    assert "20 private + 12 public people, 400 fine-tuning pairs" in r.output
    assert "forget10: 2 people, 40 questions" in r.output
    assert "16 trials (4 learning rates per method" in r.output
    assert "sharded engine (2 shards × 2 slices)" in r.output
    q = _bench("--dry-run", "--quick", "--methods", "npo", "--exact", "retrain")
    assert q.exit_code == 0 and "2 trials" in q.output and "exact re-fine-tune" in q.output


@pytest.mark.parametrize("args, needle", [
    (["--scale", "0.5", "--dry-run"], "--scale 0.5: not used by --dataset tofu-synthetic"),
    (["--settings", "class", "--dry-run"], "--settings 'class': not used"),
    (["--exact", "approx", "--dry-run"], "--exact 'approx': choose retrain or sharded"),
    (["--methods", "npo,dpo", "--dry-run"], "dpo"),
    (["--seeds", "0", "--dry-run"], "--seeds 0: must be ≥ 1"),
    (["--engine", "spark", "--dry-run"], "--engine 'spark'"),
    ([], "--out: missing"),
])
def test_bad_input_is_one_error_line(args, needle, tmp_path):
    r = _bench(*args)
    assert r.exit_code == 2, r.output
    errs = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(errs) == 1 and needle in errs[0], r.output


def test_exact_is_refused_for_other_datasets():
    r = runner.invoke(app, ["bench", "--dataset", "digits", "--exact", "sharded", "--dry-run"])
    assert r.exit_code == 2 and "--exact 'sharded': only for --dataset tofu-synthetic" in r.output


def test_a_non_empty_out_is_refused_before_any_work(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    r = _bench("--out", str(tmp_path), "--quick")
    assert r.exit_code == 2 and "error:" in r.output and (tmp_path / "keep.txt").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
