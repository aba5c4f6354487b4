"""Error hygiene of every `scrubnet` command: a user error is one `error:` line and exit 2, an unexpected
exception (here a crash inside the user's model during the scrub) one `error: <Type>: …` line, a hint and
exit 1, and no command prints a traceback unless SCRUBNET_DEBUG=1."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import scrubnet.checkpoint
from scrubnet.cli import app
from scrubnet.models.user import build_user_model
from tests.hang_guard import HANG_GUARD_S

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]

# a forward that works without gradients (the input check on two samples) and crashes as soon as the
# scrub differentiates through it: an exception from inside the computation, not a bad input
NET_PY = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, crash=False):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.crash = crash

    def forward(self, x):
        if self.crash and torch.is_grad_enabled():
            raise RuntimeError("kaboom inside the forward")
        return self.lin(x)


def make_net(crash=False):
    return Net(crash)
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("errors")
    (d / "net.py").write_text(NET_PY)
    g = np.random.default_rng(0)
    x = g.normal(size=(30, 4)).astype(np.float32)
    np.savez(d / "data.npz", x_train=x, y_train=(np.arange(30) % 3).astype(np.int64))
    torch.manual_seed(0)
    net = build_user_model(f"{d / 'net.py'}:make_net")
    torch.save(net.state_dict(), d / "net.pt")
    (d / "forget.txt").write_text("0 1 2\n")
    (d / "bad.npz").write_bytes(b"this is not an npz archive")
    return d


def _forget_args(d: Path, out: Path, data: str = "data.npz", crash: bool = False) -> list[str]:
    return ["forget", "--model", f"{d / 'net.py'}:make_net", "--weights", str(d / "net.pt"), "--data", str(d / data),
            "--forget-ids", str(d / "forget.txt"), "--method", "finetune", "--out", str(out)] \
        + (["--model-option", "crash=true"] if crash else [])


def _error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("error:")]


def _one_user_error(r, needle: str) -> None:
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and isinstance(r.exception, SystemExit)
    lines = _error_lines(r.stderr)
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_crash_inside_the_users_forward_is_one_line_naming_it(files, tmp_path):
    out = tmp_path / "x.safetensors"
    r = runner.invoke(app, _forget_args(files, out, crash=True))
    assert r.exit_code == 1, r.output
    assert isinstance(r.exception, SystemExit) and "Traceback" not in r.output
    lines = _error_lines(r.stderr)
    assert lines == ["error: RuntimeError: kaboom inside the forward"], r.stderr
    assert "SCRUBNET_DEBUG=1" in r.stderr and len(r.stderr.strip().splitlines()) == 2
    assert not out.exists()
    # the same model without the crash scrubs: the failure above is the forward's, not the inputs'
    r = runner.invoke(app, _forget_args(files, out))
    assert r.exit_code == 0 and out.exists(), r.output


def test_the_console_script_prints_no_traceback_unless_asked(files, tmp_path):
    args = [sys.executable, "-m", "scrubnet.cli", *_forget_args(files, tmp_path / "x.safetensors", crash=True)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("SCRUBNET_DEBUG", None)
    p = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=HANG_GUARD_S)
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr and _error_lines(p.stderr) == ["error: RuntimeError: kaboom inside the forward"]
    p = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env={**env, "SCRUBNET_DEBUG": "1"}, timeout=HANG_GUARD_S)
    assert p.returncode != 0 and "Traceback" in p.stderr and "kaboom inside the forward" in p.stderr


def test_a_bad_data_file_is_one_error_line(files, tmp_path):
    out = tmp_path / "x.safetensors"
    _one_user_error(runner.invoke(app, _forget_args(files, out, data="bad.npz")), "bad.npz")
    assert not out.exists()


def test_a_failed_write_is_one_error_line(files, tmp_path, monkeypatch):
    def full_disk(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(scrubnet.checkpoint, "atomic_write_bytes", full_disk)
    out = tmp_path / "x.safetensors"
    _one_user_error(runner.invoke(app, _forget_args(files, out)), "No space left on device")
    assert not out.exists()


def test_audit_refuses_a_negative_seed(tmp_path):
    _one_user_error(runner.invoke(app, ["audit", "--seed", "-1", "--out", str(tmp_path / "a")]), "--seed must be ≥ 0")
    assert not (tmp_path / "a").exists()


def test_study_refuses_an_unwritable_out_before_any_work(tmp_path, monkeypatch):
    import scrubnet.cli.study as study

    def must_not_run(*a, **k):
        raise AssertionError("the study started despite an unusable --out")

    monkeypatch.setattr(study, "run_study", must_not_run)
    (tmp_path / "file").write_text("x")
    for out, needle in ((tmp_path / "file" / "cp", "is not a directory"), (tmp_path / "file", "not a directory")):
        _one_user_error(runner.invoke(app, ["study", "critical-periods", "--seeds", "1", "--out", str(out)]), needle)


def test_study_refuses_a_non_empty_out_before_any_work(tmp_path, monkeypatch):
    import scrubnet.cli.study as study

    def must_not_run(*a, **k):
        raise AssertionError("the study started over an earlier run's files")

    monkeypatch.setattr(study, "run_study", must_not_run)
    out = tmp_path / "cp"
    out.mkdir()
    (out / "results.json").write_text("{}")
    _one_user_error(runner.invoke(app, ["study", "critical-periods", "--seeds", "1", "--out", str(out)]),
                    "is not empty")
    assert (out / "results.json").read_text() == "{}"


@pytest.mark.parametrize("argv", [["config", "--dump", "--threads", "0"], ["mlforget", "show", "x", "--threads", "0"],
                                  ["dp", "--out", "o", "--threads", "-2"], ["receipt", "verify", "r", "--key", "k",
                                                                            "--threads", "0"]])
def test_threads_is_one_option_everywhere(argv):
    _one_user_error(runner.invoke(app, argv), "--threads must be at least 1")


def test_threads_sets_torchs_thread_count():
    before = torch.get_num_threads()
    try:
        r = runner.invoke(app, ["config", "--dump", "--threads", "2"])
        assert r.exit_code == 0 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_bad_hf_directory_is_named_before_the_weights_file(tmp_path, monkeypatch):
    """``--model hf:DIR`` that is missing, not a HuggingFace directory, or unusable without transformers is
    reported as such, never as 'the base model's weights file is not found'."""
    data = tmp_path / "d.npz"
    np.savez(data, x_train=np.zeros((4, 3)), y_train=np.zeros(4, int))
    plain = tmp_path / "plain"
    plain.mkdir()
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    args = ["mlforget", "finetune", "--data", str(data), "--user-weights", "head", "--out", str(tmp_path / "o")]
    _one_user_error(runner.invoke(app, [*args, "--model", f"hf:{tmp_path / 'missing'}"]), "no such directory")
    _one_user_error(runner.invoke(app, [*args, "--model", f"hf:{plain}"]), "not a HuggingFace model directory")
    monkeypatch.setitem(sys.modules, "transformers", None)   # as if the hf extra were not installed
    _one_user_error(runner.invoke(app, [*args, "--model", f"hf:{hf}"]), "needs the transformers package")
    assert not (tmp_path / "o").exists()


