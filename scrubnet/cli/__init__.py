"""The ``scrubnet`` command line: run experiments, train, forget, evaluate, report, audit, and the rest.

One module per command group (:mod:`.run`, :mod:`.forget`, :mod:`.audit`, :mod:`.bench`, :mod:`.dp`, :mod:`.study`,
:mod:`.mlforget`, :mod:`.serve`) and :mod:`.common` for what they share. Every command turns bad input into
one line ``error: …`` on stderr and exit code 2 (any other failure: one line naming the exception, exit code 1;
``SCRUBNET_DEBUG=1`` shows its traceback), and writes its outputs atomically, so nothing half-written is left
at ``--out``.
"""
from __future__ import annotations

from typing import Optional

import typer

from scrubnet.cli import audit as audit_cmds, bench as bench_cmds, dp as dp_cmds, forget as forget_cmds, \
    mlforget as mlforget_cmds, references as references_cmds, run as run_cmds, serve as serve_cmds, \
    study as study_cmds, tune as tune_cmds
from scrubnet.cli.common import handle_errors, report_error, set_default_threads

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="scrubnet: make a trained network forget a cohort of its training data, and measure it.")

for _name, _fn in (("run", run_cmds.run), ("train", run_cmds.train), ("forget", forget_cmds.forget),
                   ("evaluate", forget_cmds.evaluate), ("report", run_cmds.report), ("sweep", run_cmds.sweep),
                   ("config", run_cmds.config_cmd), ("tune", tune_cmds.tune),
                   ("references", references_cmds.references)):
    app.command(name=_name)(handle_errors(_fn))
for _name, _fn in (("train", mlforget_cmds.train), ("finetune", mlforget_cmds.finetune),
                   ("forget", mlforget_cmds.forget), ("forget-all", mlforget_cmds.forget_all_cmd),
                   ("show", mlforget_cmds.show), ("upgrade", mlforget_cmds.upgrade)):
    mlforget_cmds.mlforget_app.command(name=_name)(handle_errors(_fn))
app.add_typer(mlforget_cmds.mlforget_app, name="mlforget", help="ML-Forgetting on mixed-linear checkpoints")
app.command(name="audit")(handle_errors(audit_cmds.audit))
app.command(name="bench")(handle_errors(bench_cmds.bench))
app.command(name="dp")(handle_errors(dp_cmds.dp))
study_cmds.study_app.command(name="critical-periods")(handle_errors(study_cmds.critical_periods))
app.add_typer(study_cmds.study_app, name="study",
              help="empirical studies of training (critical periods of regularisation)")
app.command(name="serve")(handle_errors(serve_cmds.serve))
serve_cmds.receipt_app.command(name="verify")(handle_errors(serve_cmds.verify_cmd))
serve_cmds.receipt_app.command(name="audit")(handle_errors(serve_cmds.audit_cmd))
app.add_typer(serve_cmds.receipt_app, name="receipt", help="Signed receipts of deletion requests: verify, audit")


def main(argv: Optional[list[str]] = None) -> int:
    """Console-script entry point: the app, with any exception that escapes a command (or the parsing of
    its options) ended as one ``error:`` line (:func:`scrubnet.cli.common.report_error`), never a traceback."""
    set_default_threads()  # one thread unless asked otherwise (see `run --threads`)
    try:
        app(args=argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:  # noqa: BLE001 - classified by report_error
        try:
            return report_error(e)
        except typer.Exit as ex:
            return ex.exit_code
    return 0


__all__ = ["app", "main"]
