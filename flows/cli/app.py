"""The ``bhfl`` command line: run an experiment, prepare its data, open the MLflow UI.

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

import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption

from flows.cli.shell import (
    console,
    fail,
    guarded,
    hub_check,
    load_config,
    local_cluster,
    open_ui,
    out,
    prefect_api,
    preflight,
    prepare_environment,
    print_json,
    serve_on_schedule,
    tracking_store_ready,
)

# flags take no value: metavar="" keeps typer from showing a <bool> value type beside them
FLAG = ""


def _flags_without_type(params: list[Any]) -> list[Any]:
    """Typer shows a value type beside every option, ``<bool>`` beside flags that take no value; ``metavar=""``
    hides it. Ours set it (``FLAG``); this does it for typer's own (``--help``, ``--install-completion``)."""
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = FLAG
    return params


class _Command(TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:
        return _flags_without_type(super().get_params(ctx))


class _Group(TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _flags_without_type(super().get_params(ctx))


app = typer.Typer(
    cls=_Group,
    help="Bidirectional Hierarchical Federated Learning experiments on Prefect + MLflow.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

DEFAULT_CONFIG = Path("configs/embedded.yaml")
DEFAULT_RUN_DIR = Path("runs")

RunDirOption = Annotated[
    Path,
    typer.Option("--run-dir", metavar="DIR", help="Folder for run files, the data cache and the default MLflow store."),
]
TrackingOption = Annotated[
    str | None,
    typer.Option(
        "--tracking-uri",
        envvar="MLFLOW_TRACKING_URI",
        metavar="URI",
        show_default="sqlite:///RUN_DIR/mlflow.db",
        help="MLflow tracking URI.",
    ),
]
VerboseOption = Annotated[bool, typer.Option("--verbose", "-v", metavar=FLAG, help="Show Prefect's run logs.")]
ConfigArgument = Annotated[Path, typer.Argument(metavar="CONFIG", help="Experiment YAML.")]
JsonOption = Annotated[
    bool,
    typer.Option("--json", metavar=FLAG, help="Print the result as JSON on stdout (keys: README, 'The CLI')."),
]


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


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option("--version", metavar=FLAG, callback=_version, is_eager=True, help="Show the version and exit."),
    ] = False,
) -> None:
    """Bidirectional Hierarchical Federated Learning experiments on Prefect + MLflow."""


@app.command(cls=_Command)
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
        _resume(resume_run, set_, run_dir, verbose)
        return
    from flows.cli.pipeline import is_pipeline_file, run_pipeline_command

    if is_pipeline_file(config):
        run_pipeline_command(config, set_, run_dir, tracking_uri, verbose)
        return
    prepare_environment(run_dir, verbose)
    cfg = load_config(config, set_)
    from tasks.local_cluster import likely_cpu_workers, start_forkserver

    if cfg.runtime.executor == "local" and likely_cpu_workers(cfg.runtime):
        start_forkserver()  # local workers' imports (torch, transformers) start now, beside ours
    from bhfl_core.config.base import ConfigError
    from flows.records.run_record import new_run_path
    from flows.records.warm_source import resolve_init_from

    try:  # a warm start's source run: found and checked before anything starts
        cfg = resolve_init_from(cfg, run_dir.resolve())
    except ConfigError as exc:
        fail(str(exc))

    run_path = new_run_path(run_dir.resolve(), cfg.name)
    hub_check(cfg, run_dir)
    # the Prefect server and the workers boot while the model/data check runs and the pipeline is imported
    with prefect_api(run_dir, full=False, resume=run_path) as api, local_cluster(cfg, run_path) as cluster:
        preflight(cfg, run_dir)
        console.print(
            f"[bold]bhfl[/] running [cyan]{cfg.name}[/] from {config} (seed {cfg.seed}); starting workers, "
            "Prefect and MLflow ...",
            highlight=False,
        )
        from flows.cli.prefect_link import flow_run_link
        from flows.experiment import run_experiment
        from flows.progress import RichReporter

        uri = tracking_store_ready(run_dir, tracking_uri, api)
        with flow_run_link(console, api.own, run_path), RichReporter(console).attached():
            result = guarded(
                lambda: run_experiment(
                    cfg, run_dir, uri, run_path=run_path, cluster=cluster.address() if cluster else None
                ),
                run_path,
                verbose,
            )
    _print_summary(result, run_dir)
    _exit_if_undelivered(result)


SetOption = Annotated[
    list[str],
    typer.Option("--set", metavar="KEY=VALUE", help="Override a config key by dotted path (repeatable)."),
]


@app.command(cls=_Command)
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
    from data_prep.prepare import PreparedData, cached_data, prepare_data

    cache = (run_dir / "cache").resolve()
    if "PREFECT_API_URL" not in os.environ and cached_data(cfg, cache) is not None:
        # A cache hit runs no preparation step, so no Prefect flow: starting Prefect's temporary
        # server for a flow run nobody sees took ~15 s. (With a Prefect server of your own, the
        # hit is still a `prepare-data` flow run in its UI.) Same note, same result as the flow's.
        prepared: PreparedData = prepare_data(cfg, cache, log=lambda text: console.print(text, highlight=False))
    else:
        from prefect.settings import temporary_settings

        from flows.data import run_prepare
        from flows.progress import RichReporter

        def work() -> dict:
            with temporary_settings(updates={"flows.heartbeat_frequency": None}), RichReporter(console).attached():
                return {"prepared": run_prepare(cfg, cache)}

        with prefect_api(run_dir, full=False) as api:  # (Prefect's temporary server would outlive a stopped command)
            api()
            prepared = guarded(work, None, verbose)["prepared"]
    report = prepared.report_dir / "partition.md"
    print(report.read_text() if report.exists() else "")
    state = "cache hit (no tokenisation)" if prepared.cached else "prepared"
    out.print(
        f"[bold green]{state}[/] in {prepared.seconds:.2f} s: {prepared.root}\n"
        f"  manifest: {prepared.root / 'manifest.json'}\n  plots: {prepared.report_dir}",
        highlight=False,
    )


@app.command(cls=_Command)
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
    from flows.cli.sweep import run_sweep_command

    run_sweep_command(config, set_, grid, seeds, name, parallel, resume_folder, run_dir, tracking_uri, verbose)


RunArgumentHelp = (
    "Run folder, <name>/<stamp>, `latest`, an MLflow run id (full or a unique prefix of 8+ characters), "
    "a pipeline or sweep folder."
)


@app.command(cls=_Command)
def resume(
    run_spec: Annotated[str, typer.Argument(metavar="RUN", help=RunArgumentHelp)],
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
    _resume(run_spec, set_, run_dir, verbose, force_eval)


def _resume(run_spec: str, overrides: list[str], run_dir: Path, verbose: bool, force_eval: bool = False) -> None:
    prepare_environment(run_dir, verbose)  # before anything imports prefect
    from bhfl_core.config.base import ConfigError
    from flows.records.listing import resolve_pipeline, resolve_run
    from flows.records.run_state import RunStateError
    from flows.records.sweep_record import find_sweep

    try:
        pipeline = resolve_pipeline(run_spec, run_dir)
    except RunStateError as exc:
        fail(str(exc))
    if force_eval and (pipeline is not None or find_sweep(run_spec, run_dir) is not None):
        fail(f"--force-eval evaluates one run again; {run_spec} is a pipeline or sweep folder: give one of its runs")
    if pipeline is not None:
        from flows.cli.pipeline import resume_pipeline_command

        resume_pipeline_command(pipeline, overrides, run_dir, verbose)
        return
    if (sweep_folder := find_sweep(run_spec, run_dir)) is not None:
        from flows.cli.sweep import resume_sweep_command

        resume_sweep_command(sweep_folder, overrides, run_dir, verbose)
        return

    try:
        run_path = resolve_run(run_spec, run_dir)
    except RunStateError as exc:
        fail(str(exc))
    from flows.records.run_record import RunRecord

    finished = (record := RunRecord.read(run_path)) is not None and record.status == "finished"
    if finished and not force_eval and _has_undelivered(run_path):
        from flows.cli.sync import sync_run

        sync_run(run_path, wait=None)  # all a finished run can lack: its tracking server's copy
        return
    if finished and not force_eval:
        # nothing to redo, and nothing of its record (MLflow, run.json) is touched
        console.print(
            f"[bold]bhfl[/] {run_path} finished; nothing to resume (--force-eval evaluates it again)", highlight=False
        )
        return
    if force_eval and not finished:
        fail(f"{run_path} is not finished: `bhfl resume {run_path}` finishes it, evaluation included")
    console.print(f"[bold]bhfl[/] {'re-evaluating' if force_eval else 'resuming'} {run_path} ...", highlight=False)
    from flows.cli.prefect_link import flow_run_link
    from flows.experiment import resume_experiment
    from flows.progress import RichReporter

    try:
        with prefect_api(run_dir, full=False, resume=run_path) as api:
            api()
            with flow_run_link(console, api.own, run_path), RichReporter(console).attached():
                result = guarded(
                    lambda: resume_experiment(run_path, overrides=overrides, force_eval=force_eval), run_path, verbose
                )
    except ConfigError as exc:
        fail(str(exc))
    _print_summary(result, run_dir)
    _exit_if_undelivered(result)


@app.command(cls=_Command)
def sync(
    run_spec: Annotated[
        str,
        typer.Argument(
            metavar="RUN",
            help="Run folder, <name>/<stamp>, `latest` or an MLflow run id (full or a unique 8+ character prefix).",
        ),
    ],
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    wait: Annotated[
        float | None,
        typer.Option(
            "--wait",
            metavar="SECONDS",
            show_default="$BHFL_TRACKING_WAIT_S, else 120",
            help="How long to wait for the tracking server to answer.",
        ),
    ] = None,
) -> None:
    """Deliver the MLflow tracking calls a run kept because its tracking server was down (exit 3 if some are left)."""
    prepare_environment(run_dir, verbose=False)
    from flows.cli.sync import sync_run
    from flows.records.listing import resolve_run
    from flows.records.run_state import RunStateError

    try:
        run_path = resolve_run(run_spec, run_dir)
    except RunStateError as exc:
        fail(str(exc))
    sync_run(run_path, wait)


@app.command(cls=_Command)
def export(
    run_spec: Annotated[
        str,
        typer.Argument(
            metavar="RUN",
            help="Run folder, <name>/<stamp>, `latest` or an MLflow run id (full or a unique 8+ character prefix).",
        ),
    ],
    to: Annotated[Path, typer.Option("--to", metavar="DIR", help="A new folder for the model and its tokenizer.")],
    node: Annotated[str, typer.Option("--node", metavar="NODE", help="Whose model: a server or a client id.")] = "root",
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
) -> None:
    """Write a node's final model in save_pretrained layout with its tokenizer (LoRA adapters merged in)."""
    prepare_environment(run_dir, verbose=False)
    from bhfl_core.config.base import ConfigError
    from flows.cli.export import export_model
    from flows.records.listing import resolve_run
    from flows.records.run_state import RunStateError

    try:
        written = export_model(resolve_run(run_spec, run_dir), node, to)
    except (RunStateError, ConfigError) as exc:
        fail(str(exc))
    out.print(f"{node}'s model and tokenizer: {written}  (load with from_pretrained)", highlight=False, soft_wrap=True)


def _has_undelivered(run_path: Path) -> bool:
    from flows.tracking.spool import pending_count

    return pending_count(run_path) > 0


def _exit_if_undelivered(result: dict) -> None:
    from flows.cli.sync import exit_if_undelivered

    exit_if_undelivered(result)


@app.command(cls=_Command)
def runs(
    run_spec: Annotated[
        str | None,
        typer.Argument(
            metavar="RUN",
            help="Show one run's plan (or a pipeline's stages) in detail: a run folder, <name>/<stamp>, `latest`, "
            "an MLflow run id (full or a unique prefix of 8+ characters) or a pipeline folder.",
        ),
    ] = None,
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    as_json: JsonOption = False,
) -> None:
    """List runs with their status (finished, failed at node X round Y, running) and what a resume would redo."""
    prepare_environment(run_dir, verbose=False)
    from bhfl_core.store.state_header import CheckpointError
    from flows.cli.pipeline import pipeline_entry, print_pipelines
    from flows.records.listing import find_runs, resolve_pipeline, resolve_run, run_entry, summarize
    from flows.records.run_state import RunStateError

    unreadable = (RunStateError, CheckpointError)  # a run folder's files, or a node checkpoint's header

    if run_spec is not None:
        try:
            pipeline = resolve_pipeline(run_spec, run_dir)
            if pipeline is not None:
                if as_json:
                    print_json([pipeline_entry(pipeline)])
                else:
                    print_pipelines(out, run_dir, only=pipeline)
                return
            path = resolve_run(run_spec, run_dir)
            summary = summarize(path)
        except unreadable as exc:
            fail(str(exc))
        if as_json:
            print_json([run_entry(summary, with_plan=True)])
            return
        out.print(
            f"[bold]{summary.name}[/] {path}\n  status: {summary.status} {summary.detail}\n"
            f"  a resume would redo: {summary.redo}\n  MLflow run id: {summary.mlflow_run_id or '-'}",
            highlight=False,
        )
        if (plan := summary.plan) is not None:
            out.print(f"  root rounds saved: {plan.root_done} of {plan.root_rounds}", highlight=False)
            for line in plan.lines:
                out.print(f"    {line}", highlight=False)
        return
    paths = find_runs(run_dir)
    if as_json:
        from flows.cli.pipeline import pipeline_entries

        entries = pipeline_entries(run_dir)
        for path in paths:
            try:
                entries.append(run_entry(summarize(path)))
            except unreadable as exc:
                entries.append(run_entry(None, path=path, error=str(exc)))
        print_json(entries)
        return
    print_pipelines(out, run_dir)  # pipelines first, then every run (stages included)
    if not paths:
        out.print(f"no runs under {run_dir}", highlight=False)
    colour = {"finished": "green", "running": "cyan", "failed": "red", "interrupted": "yellow"}
    for path in paths:  # one block per run: long error texts stay readable in a narrow terminal
        try:
            s = summarize(path)
        except unreadable as exc:
            out.print(f"{path}  unreadable: {exc}", highlight=False)
            continue
        started = datetime.fromtimestamp(s.started).strftime("%Y-%m-%d %H:%M")
        out.print(
            f"[bold]{s.name}/{path.name}[/]  [{colour.get(s.status, 'white')}]{s.status}[/]  "
            f"started {started}  MLflow run {s.mlflow_run_id or '-'}",
            highlight=False,
        )
        if s.detail:
            out.print(f"    {s.detail}", highlight=False)
        if s.status != "finished":
            out.print(f"    a resume would redo: {s.redo}", highlight=False)


@app.command(cls=_Command)
def serve(
    config: Annotated[
        Path, typer.Argument(metavar="CONFIG", help="Experiment YAML, or a sweep YAML (docs/sweeps.md).")
    ] = DEFAULT_CONFIG,
    cron: Annotated[str, typer.Option(help='Cron schedule, e.g. "0 2 * * *" (every day at 02:00).')] = "0 2 * * *",
    name: Annotated[str | None, typer.Option(show_default="the config's name", help="Deployment name.")] = None,
    set_: SetOption = [],
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    tracking_uri: TrackingOption = None,
) -> None:
    """Serve the experiment (or a sweep file's experiments) as a scheduled Prefect deployment (runnable from its UI).

    Takes an experiment YAML (deployment bhfl-experiment/NAME) or a sweep YAML (deployment bhfl-sweep/NAME).
    """
    from flows.cli.sweep import is_sweep_file, serve_sweep_command

    if is_sweep_file(config):
        serve_sweep_command(config, cron, name, set_, run_dir, tracking_uri)
        return
    cfg = load_config(config, set_)
    from bhfl_core.config.schema import dump
    from flows.records.run_record import default_tracking_uri
    from flows.serve import serve_experiment

    uri = tracking_uri or default_tracking_uri(run_dir)
    deployment = name or cfg.name
    serve_on_schedule(
        run_dir,
        cron,
        f"bhfl-experiment/{deployment}",
        "",
        lambda: serve_experiment(dump(cfg), cron, deployment, run_dir.resolve(), uri),
    )


def _print_summary(result: dict, run_dir: Path) -> None:
    """The end of a run, on stdout: the headline table, where everything went, how to open it."""
    from rich.table import Table

    table = Table(title="Final evaluation", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in result["headline"].items():
        table.add_row(name, f"{value:.4g}")
    out.print(table, soft_wrap=False)
    uri = result["tracking_uri"]
    out.print(
        f"\n[bold green]done[/] in {result['wall_time_s']:.0f} s\n"
        f"  run files (node models, optimiser states): {result['run_path']}\n"
        f"  MLflow store: {uri}\n"
        f"  MLflow run id: {result['run_id']}  (evaluation matrix: artefact eval/matrix.csv)\n"
        f"  report: {Path(result['run_path']) / 'report' / 'report.html'}  "
        "(artefacts report.html with the figures inline, report.md; tables and figures in eval/)\n"
        + open_ui(uri, run_dir, result["experiment_id"], result["run_id"]),
        highlight=False,
    )


def _bind_error(host: str, port: int) -> OSError | None:
    """Why a server could not listen on ``host:port`` now (None: it could), checked the way servers bind."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return OSError(exc.errno, exc.strerror)
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn/gunicorn do: TIME_WAIT is no clash
        try:
            probe.bind(address)
        except OSError as exc:
            return exc
    return None


@app.command(cls=_Command)
def ui(
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    tracking_uri: TrackingOption = None,
    port: Annotated[int, typer.Option(help="Port to serve on.")] = 5000,
    host: Annotated[
        str, typer.Option(help="Interface to bind; keep 127.0.0.1 unless you mean to expose it.")
    ] = "127.0.0.1",
) -> None:
    """Start the MLflow UI for a tracking store (bound to 127.0.0.1 by default)."""
    import errno

    from flows.records.run_record import default_tracking_uri

    uri = tracking_uri or default_tracking_uri(run_dir)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).exists():
        fail(f"no MLflow store at {uri}; run `bhfl run` first or pass --tracking-uri")
    if (error := _bind_error(host, port)) is not None:
        if error.errno == errno.EADDRINUSE:
            fail(
                f"port {port} on {host} is already in use (another `bhfl ui`, an MLflow server or another "
                f"program listens there), so the MLflow UI cannot start. Pick another port, e.g. "
                f"`bhfl ui --port {port + 1}` and browse http://{host}:{port + 1}, or stop the program that "
                f"holds it (`ss -ltnp 'sport = :{port}'` shows which)."
            )
        fail(
            f"cannot serve the MLflow UI on {host}:{port}: {error.strerror or error}. Pick another "
            "interface with --host (127.0.0.1 is this machine only) or another port with --port."
        )
    console.print(
        f"MLflow UI for {uri} on http://{host}:{port}  (Ctrl-C to stop; open 'Training runs' of your experiment)",
        highlight=False,
    )
    from flows.services.processes import serve_until_stopped

    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        uri,
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    raise typer.Exit(serve_until_stopped(cmd, env))  # SIGTERM, SIGHUP and Ctrl-C stop the server and its uvicorn


@app.command(cls=_Command)
def compare(
    runs: Annotated[
        list[str],
        typer.Argument(
            metavar="RUN_OR_EXPERIMENT",
            help="Experiment run ids (full, or a unique prefix of 8+ characters), or experiment names "
            "(their latest finished run; every finished run with --all).",
        ),
    ],
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    tracking_uri: TrackingOption = None,
    csv_path: Annotated[
        Path | None,
        typer.Option("--csv", metavar="FILE", show_default="RUN_DIR/compare.csv", help="Write the table as CSV here."),
    ] = None,
    target: Annotated[
        float | None,
        typer.Option("--target", help="Also show the virtual time at which the root first reached this on the union."),
    ] = None,
    every: Annotated[
        bool,
        typer.Option(
            "--all", metavar=FLAG, help="An experiment name stands for all its finished runs, not only the latest."
        ),
    ] = False,
    by_config: Annotated[
        bool,
        typer.Option(
            "--by-config",
            metavar=FLAG,
            help="One row per config over its seeds: mean ± std and 95% interval per number, n seeds. "
            "An experiment name then stands for all its finished runs.",
        ),
    ] = False,
    baseline: Annotated[
        str | None,
        typer.Option(
            "--baseline",
            metavar="CONFIG",
            help="Also paired differences (same seeds) of every config against this one: its label, name or a "
            "run id (implies --by-config; CSV beside --csv, *_paired.csv).",
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Compare runs side by side (markdown or JSON on stdout, CSV on disk): per-client, root and communication numbers.

    --by-config and --baseline aggregate seeds: mean ± std and 95% interval per config, paired differences.
    """
    from flows.records.run_record import default_tracking_uri

    uri = tracking_uri or default_tracking_uri(run_dir)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).exists():
        fail(f"no MLflow store at {uri}; run `bhfl run` first or pass --tracking-uri")
    from mlflow import MlflowClient

    from bhfl_core.store.atomic import write_text_atomic
    from flows.cli.compare import CompareError, rows_json, to_csv, to_markdown
    from flows.cli.compare import compare as compare_runs

    csv_out = csv_path or run_dir / "compare.csv"
    if by_config or baseline is not None:
        from flows.cli.compare import by_config_csv, by_config_json, by_config_markdown, compare_by_config, paired_csv

        try:
            result = compare_by_config(MlflowClient(uri), runs, target, baseline)
        except CompareError as exc:
            fail(str(exc))
        write_text_atomic(csv_out, by_config_csv(result, target))
        written = [csv_out]
        if result.baseline is not None:
            written.append(csv_out.with_name(f"{csv_out.stem}_paired{csv_out.suffix or '.csv'}"))
            write_text_atomic(written[-1], paired_csv(result, target))
        if as_json:
            print_json(by_config_json(result, target))
        else:
            print(by_config_markdown(result, target))
        left_out = f"; older runs of the same config and seed left out: {' '.join(result.superseded)}"
        console.print(
            f"\n{len(result.rows)} run(s) in {len(result.groups)} config(s)"
            f"{left_out if result.superseded else ''}; CSV written to {', '.join(map(str, written))}",
            highlight=False,
        )
        return
    try:
        rows = compare_runs(MlflowClient(uri), runs, target, every=every)
    except CompareError as exc:
        fail(str(exc))
    write_text_atomic(csv_out, to_csv(rows, target))
    if as_json:
        print_json(rows_json(rows, target))
    else:
        print(to_markdown(rows, target))
    console.print(f"\n{len(rows)} run(s) compared; CSV written to {csv_out}", highlight=False)


if __name__ == "__main__":
    app()
