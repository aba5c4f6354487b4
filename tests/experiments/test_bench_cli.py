"""`scrubnet bench`'s refusals (one `error:` line naming the option and the value, exit 2, before any work)
and `--dataset cifar10 --dry-run` (the field's split sizes, epochs and an estimated time, no data read)."""
import pytest
from typer.testing import CliRunner

from scrubnet.cli import app
from scrubnet.experiments import bench as B
import scrubnet.cli.bench as CB

runner = CliRunner()
#: the field's CIFAR-10 training recipe as the dry run must state it
RECIPE = ("ResNet-18 (width ×1) trained from scratch; SGD lr 0.1, momentum 0.9, weight decay 0.0005 toward zero; "
          "batch 256; step schedule: lr × 0.1 after epochs 91 and 136 of 182; augmentation: random crop with "
          "4-pixel padding + horizontal flip")


@pytest.fixture
def no_work(monkeypatch):
    """Any split built, engine made or bench run fails the test: a refusal must come before them."""
    def boom(*a, **k):
        raise AssertionError("work started before the refusal")
    for mod, name in ((CB, "setting_config"), (CB, "make_engine"), (CB, "run_bench"), (CB, "prepare_output_dir"),
                      (B, "get_split")):
        monkeypatch.setattr(mod, name, boom)


BAD = [
    (["--engine", "bogus"], ["--engine", "'bogus'"]),
    (["--max-retries", "-1"], ["--max-retries", "-1"]),
    (["--data-dir", "/tmp/x"], ["--data-dir", "/tmp/x", "mnist1d"]),
    (["--dataset", "digits", "--data-dir", "/tmp/x"], ["--data-dir", "digits"]),
    (["--forget-sets", "0"], ["--forget-sets", "0"]),
    (["--seeds", "0"], ["--seeds", "0"]),
    (["--scale", "0.5"], ["--scale", "0.5", "cifar10"]),
    (["--dataset", "cifar10", "--scale", "2"], ["--scale", "2"]),
    (["--address", "h:1"], ["--address", "h:1"]),
    (["--settings", "random-5,class"], ["--settings", "random-5", "random-10"]),
    (["--methods", "nosuch"], ["--methods", "nosuch"]),
]


@pytest.mark.parametrize("args,words", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bench_refuses_bad_input_in_one_line_before_any_work(args, words, tmp_path, no_work):
    r = runner.invoke(app, ["bench", *args, "--out", str(tmp_path / "b")])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.output
    assert all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "b").exists()


def test_cifar10_dry_run_prints_the_fields_protocol_without_data(no_work):
    r = runner.invoke(app, ["bench", "--dataset", "cifar10", "--dry-run"], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    out = r.output
    for want in ("45,000 training images / 5,000 held out / 10,000 test", "random-10: |D_f| = 4,500, |D_r| = 40,500",
                 "class: |D_f| = 4,500", "182 epochs", "ResNet-18", "lr 0.1", "h on one GPU"):
        assert want in out, want
    hours = float(out.split("FLOP ≈ ")[1].split(" h")[0])
    assert 1 < hours < 100
    # the field's recipe, stated as it runs (the console may wrap the line)
    assert RECIPE in " ".join(out.split()) and "differs from the field's recipe: nothing" in out
    # a CPU-sized version: sizes and epochs scale, and the estimate with them
    r = runner.invoke(app, ["bench", "--dataset", "cifar10", "--scale", "0.02", "--dry-run"], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    assert "900 training images" in r.output and "4 epochs" in r.output
    assert float(r.output.split("FLOP ≈ ")[1].split(" h")[0]) < hours / 100
