"""What every ``scrubnet`` command shares: the one error handler, the one ``--threads`` option, the shared
options and help texts, reading sample ids, and the checks of an ``--out`` before any work.

Errors. A user error (bad input: the project's ``ValueError`` subclasses such as ``CheckpointError``,
``SplitError``, ``UserModelError``, a refused scrub or budget; a missing file; a failed write such as a full
disk; ``typer.BadParameter``) is one line ``error: …`` on stderr and exit code 2. Anything else is a bug or a
crash inside a library (say in torch, on the user's model): one line ``error: <Type>: <message>``, a hint
that ``SCRUBNET_DEBUG=1`` shows the traceback, and exit code 1. No command prints a traceback otherwise.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from scrubnet.api import ScrubFailed
from scrubnet.atomic_io import require_writable as check_writable
from scrubnet.curvature.progress import progress_reporter
from scrubnet.data.ids import parse_sample_ids
from scrubnet.data.registry import DATASETS
from scrubnet.device import resolve_device
from scrubnet.experiments.config import read_toml
from scrubnet.models import MODELS

console = Console(width=None if sys.stdout.isatty() else 120)  # pipes and logs get the full table
err_console = Console(stderr=True)

DEBUG_ENV = "SCRUBNET_DEBUG"


class UserError(ValueError):
    """An input problem reported to the user without a traceback."""


#: exceptions that are the user's input (or the machine's state), never a bug: one line, exit 2. The project's
#: input errors are ValueErrors (CheckpointError, SplitError, UserModelError, BudgetExceeded, …); a scrub that
#: did not do what it claims (ScrubFailed) is reported as a refusal too
USER_ERRORS = (ValueError, KeyError, OSError, ScrubFailed, typer.BadParameter)


def fail(msg: str, code: int = 2) -> None:
    """Print ``error: msg`` on stderr and exit with ``code``."""
    err_console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)  # "[nan]" is no markup
    raise typer.Exit(code)


def _message(e: BaseException) -> str:
    if isinstance(e, KeyError):
        return str(e.args[0]) if e.args else "KeyError"
    if isinstance(e, typer.BadParameter):
        return e.format_message()
    return str(e) or type(e).__name__


def report_error(e: BaseException) -> int:
    """Report an exception that escaped a command as one line on stderr.

    Parameters
    ----------
    e : BaseException
        The exception. Click's own (exit, abort, usage), interrupts and, with ``SCRUBNET_DEBUG=1``, unexpected
        errors are re-raised.

    Returns
    -------
    int
        1 for an unexpected error (after its ``error: <Type>: <message>`` line and the hint). A user error
        (:data:`USER_ERRORS`) does not return: it raises ``typer.Exit(2)`` after its ``error:`` line.
    """
    if isinstance(e, USER_ERRORS):
        fail(_message(e))
    # typer vendors its own click: its public exception names are the ones raised
    if isinstance(e, (typer.Exit, typer.TyperException, typer.Abort, KeyboardInterrupt, SystemExit)) \
            or not isinstance(e, Exception):
        raise e
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        raise e
    err_console.print(f"[bold red]error:[/] {escape(type(e).__name__)}: {escape(str(e))}", highlight=False,
                      soft_wrap=True)
    err_console.print(f"(an unexpected error; run again with {DEBUG_ENV}=1 to see the traceback)", highlight=False,
                      soft_wrap=True)
    return 1


#: set to 1 to see the warnings and progress bars of torch, transformers and peft (hidden by default)
LIBRARY_OUTPUT_ENV = "SCRUBNET_LIBRARY_OUTPUT"
#: the modules whose warnings a command hides: a user reads scrubnet's own warnings, which say what matters
_LIBRARY_MODULES = r"(torch|transformers|peft|huggingface_hub|sklearn|ray)(\..*)?$"


@contextlib.contextmanager
def library_output_quieted():
    """Keep the libraries' warnings and progress bars off the user's screen while a command runs, unless
    ``SCRUBNET_LIBRARY_OUTPUT=1`` (or ``SCRUBNET_DEBUG=1``) asks for them. scrubnet's own warnings still show."""
    if any(os.environ.get(k, "") not in ("", "0") for k in (LIBRARY_OUTPUT_ENV, DEBUG_ENV)):
        yield
        return
    # read by transformers and huggingface_hub when they are first imported (they are imported lazily)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=_LIBRARY_MODULES)
        yield


