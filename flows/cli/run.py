"""``bhfl run``, ``bhfl prepare`` and ``bhfl resume``: an experiment (or a pipeline file, flows/cli/pipeline.py),
its data alone, and continuing any job (a run, a sweep folder, a pipeline folder) where it stopped.

Both take the one job shape of flows/cli/jobs.py; this module holds what is an
experiment's own: its checks before anything starts (the config, a warm start's source),
its summary (the headline table and where everything went), and what ``bhfl resume``
does with a run that finished (nothing, or its tracking server's copy, or
``--force-eval``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from flows.cli.jobs import JobKind, check_overrides, command_seconds, not_applied, run_job, start_forkserver
from flows.cli.options import (
    DEFAULT_CONFIG,
    DEFAULT_RUN_DIR,
    ConfigArgument,
    RunDirOption,
    SetOption,
    TrackingOption,
    VerboseOption,
    runs_folder_of,
)
from flows.cli.prefect_link import EXPERIMENT_FLOW
from flows.cli.shell import (
    console,
    fail,
    guarded,
    load_config,
    open_ui,
    out,
    prefect_api,
    preflight,
    prepare_environment,
)
from flows.cli.tables import print_table

if TYPE_CHECKING:
    from flows.launch import Launch


def _reporter() -> Any:
    from flows.progress import RichReporter

    return RichReporter(console)


def _on_disk(result: dict) -> str:
    """`` (12.3 MB, 41 KB a client)``: the run folder's size, as the run measured it at its end."""
    from flows.records.disk_usage import RUN_FOLDER_BYTES, RUN_FOLDER_BYTES_PER_CLIENT

    disk = result.get("disk") or {}
    if RUN_FOLDER_BYTES not in disk:
        return ""
    total, per_client = disk[RUN_FOLDER_BYTES], disk[RUN_FOLDER_BYTES_PER_CLIENT]
    return f" ({total / 1e6:,.1f} MB, {per_client / 1e3:,.1f} KB a client)"


def print_summary(result: dict, run_dir: Path) -> None:
    """The end of a run, on stdout: the headline table, where everything went, how to open it.

    Beside each headline its trivial baseline, where the task has one (each client's
    majority label, or a unigram model for masked LM: report.md's row, docs/evaluation.md),
    so a number is read against what no training gets.
    """
    from rich.table import Table

    baseline: dict[str, float] = result.get("baseline") or {}
    kind = result.get("baseline_name") or "no training"
    caption = f"trivial baseline: {kind}, without training (docs/evaluation.md)" if baseline else None
    table = Table(title="Final evaluation", caption=caption, show_header=True)
    table.add_column("metric", no_wrap=True)
    table.add_column("value", justify="right")
    if baseline:  # (a short header: an 80-column terminal keeps the metric names whole)
        table.add_column("trivial baseline", justify="right")
    for name, value in result["headline"].items():
        beside = [f"{baseline[name]:.4g}" if name in baseline else ""] if baseline else []
        table.add_row(name, f"{value:.4g}", *beside)
    print_table(table)
    uri = result["tracking_uri"]
    out.print(
        f"\n[bold green]done[/] in {command_seconds():.0f} s\n"
        f"  run files (node models, optimiser states): {result['run_path']}{_on_disk(result)}\n"
        f"  MLflow store: {uri}\n"
        f"  MLflow run id: {result['run_id']}  (evaluation matrix: artefact eval/matrix.csv)\n"
        f"  report: {Path(result['run_path']) / 'report' / 'report.html'}  "
        "(artefacts report.html with the figures inline, report.md; tables and figures in eval/)\n"
        + open_ui(uri, run_dir, result["experiment_id"], result["run_id"]),
        highlight=False,
    )


def _summary_and_exit(result: dict, run_dir: Path) -> None:
    """The summary; then exit 3 if tracking calls could not be delivered (`bhfl sync` delivers them)."""
    print_summary(result, run_dir)
    from flows.cli.sync import exit_if_undelivered

    exit_if_undelivered(result)


EXPERIMENT = JobKind(EXPERIMENT_FLOW, "flows.experiment", _reporter, _summary_and_exit)