def test_library_warnings_stay_off_the_screen_unless_asked(monkeypatch):
    """A command hides the warnings that torch / transformers raise (a user reads scrubnet's own warnings, which
    still show); SCRUBNET_LIBRARY_OUTPUT=1 shows them again."""
    import warnings
    from scrubnet.cli.common import LIBRARY_OUTPUT_ENV, library_output_quieted

    def emit():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with library_output_quieted():
                warnings.warn_explicit("from torch", UserWarning, "functional.py", 1, module="torch.nn.functional")
                warnings.warn_explicit("from scrubnet", UserWarning, "scrub.py", 1, module="scrubnet.scrub")
        return [str(w.message) for w in seen]

    monkeypatch.delenv(LIBRARY_OUTPUT_ENV, raising=False)
    monkeypatch.delenv("SCRUBNET_DEBUG", raising=False)
    assert emit() == ["from scrubnet"]
    monkeypatch.setenv(LIBRARY_OUTPUT_ENV, "1")
    assert emit() == ["from torch", "from scrubnet"]


@pytest.mark.parametrize("options, needle", [(["lr=inf"], "not a finite number"), (["lr=NaN"], "not a finite number"),
                                             (["lr=1e999"], "not a finite number"),
                                             (["lr=0.1", "lr=0.2"], "given twice")])
def test_method_options_that_are_not_finite_or_given_twice_are_refused_before_any_work(options, needle, tmp_path):
    from scrubnet.cli.common import UserError, parse_options
    with pytest.raises(UserError, match=needle) as e:
        parse_options(options)
    assert options[-1].split("=")[1] in str(e.value)   # the message names the value given
    assert parse_options(["lr=0.1", "steps=3", "name=x"]) == {"lr": 0.1, "steps": 3, "name": "x"}


@pytest.mark.parametrize("flag, value", [("--max-seconds", "inf"), ("--max-seconds", "nan"),
                                         ("--max-cost-vs-retrain", "inf"), ("--max-cost-vs-retrain", "-1")])
def test_budgets_must_be_finite_and_positive(flag, value, tmp_path):
    ids = tmp_path / "ids.txt"
    ids.write_text("0")
    r = runner.invoke(app, ["forget", "--checkpoint", str(tmp_path / "none.safetensors"), "--forget-ids", str(ids),
                            "--method", "finetune", "--out", str(tmp_path / "o.safetensors"), flag, value])
    _one_user_error(r, f"{flag} must be a finite number > 0")
    assert value in r.stderr and not (tmp_path / "o.safetensors").exists()