def handle_errors(fn: Callable) -> Callable:
    """Wrap a command so that every error ends as described in this module's docstring, and the libraries'
    warnings stay off the screen (:func:`library_output_quieted`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with library_output_quieted():
                return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except Exception as e:  # noqa: BLE001 - classified by report_error
            raise typer.Exit(report_error(e)) from None
    return wrapper


# ---- --threads: one option, validated and applied while the command line is parsed ---------------------------

THREADS_HELP = "torch CPU threads (1: numbers independent of the machine's core count)"


def _apply_threads(value: Optional[int]) -> Optional[int]:
    if value is None:
        return value
    if value < 1:
        fail("--threads must be at least 1")
    torch.set_num_threads(value)
    return value


def threads_option(help: str = THREADS_HELP):
    """The ``--threads N`` option of every command (default 1): torch's CPU thread count, validated and set by
    its callback while the command line is parsed, before the command runs.

    Parameters
    ----------
    help : str
        The option's help text (the command's own wording of what the threads do).

    Returns
    -------
    typer.models.OptionInfo
        The option, for a command's ``threads: int = threads_option(...)`` parameter.
    """
    return typer.Option(1, "--threads", help=help, callback=_apply_threads)


def set_default_threads() -> None:
    """One thread unless ``SCRUBNET_THREADS`` says otherwise (a command's ``--threads`` then sets its own)."""
    torch.set_num_threads(max(1, int(os.environ.get("SCRUBNET_THREADS", "1") or 1)))


# ---- shared options and help texts --------------------------------------------------------------------------

DEVICE_HELP = "auto | cpu | cuda: where tensors live (auto: CUDA when a GPU is present, else the CPU)"
DEVICE_OPTION = typer.Option("auto", "--device", help=DEVICE_HELP)
DATASET_HELP = " | ".join(DATASETS)
MODEL_HELP = " | ".join(MODELS)
OWN_MODEL_HELP = ("your own model: FILE.py:FACTORY or MODULE:FACTORY, a callable returning the untrained "
                  "nn.Module (called with the --model-option values as keyword arguments). Importing it RUNS "
                  "that file's code: give only your own, trusted code")
MODEL_OPTION_HELP = "keyword argument KEY=VALUE (JSON value) of the --model factory (repeatable)"
WEIGHTS_HELP = ("the weights of --model: .safetensors, or a torch.save state_dict (read with "
                "torch.load(weights_only=True), nothing else is unpickled)")
DATA_HELP = ("the training data of --model: an .npz with x_train, y_train (integer labels) and optionally "
             "x_test, y_test; or an image folder (one sub-folder per class)")
RECIPE_HELP = ("TOML file with a \\[recipe] table saying how --model was trained (loss, wd, wd_center, lr, "
               "momentum, batch_size, epochs); default: cross-entropy, no weight decay")
QUIET_OPTION = typer.Option(False, help="no progress bar")


def require_cpu(device: str, what: str = "ML-Forgetting on checkpoints") -> None:
    """The mixed-linear computations run on the CPU: validate ``device`` and refuse an explicit GPU."""
    if resolve_device(device).type != "cpu" and device.strip().lower() != "auto":
        raise UserError(f"--device {device}: {what} runs on the CPU only (use --device cpu or auto)")


# ---- reading ids, lists and options ------------------------------------------------------------------------

def read_forget_ids(path: Path, what: str = "forget-ids file") -> list[int]:
    """Forget ids (positions in D) from a text file (integers separated by spaces, commas or newlines;
    ``#`` comments) or a JSON list of integers (:func:`scrubnet.data.ids.parse_sample_ids`)."""
    if not path.is_file():
        raise UserError(f"{what} not found: {path}")
    return parse_sample_ids(path.read_text(), f"{what} {path}")


def read_ids(ids: Optional[str], ids_file: Optional[Path], flags: str = "--ids or --forget-ids (a file)"
             ) -> list[int]:
    """Sample ids from an ``--ids`` string or a file, in the formats of :func:`read_forget_ids`; exactly one
    of the two must be given and the list must not be empty."""
    if (ids is None) == (ids_file is None):
        raise UserError(f"give the sample ids with exactly one of {flags}")
    out = read_forget_ids(ids_file, "ids file") if ids_file is not None else parse_sample_ids(ids, "--ids")
    if not out:
        raise UserError("no sample ids given")
    return out


def parse_list(s: Optional[str]) -> Optional[list[str]]:
    """'a, b,c' → ['a', 'b', 'c'] (None stays None; an empty list is refused)."""
    if s is None:
        return None
    items = [t.strip() for t in s.split(",") if t.strip()]
    if not items:
        raise UserError("empty list")
    return items


def parse_options(option: list[str], flag: str = "--option") -> dict:
    """Repeated ``KEY=VALUE`` options → dict (JSON values, else the string). A key given twice, or a number
    that is not finite (``inf``, ``nan``, ``1e999``), is refused naming the option and the value."""
    opts: dict = {}
    for o in option:
        if "=" not in o:
            raise UserError(f"{flag} {o!r}: expected KEY=VALUE")
        k, v = o.split("=", 1)
        if k in opts:
            raise UserError(f"{flag} {k} is given twice ({k}={opts[k]!r} and {o!r}); give it once")
        if _not_finite(v):
            raise UserError(f"{flag} {o}: {v!r} is not a finite number")
        try:
            opts[k] = json.loads(v)
        except json.JSONDecodeError:
            opts[k] = v
    return opts


def _not_finite(text: str) -> bool:
    """Whether ``text`` reads as a number that is not finite (JSON's Infinity/NaN, Python's inf/nan, 1e999)."""
    try:
        return not math.isfinite(float(text))
    except (ValueError, OverflowError):
        return text.strip() in ("Infinity", "-Infinity", "NaN")


def json_option(text: Optional[str], what: str) -> dict:
    """A JSON-object option (``{}`` when not given)."""
    if not text:
        return {}
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise UserError(f"{what} must be a JSON object")
    return d


def read_json_file(path: Path, what: str):
    """A JSON file's content; a missing or unreadable file is a user error naming ``what``."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{what} {path} is not readable JSON: {e}") from None


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'2GiB', '500MB', '1.5gb', '123456' → bytes (> 0)."""
    t = str(text).strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        value = float(num) * _BYTE_UNITS[unit]
    except (ValueError, KeyError):
        raise UserError(f"--memory: cannot read {text!r} as a size (e.g. 2GiB, 500MB, 1048576)") from None
    if not value > 0:
        raise UserError(f"--memory must be > 0, got {text!r}")
    return int(value)


# ---- --out checks, before any work --------------------------------------------------------------------------

def require_writable(out: Path, what: str = "--out") -> None:
    """:func:`scrubnet.atomic_io.require_writable`: ``out`` can be created or written (a user error if not)."""
    check_writable(out, what)


def require_out_dir(out: Path) -> None:
    """An output directory: not an existing file, and writable (checked before any work)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    require_writable(out)


def refuse_existing_file(out: Path, overwrite: bool = False, inputs: tuple[Path, ...] = ()) -> None:
    """A checkpoint path to write: not a directory; not one of ``inputs`` nor an existing file unless
    ``overwrite``; in a writable directory."""
    if out.exists() and out.is_dir():
        raise UserError(f"--out {out} is a directory; give a checkpoint file path")
    if not overwrite:
        for p in inputs:
            if p.exists() and out.exists() and out.resolve() == p.resolve():
                raise UserError(f"--out {out} is the input checkpoint; give another path (or --overwrite)")
        if out.exists() or Path(str(out) + ".json").exists():
            raise UserError(f"--out {out} already exists; give a new path or pass --overwrite")
    require_writable(out)


@contextlib.contextmanager
def progress_with_eta():
    """A rich progress bar with the time remaining for every long pass the curvature code reports."""
    if not sys.stderr.isatty():
        yield
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=err_console, transient=True) as bar:
        tasks: dict[str, int] = {}

        def report(what: str, done: int, total: int) -> None:
            if what not in tasks:
                tasks[what] = bar.add_task(what, total=total)
            bar.update(tasks[what], completed=done, total=total)

        with progress_reporter(report):
            yield


def read_config_file(config: Optional[Path]) -> dict:
    """The TOML table of a ``--config`` file ({} without one); a missing file is a user error."""
    if config is None:
        return {}
    if not config.is_file():
        raise UserError(f"configuration file not found: {config}")
    return read_toml(config)