def run(
    config: Annotated[
        Path,
        typer.Argument(
            metavar="CONFIG",
            help="Experiment YAML, or a pipeline YAML (top-level `stages:`, docs/pipelines.md).",
        ),
    ] = DEFAULT_CONFIG,
    set_: Annotated[
        list[str],
        typer.Option(
            "--set",
            metavar="KEY=VALUE",
            help="Override a config key by dotted path, e.g. --set tree.root.rounds=2 (repeatable); "
            "in a pipeline for every stage, or --set stages.<stage>.<key>=... for one.",
        ),
    ] = [],
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    tracking_uri: TrackingOption = None,
    resume_run: Annotated[
        str | None,
        typer.Option("--resume", metavar="RUN", help="Continue this run instead (same as `bhfl resume RUN`)."),
    ] = None,
    verbose: VerboseOption = False,
) -> None:
    """Run an experiment (prepare data, train the tree, evaluate every node, log to MLflow) or a pipeline of them."""
    if resume_run is not None:
        resume_job(resume_run, set_, run_dir, verbose)
        return
    from flows.cli.pipeline import is_pipeline_file, run_pipeline_command

    if is_pipeline_file(config):
        run_pipeline_command(config, set_, run_dir, tracking_uri, verbose)
        return
    cfg = load_config(config, set_)  # before the run dir is made: a refused config leaves nothing behind
    prepare_environment(run_dir, verbose)
    start_forkserver([cfg])
    from flows.records.run_record import new_run_path

    if cfg.model.init_from is not None:  # its checks import torch (~1 s): only for a warm start
        from bhfl_core.config.base import ConfigError
        from flows.records.warm_source import resolve_init_from

        try:  # a warm start's source run: found and checked before anything starts
            cfg = resolve_init_from(cfg, run_dir.resolve())
        except ConfigError as exc:
            fail(str(exc))
    run_path = new_run_path(run_dir.resolve(), cfg.name)

    def work(launch: Launch) -> dict[str, Any]:
        from flows.experiment import start_run

        return start_run(cfg, launch, run_path)

    announce = (
        f"[bold]bhfl[/] running [cyan]{cfg.name}[/] from {config} (seed {cfg.seed}); starting workers, "
        "Prefect and MLflow ..."
    )
    run_job(EXPERIMENT, run_path, run_dir, verbose, work, announce, {cfg.name: cfg}, tracking_uri, cluster=cfg)


def prepare(
    config: ConfigArgument = DEFAULT_CONFIG,
    set_: SetOption = [],
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    verbose: VerboseOption = False,
) -> None:
    """Prepare (or reuse) an experiment's data: load, partition, tokenise, cache; print the partition report."""
    cfg = load_config(config, set_)
    prepare_environment(run_dir, verbose)
    preflight(cfg, run_dir)
    from data_prep.cache_folder import data_cache_folder
    from data_prep.prepare import PreparedData, cached_data, prepare_data

    cache = data_cache_folder(run_dir)
    if "PREFECT_API_URL" not in os.environ and cached_data(cfg, cache) is not None:
        # A cache hit runs no preparation step, so no Prefect flow: starting Prefect's temporary
        # server for a flow run nobody sees took ~15 s. (With a Prefect server of your own, the
        # hit is still a `prepare-data` flow run in its UI.) Same note, same result as the flow's.
        prepared: PreparedData = prepare_data(cfg, cache, log=lambda text: console.print(text, highlight=False))
    else:
        from flows.data import run_prepare
        from flows.progress import RichReporter

        def work() -> dict:
            with RichReporter(console).attached():
                return {"prepared": run_prepare(cfg, cache)}

        with prefect_api(run_dir, full=False) as api:  # (Prefect's temporary server would outlive a stopped command)
            api()
            prepared = guarded(work, None, verbose)["prepared"]
    report = prepared.report_dir / "partition.md"
    print(report.read_text(encoding="utf-8") if report.exists() else "")
    # A `kind: prepared` folder is used where it is, never cached: calling it a cache hit sent users to
    # <run-dir>/cache for data that was not there.
    state = "cache hit (no tokenisation)" if prepared.cached else "prepared"
    if cfg.data.source.kind == "prepared":
        state = "used in place (no tokenisation)"
    out.print(
        f"[bold green]{state}[/] in {prepared.seconds:.2f} s: {prepared.root}\n"
        f"  manifest: {prepared.root / 'manifest.json'}\n  plots: {prepared.report_dir}",
        highlight=False,
    )


