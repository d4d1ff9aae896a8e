"""`bhfl sync RUN`: deliver the MLflow tracking calls a run could not deliver to its tracking server.

A run whose remote tracking server was down when it ended keeps those calls in its folder
(flows/tracking/spool.py) and exits with ``UNDELIVERED_EXIT``; once the server answers,
this command (or `bhfl resume RUN`, which does the same for a finished run) sends them,
in order, each metric point once (flows/tracking/delivery.py).
"""

from __future__ import annotations

from pathlib import Path

import typer

from flows.cli.shell import console, fail


def exit_if_undelivered(result: dict) -> None:
    """After a run's summary: the paragraph on what its tracking server did not get, and exit code 3."""
    from flows.tracking.delivery import UNDELIVERED_EXIT

    message = result.get("tracking_undelivered")
    if message:
        console.print(f"[bold yellow]MLflow record incomplete:[/] {message}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=UNDELIVERED_EXIT)


def sync_run(run_path: Path, wait: float | None) -> None:
    """Deliver the run's pending tracking calls, waiting up to ``wait`` s (default: BHFL_TRACKING_WAIT_S)."""
    from mlflow import MlflowClient

    from bhfl_core.config.base import ConfigError
    from flows.progress import RichReporter
    from flows.records.run_record import RunRecord
    from flows.tracking.delivery import Courier, Undelivered
    from flows.tracking.spool import Spool

    record = RunRecord.read(run_path)
    if record is None:
        fail(f"{run_path} has no run record (run.json)")
        return
    spool = Spool(run_path)
    spool.remove_partial_writes()
    pending = spool.count()
    if not pending:
        refused = spool.rejected_count()
        aside = f" ({refused} refused by the server are set aside in {spool.rejected})" if refused else ""
        console.print(f"[bold]bhfl[/] {run_path}: no tracking calls waiting{aside}", highlight=False)
        return
    console.print(f"[bold]bhfl[/] delivering {pending} tracking call(s) of {run_path} to {record.tracking_uri} ...")
    try:
        meanwhile = f"bhfl sync tries again until {'--wait' if wait is not None else 'BHFL_TRACKING_WAIT_S'} ends"
        courier = Courier(MlflowClient(record.tracking_uri), spool, record.tracking_uri, meanwhile)
        with RichReporter(console).attached():
            left = courier.wait(wait, "--wait")
    except ConfigError as exc:  # a bad BHFL_TRACKING_* value
        fail(str(exc))
        return
    rejected = spool.rejected_count()
    console.print(f"delivered {pending - left} of {pending} tracking call(s)", highlight=False)
    if left or rejected:
        undelivered = Undelivered(run_path, record.tracking_uri, left, rejected, courier.last_error if left else "")
        exit_if_undelivered({"tracking_undelivered": undelivered.message()})
