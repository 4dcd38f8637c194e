"""The ``autotune`` command line. Each command group lives in its own module and registers here.

User errors (:class:`~autotune.core.errors.AutotuneError`) print one clear message and exit with 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import logging
import sys

import typer
from rich.console import Console
from rich.markup import escape

from autotune.core.errors import AutotuneError

app = typer.Typer(
    name="autotune",
    help="Autotuner for MoE vision-language model training (Ray Tune + Optuna, Megatron).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
error_console = Console(stderr=True)


def _register() -> None:
    from autotune.cli import (bench_cmd, burst_cmd, data_cmd, export_cmd, knobs_cmd, probe_cmd, report_cmd,
                              run_cmd, space_cmd, validate_cmd)

    app.add_typer(space_cmd.app, name="space")
    app.add_typer(data_cmd.app, name="data")
    app.add_typer(bench_cmd.app, name="bench")
    app.command("run")(run_cmd.run)
    app.command("resume")(run_cmd.resume)
    app.command("validate")(validate_cmd.validate)
    app.command("knobs")(knobs_cmd.knobs)
    app.command("burst")(burst_cmd.burst)
    app.command("export")(export_cmd.export)
    app.command("probe")(probe_cmd.probe)
    app.command("report")(report_cmd.report)
    app.command("compare")(report_cmd.compare_runs)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _register()
    try:
        app()
    except AutotuneError as exc:
        error_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
