"""The ``bhfl`` command line: run an experiment, a sweep or a pipeline, resume any of them, look at runs,
compare them, open the MLflow UI.

This module is the application and its list of commands; each command lives with its
kind: jobs (``run``, ``prepare``, ``resume``: flows/cli/run.py; ``sweep``:
flows/cli/sweep.py; a pipeline file through ``run``: flows/cli/pipeline.py; their one
shape: flows/cli/jobs.py), run folders (``runs``, ``sync``, ``export``:
flows/cli/folders.py), servers (``serve``, ``ui``: flows/cli/serving.py) and
``compare`` (flows/cli/compare.py).

Heavy imports (prefect, mlflow, torch) happen inside commands, after the environment
for them is set, so ``bhfl --help`` is instant and Prefect picks up the run folder's
settings.

Conventions: a command's results (summary tables, listings, comparisons, ``--json``)
go to stdout, progress, notes, warnings and errors to stderr (flows/cli/shell.py);
every MLflow run id printed is the full id, and every command that takes a run takes
the full id or a unique prefix of at least 8 characters; defaults in ``--help`` come
from typer (``show_default``); usage errors and failures a user can act on exit 2.
"""

from __future__ import annotations

from typing import Annotated

import typer

from flows.cli import folders, run, serving, sweep
from flows.cli.compare import compare
from flows.cli.options import FLAG, Command, Group
from flows.cli.run import print_summary as _print_summary

__all__ = ["_print_summary", "app"]

app = typer.Typer(
    cls=Group,
    help="Bidirectional Hierarchical Federated Learning experiments on Prefect + MLflow.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("bhfl")
    except PackageNotFoundError:  # run from a checkout that was never installed
        found = "unknown (not installed; `pip install -e .` in the repository)"
    print(f"bhfl {found}")
    raise typer.Exit()


COLLECT_AT_WORK = ("run", "sweep", "resume")
"""Commands that turn the cyclic collector back on when their job's work starts (``jobs.run_job``), after its
imports; every other one turns it on here, before its own (tasks/collector.py)."""


@app.callback()
def main(
    ctx: typer.Context,
    version: Annotated[
        bool,
        typer.Option("--version", metavar=FLAG, callback=_version, is_eager=True, help="Show the version and exit."),
    ] = False,
) -> None:
    """Bidirectional Hierarchical Federated Learning experiments on Prefect + MLflow."""
    if ctx.invoked_subcommand not in COLLECT_AT_WORK:
        from tasks import collector

        collector.resume()


for command in (
    run.run,
    run.prepare,
    sweep.sweep,
    run.resume,
    folders.sync,
    folders.export,
    folders.runs,
    serving.serve,
    serving.ui,
    compare,
):
    app.command(cls=Command)(command)


if __name__ == "__main__":  # `python -m flows.cli.app`: the command's entry, as `bhfl` (flows/cli/main.py)
    from flows.cli.stopping import run_command

    run_command(lambda: app)
