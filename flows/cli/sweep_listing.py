"""``bhfl runs`` for sweeps: each sweep folder with its points grouped under it.

A sweep's points are ordinary run folders (flows/records/sweep_record.py); listed one by
one among the other runs they read as unrelated runs, the sweep itself nowhere. Here a
sweep is one block: its status, how many points are in each state, and one line per
point (its label, its run's status, its folder, the first line of a failure). A point's
own ``run.json`` is the truth about it (as for a pipeline's stages), and it is the only
file read per point: no config, tree or checkpoint, so a sweep of 100 points lists in
milliseconds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from flows.cli.job_lines import coloured, print_job
from flows.records.listing import read_entry
from flows.records.run_record import RunRecord, RunStateError


@dataclass(frozen=True)
class Point:
    label: str
    status: str  # its run's effective status; the sweep record's (pending, ...) before its run exists
    path: str  # its run folder ("" before it started)
    run_id: str  # its MLflow parent run
    error: str  # the first line of why it failed, if it did


def sweep_folders(run_dir: Path) -> list[Path]:
    """The sweep folders under ``run_dir`` (``<name>/<stamp>/`` holding ``sweep.json`` and ``sweep.yaml``),
    oldest first; a damaged record is listed first (``print_sweeps`` says it is unreadable)."""
    if not any(run_dir.glob("*/*/sweep.json")):  # none: the sweep record (and the configs' imports) not needed
        return []
    from flows.records.sweep_record import SweepRecord

    return SweepRecord.find_all(run_dir)


def points(folder: Path) -> tuple[Any, list[Point]]:
    """The sweep record in ``folder`` and its points in label order (RunStateError: a damaged ``sweep.json``)."""
    from flows.records.sweep_record import SweepRecord

    record = SweepRecord.found(folder)
    found = []
    for label, point in record.points.items():
        try:
            run = RunRecord.read(Path(point.run_path)) if point.run_path else None
        except RunStateError as exc:  # the point's run.json damaged: the point is, the sweep still lists
            found.append(Point(label, "unreadable", point.run_path, point.run_id, str(exc)))
            continue
        status = run.effective_status if run is not None else point.status
        error = run.error if run is not None else point.error
        found.append(Point(label, status, point.run_path, point.run_id, error.splitlines()[0] if error else ""))
    return record, found


def counts(found: list[Point]) -> str:
    """``4 points: 3 finished, 1 failed``."""
    by_status = Counter(p.status for p in found)
    order = ["finished", "running", "interrupted", "failed", "pending", "unreadable"]
    parts = [f"{by_status[s]} {s}" for s in sorted(by_status, key=lambda s: (order.index(s) if s in order else 9, s))]
    return f"{len(found)} point{'s' * (len(found) != 1)}" + (": " + ", ".join(parts) if parts else "")


def print_sweeps(out: Console, run_dir: Path, only: Path | None = None) -> set[Path]:
    """``bhfl runs``: every sweep under ``run_dir`` (or ``only`` that one) with its points; the points' run
    folders (which the flat listing of runs then leaves out)."""
    shown: set[Path] = set()

    def read(folder: Path) -> tuple[Any, list[str]]:
        record, found = points(folder)
        shown.update(Path(p.path).resolve() for p in found if p.path)
        return record, [counts(found), *(_point_line(p) for p in found)]

    for folder in [only] if only is not None else sweep_folders(run_dir):
        print_job(out, "sweep", folder, read)
    return shown


def _point_line(p: Point) -> str:
    """``eta_down=3,seed=0: failed  <its run folder>  (<the first line of why>)``."""
    why = f"  ({p.error})" if p.error and p.status != "finished" else ""
    return f"{escape(p.label)}: {coloured(p.status)}  {escape(p.path or '(not started)')}{escape(why)}"


def sweep_entry(folder: Path) -> dict[str, Any]:
    """One sweep of ``bhfl runs --json`` (keys: docs/cli.md): its record and its points' status."""

    def read(folder: Path) -> tuple[Any, dict[str, Any]]:
        record, found = points(folder)
        entries = [
            {"label": p.label, "status": p.status, "path": p.path or None, "mlflow_run_id": p.run_id or None}
            for p in found
        ]
        return record, {"detail": counts(found), "mlflow_run_id": record.run_id or None, "points": entries}

    return read_entry("sweep", folder, read, mlflow_run_id=None, points=[])
