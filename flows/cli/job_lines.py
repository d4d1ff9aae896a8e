"""The blocks of ``bhfl runs``: the header line every run, sweep and pipeline starts with, and a sweep's or a
pipeline's block around its points or stages.

One function for each, so the listing reads the same for every kind of job (title in
bold, status in its colour, when it started, its MLflow run; a damaged record one line
naming its file, the rest of the listing intact) and a change to it changes it everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from flows.records.run_record import RunStateError

STATUS_COLOUR = {"finished": "green", "running": "cyan", "failed": "red", "interrupted": "yellow"}


def coloured(status: str) -> str:
    """``status`` as rich markup in its colour (white for one without: ``pending``, ``unreadable``)."""
    return f"[{STATUS_COLOUR.get(status, 'white')}]{status}[/]"


def print_header(out: Console, title: str, status: str, started: float, run_id: str) -> None:
    """``<title>  <status>  started <local time>  MLflow run <id or ->``: the first line of a job's block."""
    when = datetime.fromtimestamp(started).strftime("%Y-%m-%d %H:%M")
    out.print(
        f"[bold]{escape(title)}[/]  {coloured(status)}  started {when}  MLflow run {run_id or '-'}", highlight=False
    )


def print_job(out: Console, noun: str, folder: Path, read: Callable[[Path], tuple[Any, list[str]]]) -> None:
    """A sweep's or a pipeline's block: ``read`` gives its record and the lines under its header (its points,
    its stages: rich markup, what they quote escaped); then how to continue it unless it finished. A damaged
    record (RunStateError): one line."""
    try:
        record, lines = read(folder)
    except RunStateError as exc:
        out.print(f"{noun} {folder}  unreadable: {exc}", markup=False, highlight=False)
        return
    status = record.effective_status
    print_header(out, f"{noun} {record.name}/{folder.name}", status, record.started, record.run_id)
    for line in lines:
        out.print(f"    {line}", highlight=False)
    if status != "finished":
        out.print(f"    continue with: bhfl resume {folder}", markup=False, highlight=False)
