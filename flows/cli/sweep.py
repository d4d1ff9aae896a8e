"""``bhfl sweep`` and ``bhfl resume SWEEP_FOLDER``: many experiments (a grid, seeds, variants) as one command.

``bhfl sweep SPEC`` takes a sweep file (top-level ``grid:``, ``seeds:`` or ``configs:``;
docs/sweeps.md) or an experiment config swept by ``--grid KEY=V1,V2`` and ``--seeds``.
Every point's config is checked before anything starts (a one-paragraph error naming
the point and the key, exit 2); the points then run as subflows of one ``bhfl-sweep``
flow, several at once, and the command ends with a per-point summary. ``--resume
FOLDER`` (or ``bhfl resume FOLDER``) finishes a sweep: finished experiments, matched by
config hash, are not run again.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from flows.cli.jobs import JobKind, command_seconds, resumable, run_job, start_forkserver
from flows.cli.options import DEFAULT_CONFIG, DEFAULT_RUN_DIR, RunDirOption, TrackingOption, VerboseOption
from flows.cli.prefect_link import SWEEP_FLOW
from flows.cli.shell import console, exit_if_stopped, fail, open_ui, out, prepare_environment, serve_on_schedule
from flows.cli.tables import print_table, results_width
from flows.progress import RichReporter

if TYPE_CHECKING:
    from flows.launch import Launch


class SweepReporter(RichReporter):
    """The progress of a sweep: one bar of experiments done, and the sweep's own notes.

    The experiments run side by side, so their round-by-round progress would interleave;
    only the notes of flows/sweep.py (``sweep ...``, ``point <label>: ...``) are shown.
    """

    def __init__(self, out: Console, total: int) -> None:
        super().__init__(out)
        self.total = total

    def emit(self, record: logging.LogRecord) -> None:
        kind, data = getattr(record, "bhfl_event", ("note", {"text": record.getMessage()}))
        text = str(data.get("text", "")) if kind == "note" else ""
        if not text.startswith(("point ", "sweep ")):
            return
        if self.task is None:
            self.progress.start()
            self.task = self.progress.add_task("experiments", total=self.total, completed=0, detail="")
        self.progress.console.print(text, highlight=False, soft_wrap=True)
        if text.endswith((": finished", ": failed")) or "finished before" in text or ": failed (" in text:
            self.progress.update(self.task, advance=1)


def is_sweep_file(path: Path) -> bool:
    """Whether ``path`` is a sweep file (unreadable files are left to the experiment loader's error)."""
    from bhfl_core.config.base import ConfigError
    from bhfl_core.config.pipeline import read_pipeline_yaml
    from bhfl_core.config.sweep import is_sweep

    try:
        return is_sweep(read_pipeline_yaml(path))
    except ConfigError:
        return False


def _guarded(work: Callable[[], dict[str, Any]], folder: Path | None, verbose: bool) -> dict[str, Any]:
    """Run ``work``; a failed point, an interrupt or a known failure becomes one paragraph and an exit code."""
    from flows.cli.errors import exit_code, explain
    from flows.sweep import SweepError

    hint = (
        f" Finished experiments are kept; continue with `bhfl resume {folder}` (they are not run again)."
        if folder is not None
        else ""
    )
    try:
        return work()
    except BaseException as exc:
        exit_if_stopped(exc, f"\n[bold yellow]interrupted.[/]{hint}")
        if isinstance(exc, SweepError):
            console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(code=1) from None
        if not isinstance(exc, Exception):
            raise
        message = explain(exc, None)
        if message is None or verbose:
            raise
        console.print(f"[bold red]error:[/] {escape(message)}{hint}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=exit_code(exc, None)) from None


def sweep(
    config: Annotated[
        Path,
        typer.Argument(
            metavar="SPEC",
            help="Sweep YAML (top-level grid:, seeds: or configs:; docs/sweeps.md), or an experiment YAML.",
        ),
    ] = DEFAULT_CONFIG,
    grid: Annotated[
        list[str],
        typer.Option(
            "--grid",
            metavar="KEY=V1,V2",
            help="Sweep a key over values, e.g. --grid tree.edge.eta_down=1.0,0.5 (repeatable).",
        ),
    ] = [],
    seeds: Annotated[
        str | None, typer.Option("--seeds", metavar="SEEDS", help="Run every point once per seed: 0,1,2 or 0-2.")
    ] = None,
    set_: Annotated[
        list[str],
        typer.Option(
            "--set", metavar="KEY=VALUE", help="Override a config key of every point by dotted path (repeatable)."
        ),
    ] = [],
    name: Annotated[
        str | None, typer.Option("--name", show_default="the file's name", help="The sweep's name.")
    ] = None,
    parallel: Annotated[
        int | None,
        typer.Option("--parallel", show_default="one per shared worker, else 1", help="Experiments at once."),
    ] = None,
    resume_folder: Annotated[
        str | None,
        typer.Option(
            "--resume",
            metavar="FOLDER",
            help="Finish this sweep folder instead: finished experiments (same config hash) are kept.",
        ),
    ] = None,
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    tracking_uri: TrackingOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Run a sweep: every point of a grid x seeds (x named variants) as an experiment, several at once."""
    run_sweep_command(config, set_, grid, seeds, name, parallel, resume_folder, run_dir, tracking_uri, verbose)


def run_sweep_command(
    path: Path,
    overrides: list[str],
    grid: list[str],
    seeds: str | None,
    name: str | None,
    parallel: int | None,
    resume: str | None,
    run_dir: Path,
    tracking_uri: str | None,
    verbose: bool,
) -> None:
    """Check every point, then run them all (or finish the sweep folder ``resume``); print the summary."""
    from bhfl_core.config.base import ConfigError
    from bhfl_core.config.sweep import load_sweep, parse_seeds

    if parallel is not None and parallel < 1:
        fail(f"--parallel {parallel}: give at least 1 (or leave it out: one experiment per shared worker)")
    try:
        sweep = load_sweep(path, overrides, grid, parse_seeds(seeds) if seeds is not None else None, name)
    except ConfigError as exc:
        fail(str(exc))
    prepare_environment(run_dir, verbose)  # after the checks: a refused sweep leaves no run dir behind
    from flows.records.run_state import RunStateError
    from flows.records.sweep_record import SweepRecord

    folder = None
    if resume is not None:
        if (folder := SweepRecord.find(resume, run_dir)) is None:
            fail(f"--resume {resume}: not a sweep folder (no sweep.json and sweep.yaml there or under {run_dir})")
            return
        try:  # (a finished one too: a changed spec may add points)
            SweepRecord.resumable(folder)
        except RunStateError as exc:
            fail(str(exc))
    configs = [p.config for p in sweep]
    start_forkserver(configs)
    from flows.records.run_record import new_run_path

    target = folder or new_run_path(run_dir.resolve(), sweep.name)

    def work(launch: Launch) -> dict[str, Any]:
        from flows.sweep import start_sweep  # imports Prefect: only once run_job has set PREFECT_API_URL (_kind)

        return start_sweep(sweep, launch, target if folder is None else None, parallel, resume_from=folder)

    announce = f"[bold]bhfl[/] sweep [cyan]{sweep.name}[/] from {path}: {len(sweep)} experiment(s) " + (
        f"(resuming {folder})" if folder else f"in {target}"
    )
    named = {f"sweep point {p.label!r}": p.config for p in sweep}
    run_job(_kind(len(sweep)), target, run_dir, verbose, work, announce, named, tracking_uri)


def resume_sweep_command(folder: Path, overrides: list[str], run_dir: Path, verbose: bool) -> None:
    """Finish a sweep: finished experiments are kept, interrupted ones resume, the rest run."""
    from flows.records.sweep_record import SweepRecord, read_sweep_config

    sweep = resumable(SweepRecord, folder, overrides, read_sweep_config)  # before Prefect or any worker starts
    start_forkserver([p.config for p in sweep])

    def work(_: Launch) -> dict[str, Any]:
        from flows.sweep import resume_sweep  # imports Prefect: only once run_job has set PREFECT_API_URL (_kind)

        return resume_sweep(folder, overrides=overrides)

    run_job(_kind(len(sweep)), folder, run_dir, verbose, work, f"[bold]bhfl[/] resuming sweep {folder} ...")


def _kind(points: int) -> JobKind:
    """A sweep at the terminal: a bar of its ``points`` experiments, failures that name the failed points.

    ``flows.sweep`` imports Prefect, which reads ``PREFECT_API_URL`` once, when first
    imported: ``run_job`` imports it once the command's Prefect API is in the environment,
    and nothing before may (imported earlier, a sweep ran on a temporary Prefect server
    of Prefect's own, started beside the command's on the same database, 13 s at its end).
    """
    return JobKind(SWEEP_FLOW, "flows.sweep", lambda: SweepReporter(console, points), print_summary, _guarded)


def _num(metrics: Mapping[str, float], key: str, digits: int = 3) -> str:
    value = metrics.get(key, math.nan)
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


_COLUMNS = ("experiment", "status", "own model", "edge server", "root on union", "time (s)")
_LABEL_MIN = 16  # the label column's width when the number columns at their narrowest leave less


def _label_lines(label: str, width: int) -> str:
    """``label`` broken after its commas into lines of at most ``width`` characters (a longer part stays whole).

    A point's label is ``[variant,]key=value,...,seed=N``, each part what tells two points
    apart, so a narrow terminal gets more lines instead of a cut: rich would otherwise end
    the cell in an ellipsis where the values differ (``eta_down=0…`` for 0.5 and 1.0).
    """
    lines = [""]
    parts = label.split(",")
    for i, part in enumerate(parts):
        piece = part + ("," if i < len(parts) - 1 else "")
        if lines[-1] and len(lines[-1]) + len(piece) > width:
            lines.append("")
        lines[-1] += piece
    return "\n".join(lines)


def _point_cells(entry: Mapping[str, Any], m: Mapping[str, float], metric: str) -> list[str]:
    """A point's cells after its label: status, own model and edge server (mean / worst 10%), root, time."""
    pair = "{} / {}".format
    return [
        entry["status"],
        pair(_num(m, f"client_on_own_clients/{metric}_mean"), _num(m, f"client_on_own_clients/{metric}_worst10")),
        pair(_num(m, f"edge_on_own_clients/{metric}_mean"), _num(m, f"edge_on_own_clients/{metric}_worst10")),
        _num(m, f"root/union/{metric}"),
        _num(m, "time/total_s", 0),
    ]


def _narrowest(texts: Sequence[str]) -> int:
    """The narrowest a column of ``texts`` can be when rich wraps it at spaces: its longest word."""
    return max(len(word) for text in texts for word in text.split())


def _column_widths(columns: Sequence[Sequence[str]], width: int) -> list[int]:
    """Widths of the summary's columns (``columns[i]``: column i's header and cells) that fit in ``width``.

    rich's own fitting narrows the widest columns first and, once they are equally wide,
    every column evenly, labels included: an ellipsis where two labels differ. Here the
    status (column 1) keeps its width, the number columns narrow first, down to their
    longest word (rich wraps them at spaces), then the labels (column 0), down to
    ``_LABEL_MIN`` (they wrap at their commas); what is left goes back to the numbers evenly.
    """
    natural = [max(len(text) for text in column) for column in columns]
    numbers = [_narrowest(column) for column in columns[2:]]
    room = width - (3 * len(columns) + 1) - natural[1]  # a border and a space either side of every cell
    label = min(natural[0], max(_LABEL_MIN, room - sum(numbers)))
    spare = room - label - sum(numbers)
    while spare > 0 and (short := [i for i, want in enumerate(natural[2:]) if numbers[i] < want]):
        for i in short[:spare]:  # one character each in turn: the numbers wrap alike
            numbers[i] += 1
        spare -= len(short[:spare])
    return [label, natural[1], *numbers]


def summary_table(result: Mapping[str, Any], metrics: Mapping[str, Mapping[str, float]], width: int) -> Table:
    """One row per point: per-client accuracy (own model, edge server), root on the union, time.

    ``metrics``: each point's run metrics by label; ``width``: the terminal's. The labels
    are what the table is for: the number columns give way first (``_column_widths``) and
    a label too long for its column wraps at its commas, never cut.
    """
    from bhfl_core.learning.metrics import task_metrics

    tasks = result["tasks"]
    rows = {
        label: _point_cells(
            entry, metrics.get(label, {}), task_metrics(tasks.get(label, next(iter(tasks.values())))).primary
        )
        for label, entry in result["points"].items()
    }
    columns = [[_COLUMNS[0], *rows], *([head, *(r[i] for r in rows.values())] for i, head in enumerate(_COLUMNS[1:]))]
    widths = _column_widths(columns, width)
    table = Table(title=f"Sweep {result['name']} (per-client: mean / worst 10%)", show_header=True)
    table.add_column(_COLUMNS[0], width=widths[0], overflow="fold")
    table.add_column(_COLUMNS[1], width=widths[1])
    for column, column_width in zip(_COLUMNS[2:], widths[2:], strict=True):
        table.add_column(column, width=column_width, justify="right")
    for label, cells in rows.items():
        table.add_row(Text(_label_lines(label, widths[0])), *cells)
    return table


def print_summary(result: dict[str, Any], run_dir: Path) -> None:
    """The points' table (``summary_table``, metrics from MLflow) and where the sweep's files and runs are."""
    from mlflow import MlflowClient

    client = MlflowClient(result["tracking_uri"])
    metrics = {
        label: client.get_run(entry["run_id"]).data.metrics if entry["run_id"] else {}
        for label, entry in result["points"].items()
    }
    print_table(summary_table(result, metrics, results_width()))  # the results: stdout
    uri = result["tracking_uri"]
    skipped = len(result["points"]) - len(result["ran"])
    out.print(
        f"\n[bold green]done[/] in {command_seconds():.0f} s: {len(result['ran'])} experiment(s) run, "
        f"{result['parallel']} at a time; {skipped} finished before\n"
        f"  sweep folder: {result['sweep_path']} (sweep.json: label -> run folder)\n"
        f"  MLflow store: {uri}\n  MLflow sweep run id: {result['run_id']}\n"
        + open_ui(uri, run_dir, result["experiment_id"], result["run_id"]),
        highlight=False,
    )


def serve_sweep_command(
    path: Path, cron: str, name: str | None, overrides: list[str], run_dir: Path, tracking_uri: str | None
) -> None:
    """``bhfl serve SWEEP.yaml``: the sweep as the scheduled deployment ``bhfl-sweep/<name>``."""
    from bhfl_core.config.base import ConfigError
    from bhfl_core.config.sweep import load_sweep

    try:
        sweep = load_sweep(path, overrides)
    except ConfigError as exc:
        fail(str(exc))
    from flows.records.run_record import default_tracking_uri

    uri = tracking_uri or default_tracking_uri(run_dir)
    deployment = name or sweep.name

    def serve() -> None:
        from flows.sweep import serve_sweep  # imports Prefect: only once serve_on_schedule set PREFECT_API_URL

        serve_sweep(sweep, cron, deployment, run_dir.resolve(), uri)

    serve_on_schedule(run_dir, cron, f"bhfl-sweep/{deployment}", f" ({len(sweep)} experiments)", serve)
