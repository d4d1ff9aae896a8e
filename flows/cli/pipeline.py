"""``bhfl run PIPELINE.yaml`` and ``bhfl resume PIPELINE_FOLDER``: a chain of experiment runs as one command.

``bhfl run`` hands a file with a top-level ``stages:`` key here (docs/pipelines.md).
Every stage config and every run-folder ``model.init_from`` is checked before
anything starts (a one-paragraph error naming the stage and the key, exit 2); the
stages then run as subflows of one ``bhfl-pipeline`` flow, and the command ends with
a per-stage summary. ``bhfl runs`` lists pipelines with their stages' status.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flows.cli.job_lines import print_job
from flows.cli.jobs import JobKind, command_seconds, resumable, run_job, start_forkserver
from flows.cli.prefect_link import PIPELINE_FLOW
from flows.cli.shell import console, fail, open_ui, out, prepare_environment, serve_on_schedule
from flows.cli.tables import print_table
from flows.progress import RichReporter

if TYPE_CHECKING:
    from bhfl_core.config.pipeline import Pipeline
    from flows.launch import Launch


class StageReporter(RichReporter):
    """The progress of a pipeline: a root-round bar per stage, named after it.

    Each stage's run announces its root rounds afresh; flows/pipeline.py's note
    ``stage <name>: ...`` before it names the bar.
    """

    stage = ""

    def emit(self, record: logging.LogRecord) -> None:
        kind, data = getattr(record, "bhfl_event", ("note", {"text": record.getMessage()}))
        if kind == "note" and str(data.get("text", "")).startswith("stage "):
            self.stage = str(data["text"])[len("stage ") :].split(":", 1)[0]
        if kind == "start":
            self.task = None  # a new bar for this stage's run
        super().emit(record)
        if kind == "start" and self.task is not None and self.stage:
            self.progress.update(self.task, description=f"{self.stage}: root rounds")


def is_pipeline_file(path: Path) -> bool:
    """Whether ``path`` is a pipeline file (unreadable files are left to the experiment loader's error)."""
    from bhfl_core.config.base import ConfigError
    from bhfl_core.config.pipeline import is_pipeline, read_pipeline_yaml

    try:
        return is_pipeline(read_pipeline_yaml(path))
    except ConfigError:
        return False


def run_pipeline_command(
    path: Path, overrides: list[str], run_dir: Path, tracking_uri: str | None, verbose: bool
) -> None:
    """Check every stage, then run them all; print the per-stage summary."""
    from bhfl_core.config.base import ConfigError
    from bhfl_core.config.pipeline import load_pipeline

    try:
        pipeline = load_pipeline(path, overrides)
    except ConfigError as exc:
        fail(str(exc))
    prepare_environment(run_dir, verbose)  # after the checks: a refused pipeline leaves no run dir behind
    configs = [s.config for s in pipeline]
    start_forkserver(configs)
    from flows.records.run_record import new_run_path
    from flows.records.warm_source import check_sources  # (flows.pipeline imports Prefect: see PIPELINE)

    try:
        pipeline = check_sources(pipeline, run_dir.resolve())
    except ConfigError as exc:
        fail(f"{path}: {exc}")
    folder = new_run_path(run_dir.resolve(), pipeline.name)
    announce = f"[bold]bhfl[/] running pipeline [cyan]{pipeline.name}[/] from {path}: stages " + " -> ".join(
        pipeline.names
    )
    run_job(
        PIPELINE,
        folder,
        run_dir,
        verbose,
        lambda launch: _start(pipeline, launch, folder),
        announce,
        {f"stage {stage.name!r}": stage.config for stage in pipeline},
        tracking_uri,
    )


def _start(pipeline: Pipeline, launch: Launch, folder: Path) -> dict[str, Any]:
    from flows.pipeline import start_pipeline  # imports Prefect: see PIPELINE

    return start_pipeline(pipeline, launch, folder)


def serve_pipeline_command(
    path: Path, cron: str, name: str | None, overrides: list[str], run_dir: Path, tracking_uri: str | None
) -> None:
    """``bhfl serve PIPELINE.yaml``: the pipeline as the scheduled deployment ``bhfl-pipeline/<name>``.

    Every stage and every run-folder warm start is checked before the Prefect server
    starts (as ``bhfl run`` does); each triggered run checks the run folders again.
    """
    from bhfl_core.config.base import ConfigError
    from bhfl_core.config.pipeline import load_pipeline

    try:
        pipeline = load_pipeline(path, overrides)
        if any(s.config.model.init_from is not None and s.source_stage is None for s in pipeline):
            from flows.records.warm_source import check_sources  # imports torch (~3 s): only for a run folder

            pipeline = check_sources(pipeline, run_dir.resolve())
    except ConfigError as exc:
        fail(f"{path}: {exc}" if not str(exc).startswith(str(path)) else str(exc))
    from flows.records.run_record import default_tracking_uri

    uri = tracking_uri or default_tracking_uri(run_dir.resolve())
    deployment = name or pipeline.name

    def serve() -> None:
        from flows.pipeline import serve_pipeline  # imports Prefect: only once serve_on_schedule set PREFECT_API_URL

        serve_pipeline(pipeline, cron, deployment, run_dir.resolve(), uri)

    stages = " -> ".join(pipeline.names)
    serve_on_schedule(run_dir, cron, f"bhfl-pipeline/{deployment}", f" (stages {stages})", serve)


def resume_pipeline_command(folder: Path, overrides: list[str], run_dir: Path, verbose: bool) -> None:
    """Finish a pipeline: finished stages are kept, the interrupted stage resumes, the rest run."""
    from flows.records.pipeline_record import PipelineRecord, read_pipeline_config

    pipeline = resumable(PipelineRecord, folder, overrides, read_pipeline_config)  # before Prefect or a worker starts
    start_forkserver([s.config for s in pipeline])

    def work(_: Launch) -> dict[str, Any]:
        from flows.pipeline import resume_pipeline  # imports Prefect: see PIPELINE

        return resume_pipeline(folder, overrides=overrides)

    run_job(PIPELINE, folder, run_dir, verbose, work, f"[bold]bhfl[/] resuming pipeline {folder} ...")


def _num(metrics: dict[str, float], key: str, digits: int = 3) -> str:
    value = metrics.get(key, math.nan)
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def _pair(metrics: dict[str, float], key: str) -> str:
    return f"{_num(metrics, key + '_mean')} / {_num(metrics, key + '_worst10')}"


def print_summary(result: dict[str, Any], run_dir: Path) -> None:
    """One row per stage (and the pipeline's totals): per-client accuracy, root, communication, time."""
    from bhfl_core.learning.metrics import task_metrics

    table = Table(title=f"Pipeline {result['name']} (per-client: mean / worst 10%)", show_header=True)
    for column in ("stage", "own model", "edge server", "root on union", "root on proxy", "models sent"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    table.add_column("time (s)", justify="right")
    tasks = result["tasks"]
    rows = [*result["metrics"].items(), ("total", result["totals"])]
    for name, m in rows:
        metric = task_metrics(tasks.get(name, list(tasks.values())[-1])).primary
        table.add_row(
            name,
            _pair(m, f"client_on_own_clients/{metric}"),
            _pair(m, f"edge_on_own_clients/{metric}"),
            _num(m, f"root/union/{metric}"),
            _num(m, f"root/proxy/{metric}"),
            _num(m, "comm/total_model_equivalents", 0),
            _num(m, "time/total_s", 0),
        )
    print_table(table)  # the results: stdout
    uri = result["tracking_uri"]
    stage_lines = "\n".join(f"    {name}: {entry['run_path']}" for name, entry in result["stages"].items())
    out.print(
        f"\n[bold green]done[/] in {command_seconds():.0f} s\n"
        f"  pipeline folder: {result['pipeline_path']}\n  stage runs (each with report/report.md):\n{stage_lines}\n"
        f"  MLflow store: {uri}\n  MLflow pipeline run id: {result['run_id']}\n"
        + open_ui(uri, run_dir, result["experiment_id"], result["run_id"]),
        highlight=False,
    )


# flows.pipeline imports Prefect, which reads PREFECT_API_URL once, when first imported: run_job imports it once the
# command's Prefect API is in the environment, and nothing before may (imported earlier, a pipeline ran on a temporary
# Prefect server of Prefect's own beside the command's, on the same database)
PIPELINE = JobKind(PIPELINE_FLOW, "flows.pipeline", lambda: StageReporter(console), print_summary)


def _pipeline_folders(run_dir: Path) -> list[Path]:
    if not any(run_dir.glob("*/*/pipeline.json")):  # none: pipeline_record (and the configs' imports) not needed
        return []
    from flows.records.pipeline_record import PipelineRecord

    return PipelineRecord.find_all(run_dir)


def _stages(folder: Path) -> tuple[Any, list[tuple[str, str, str, str]]]:
    """The pipeline record in ``folder`` and each stage's name, status, run folder and MLflow run (RunStateError: a
    damaged ``pipeline.json``). A stage's own ``run.json`` is the truth about it; a damaged one: ``unreadable``."""
    from flows.records.pipeline_record import PipelineRecord
    from flows.records.run_record import RunRecord, RunStateError

    record = PipelineRecord.found(folder)
    stages = []
    for name, entry in record.stages.items():
        try:
            run = RunRecord.read(Path(entry.run_path)) if entry.run_path else None
            status = run.effective_status if run is not None else entry.status
        except RunStateError:  # named where the run itself is listed (`unreadable: <file>: ...`)
            status = "unreadable"
        stages.append((name, status, entry.run_path, entry.run_id))
    return record, stages


def pipeline_entry(folder: Path) -> dict[str, Any]:
    """One pipeline of ``bhfl runs --json`` (keys: docs/cli.md): its record and its stages' status."""
    from flows.records.listing import read_entry

    def read(folder: Path) -> tuple[Any, dict[str, Any]]:
        record, stages = _stages(folder)
        entries = [
            {"name": name, "status": status, "path": path or None, "mlflow_run_id": run_id or None}
            for name, status, path, run_id in stages
        ]
        return record, {"detail": None, "mlflow_run_id": record.run_id or None, "stages": entries}

    return read_entry("pipeline", folder, read, mlflow_run_id=None, stages=[])


def pipeline_entries(run_dir: Path) -> list[dict[str, Any]]:
    """Every pipeline under ``run_dir`` as ``bhfl runs --json`` shows it, oldest first."""
    return [pipeline_entry(folder) for folder in _pipeline_folders(run_dir)]


def print_pipelines(out: Console, run_dir: Path, only: Path | None = None) -> int:
    """``bhfl runs``: every pipeline under ``run_dir`` (or ``only`` that one) with its stages' status; a damaged
    record is one line naming its file, the rest of the listing intact. How many were listed."""

    def read(folder: Path) -> tuple[Any, list[str]]:
        record, stages = _stages(folder)
        return record, [escape(f"{name}: {status}  {path or '(not started)'}") for name, status, path, _ in stages]

    folders = [only] if only is not None else _pipeline_folders(run_dir)
    for folder in folders:
        print_job(out, "pipeline", folder, read)
    return len(folders)