def resume(
    run_spec: Annotated[
        str,
        typer.Argument(
            metavar="RUN",
            help="Run folder, <name>/<stamp>, `latest`, an MLflow run id (full or a unique prefix of 8+ "
            "characters), a pipeline or sweep folder.",
        ),
    ],
    set_: Annotated[
        list[str],
        typer.Option(
            "--set",
            metavar="KEY=VALUE",
            help="Change runtime.* or eval.batch_size only (they do not change results).",
        ),
    ] = [],
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    verbose: VerboseOption = False,
    force_eval: Annotated[
        bool,
        typer.Option(
            "--force-eval",
            help="Evaluate a finished run again (no training), logged as a new step after the last root round; "
            "the report is rewritten.",
        ),
    ] = False,
) -> None:
    """Continue a failed or killed run: finished nodes and rounds are kept, the rest runs, results are identical."""
    resume_job(run_spec, set_, run_dir, verbose, force_eval)


def resume_job(run_spec: str, overrides: list[str], run_dir: Path, verbose: bool, force_eval: bool = False) -> None:
    """``bhfl resume``: a pipeline folder, a sweep folder or a run, each the way its kind resumes."""
    run_dir = runs_folder_of(run_spec, run_dir)
    from flows.records.listing import resolve_pipeline, resolve_run, resolve_sweep
    from flows.records.run_state import RunStateError

    try:
        pipeline = resolve_pipeline(run_spec, run_dir)
        sweep_folder = None if pipeline is not None else resolve_sweep(run_spec, run_dir)
        run_path = resolve_run(run_spec, run_dir) if pipeline is None and sweep_folder is None else None
    except RunStateError as exc:
        fail(str(exc))
    if force_eval and (pipeline is not None or sweep_folder is not None):
        fail(f"--force-eval evaluates one run again; {run_spec} is a pipeline or sweep folder: give one of its runs")
    check_overrides(overrides, "pipeline" if pipeline is not None else "sweep" if sweep_folder is not None else "run")
    # once the job is found and the --sets pass (a refused resume left an empty run dir behind); before Prefect
    prepare_environment(run_dir, verbose)
    if pipeline is not None:
        from flows.cli.pipeline import resume_pipeline_command

        resume_pipeline_command(pipeline, overrides, run_dir, verbose)
        return
    if sweep_folder is not None:
        from flows.cli.sweep import resume_sweep_command

        resume_sweep_command(sweep_folder, overrides, run_dir, verbose)
        return
    assert run_path is not None
    _resume_run(run_path, overrides, run_dir, verbose, force_eval)


def _resume_run(run_path: Path, overrides: list[str], run_dir: Path, verbose: bool, force_eval: bool) -> None:
    from flows.records.run_record import RunRecord, RunStateError

    try:
        record = RunRecord.read(run_path)
    except RunStateError as exc:  # a damaged run.json: one line, exit 2, the folder untouched
        fail(str(exc))
    finished = record is not None and record.status == "finished"
    if finished and not force_eval:
        from flows.cli.sync import sync_run
        from flows.tracking.spool import pending_count

        if pending_count(run_path) > 0:
            if overrides:
                console.print(f"[bold]bhfl[/] {run_path} finished{not_applied(overrides)}", highlight=False)
            sync_run(run_path, wait=None)  # all a finished run can lack: its tracking server's copy
            return
        # nothing to redo, and nothing of its record (MLflow, run.json) is touched
        console.print(
            f"[bold]bhfl[/] {run_path} finished; nothing to resume (--force-eval evaluates it again)"
            + not_applied(overrides),
            highlight=False,
        )
        return
    if force_eval and not finished:
        fail(f"{run_path} is not finished: `bhfl resume {run_path}` finishes it, evaluation included")

    def work(_: Launch) -> dict[str, Any]:  # (its own launch: its record's)
        from flows.experiment import resume_experiment

        return resume_experiment(run_path, overrides=overrides, force_eval=force_eval)

    announce = f"[bold]bhfl[/] {'re-evaluating' if force_eval else 'resuming'} {run_path} ..."
    run_job(EXPERIMENT, run_path, run_dir, verbose, work, announce)
