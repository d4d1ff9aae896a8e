"""The ``bhfl`` command line: run an experiment, prepare its data, open the MLflow UI.

Heavy imports (prefect, mlflow, torch) happen inside commands, after the environment
for them is set, so ``bhfl --help`` is instant and Prefect picks up the run folder's
settings.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    help="Bidirectional Hierarchical Federated Learning experiments on Prefect + MLflow.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)

if TYPE_CHECKING:
    from bhfl_core.config.schema import ExperimentConfig
    from tasks.local_cluster import ClusterStart

DEFAULT_CONFIG = Path("configs/embedded.yaml")
DEFAULT_RUN_DIR = Path("runs")

RunDirOption = Annotated[
    Path, typer.Option("--run-dir", help="Folder for run files, the data cache and the default MLflow store.")
]
TrackingOption = Annotated[
    str | None,
    typer.Option(
        "--tracking-uri",
        envvar="MLFLOW_TRACKING_URI",
        help="MLflow tracking URI [default: $MLFLOW_TRACKING_URI, else sqlite:///RUN_DIR/mlflow.db]",
    ),
]


def _fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


def _load_config(path: Path, overrides: list[str]) -> ExperimentConfig:
    """The validated config, or a one-line error naming the key (exit 2) before anything starts."""
    from bhfl_core.config.base import ConfigError
    from bhfl_core.config.loader import load_config

    try:
        return load_config(path, overrides)
    except ConfigError as exc:
        _fail(str(exc))
        raise  # unreachable: _fail exits


def _prepare_environment(run_dir: Path, verbose: bool) -> None:
    """Defaults for Prefect and HF libraries, set before they are imported; user settings win."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if "PREFECT_API_URL" not in os.environ:
        os.environ.setdefault("PREFECT_HOME", str((run_dir / ".prefect").resolve()))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # a brand-new Prefect database migrates on first start: allow for a slow, loaded machine
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    # Failures reach the user as one paragraph (flows/cli/errors.py); Prefect's console copy of
    # the traceback is noise then. Its API handler still sends the logs to the Prefect UI.
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "INFO" if verbose else "CRITICAL")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
    _limit_malloc_arenas()


def _limit_malloc_arenas(arenas: int = 2) -> None:
    """Fewer glibc malloc arenas here and in every process started from here.

    Prefect, MLflow and the Dask client run dozens of threads; glibc gives each busy
    thread its own arena (up to 8 per core), and freed model buffers stay spread over
    them. Two arenas cut the orchestrator's peak memory by ~20% (measured on the default
    run) at no measurable cost. Children read ``MALLOC_ARENA_MAX`` at start-up; this
    process, already running, is told through ``mallopt``. A user's setting wins.
    """
    if "MALLOC_ARENA_MAX" in os.environ or not sys.platform.startswith("linux"):
        return
    os.environ["MALLOC_ARENA_MAX"] = str(arenas)
    import ctypes

    m_arena_max = -8  # glibc's malloc.h
    with contextlib.suppress(OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
        ctypes.CDLL(None).mallopt(m_arena_max, arenas)


@app.command()
def run(
    config: Annotated[Path, typer.Argument(help="Experiment YAML.")] = DEFAULT_CONFIG,
    set_: Annotated[
        list[str],
        typer.Option("--set", help="Override a config key by dotted path, e.g. --set tree.root.rounds=2 (repeatable)."),
    ] = [],
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    tracking_uri: TrackingOption = None,
    resume_run: Annotated[
        str | None, typer.Option("--resume", help="Continue this run instead (same as `bhfl resume RUN`).")
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show Prefect's run logs.")] = False,
) -> None:
    """Run an experiment: prepare data, train the tree, evaluate every node, log to MLflow."""
    if resume_run is not None:
        _resume(resume_run, set_, run_dir, verbose)
        return
    _prepare_environment(run_dir, verbose)
    cfg = _load_config(config, set_)
    from tasks.local_cluster import likely_cpu_workers, start_forkserver

    if cfg.runtime.executor == "local" and likely_cpu_workers(cfg.runtime):
        start_forkserver()  # local workers' imports (torch, transformers) start now, beside ours
    from flows.records.run_record import new_run_path

    run_path = new_run_path(run_dir.resolve(), cfg.name)
    # the Prefect server and the workers boot while the model/data check runs and the pipeline is imported
    with _prefect_api(run_dir, full=False) as prefect_ready, _local_cluster(cfg, run_path) as cluster:
        _preflight(cfg, run_dir)
        console.print(
            f"[bold]bhfl[/] running [cyan]{cfg.name}[/] from {config} (seed {cfg.seed}); starting workers, "
            "Prefect and MLflow ...",
            highlight=False,
        )
        from flows.experiment import run_experiment
        from flows.progress import RichReporter
        from flows.records.run_record import default_tracking_uri
        from flows.tracking.tracker import Tracker

        uri = tracking_uri or default_tracking_uri(run_dir.resolve())
        store = threading.Thread(target=Tracker, args=(uri,), daemon=True)  # MLflow opens its store meanwhile
        store.start()
        prefect_ready()
        store.join()
        with RichReporter(console).attached():
            result = _guarded(
                lambda: run_experiment(
                    cfg, run_dir, uri, run_path=run_path, cluster=cluster.address() if cluster else None
                ),
                run_path,
                verbose,
            )
    _print_summary(result, run_dir)


@contextmanager
def _local_cluster(cfg: ExperimentConfig, run_path: Path) -> Iterator[ClusterStart | None]:
    """The run's local Dask cluster (``runtime.executor: local``), starting in the background; stopped at the end."""
    if cfg.runtime.executor != "local":
        yield None
        return
    from tasks.local_cluster import ClusterStart

    starting = ClusterStart(cfg.runtime, run_path)
    try:
        yield starting
    finally:
        starting.close()


def _preflight(cfg: object, run_dir: Path) -> None:
    """Model and (unless cached) data reachable? Checked before Prefect starts: one paragraph, exit 2."""
    from bhfl_core.config.base import ConfigError
    from data_prep.prepare import preflight

    try:
        preflight(cfg, run_dir / "cache")  # type: ignore[arg-type]
    except ConfigError as exc:
        _fail(str(exc))


@app.command()
def prepare(
    config: Annotated[Path, typer.Argument(help="Experiment YAML.")] = DEFAULT_CONFIG,
    set_: Annotated[list[str], typer.Option("--set", help="Override a config key by dotted path (repeatable).")] = [],
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show Prefect's run logs.")] = False,
) -> None:
    """Prepare (or reuse) an experiment's data: load, partition, tokenise, cache; print the partition report."""
    cfg = _load_config(config, set_)
    _prepare_environment(run_dir, verbose)
    _preflight(cfg, run_dir)
    from prefect.settings import temporary_settings

    from flows.data import run_prepare
    from flows.progress import RichReporter

    def work() -> dict:
        with temporary_settings(updates={"flows.heartbeat_frequency": None}), RichReporter(console).attached():
            return {"prepared": run_prepare(cfg, (run_dir / "cache").resolve())}

    prepared = _guarded(work, None, verbose)["prepared"]
    report = prepared.report_dir / "partition.md"
    print(report.read_text() if report.exists() else "")
    state = "cache hit (no tokenisation)" if prepared.cached else "prepared"
    console.print(
        f"[bold green]{state}[/] in {prepared.seconds:.2f} s: {prepared.root}\n"
        f"  manifest: {prepared.root / 'manifest.json'}\n  plots: {prepared.report_dir}",
        highlight=False,
    )


@app.command()
def resume(
    run_spec: Annotated[
        str, typer.Argument(metavar="RUN", help="Run folder, <name>/<stamp>, `latest`, or MLflow run id.")
    ],
    set_: Annotated[
        list[str], typer.Option("--set", help="Change runtime.* or eval.batch_size only (they do not change results).")
    ] = [],
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show Prefect's run logs.")] = False,
) -> None:
    """Continue a failed or killed run: finished nodes and rounds are kept, the rest runs, results are identical."""
    _resume(run_spec, set_, run_dir, verbose)


def _resume(run_spec: str, overrides: list[str], run_dir: Path, verbose: bool) -> None:
    _prepare_environment(run_dir, verbose)  # before anything imports prefect
    from bhfl_core.config.base import ConfigError
    from flows.records.listing import resolve_run
    from flows.records.run_state import RunStateError

    try:
        run_path = resolve_run(run_spec, run_dir)
    except RunStateError as exc:
        _fail(str(exc))
    console.print(f"[bold]bhfl[/] resuming {run_path} ...", highlight=False)
    from flows.experiment import resume_experiment
    from flows.progress import RichReporter

    try:
        with _prefect_api(run_dir, full=False) as prefect_ready, RichReporter(console).attached():
            prefect_ready()
            result = _guarded(lambda: resume_experiment(run_path, overrides=overrides), run_path, verbose)
    except ConfigError as exc:
        _fail(str(exc))
    _print_summary(result, run_dir)


@contextmanager
def _prefect_api(run_dir: Path, full: bool) -> Iterator[Callable[[], None]]:
    """``$PREFECT_API_URL`` if set, else a Prefect server of this command's own that dies with it.

    (Prefect's own temporary server would outlive a killed run and hold its database.)
    ``full``: ``prefect server start`` with UI and scheduler, for ``bhfl serve``. The
    server boots in the background: call the function this yields before the first
    Prefect request (it waits until the server answers).
    """
    if "PREFECT_API_URL" in os.environ:
        yield lambda: None
        return
    from flows.services.prefect_server import start_server

    server = start_server(run_dir.resolve() / ".prefect" / "server.log", full=full, port=4200 if full else None)
    os.environ["PREFECT_API_URL"] = server.api_url
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `kill`: stop the server too
    try:
        yield server.wait_healthy
    finally:
        signal.signal(signal.SIGTERM, previous)
        if "prefect.logging.handlers" in sys.modules:  # send the last logs while the server still listens
            from prefect.logging.handlers import APILogHandler

            APILogHandler().flush()
        server.stop()
        os.environ.pop("PREFECT_API_URL", None)


def _guarded(work: Callable[[], dict], run_path: Path | None, verbose: bool) -> dict:
    """Run ``work``; known failures become one paragraph (cause, fix, how to resume) and a non-zero exit."""
    from flows.cli.errors import explain, resume_hint

    try:
        return work()
    except KeyboardInterrupt:
        console.print(f"\n[bold yellow]interrupted.[/] {resume_hint(run_path)}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=130) from None
    except Exception as exc:
        message = explain(exc, run_path)
        if message is None or verbose:
            raise
        from bhfl_core.config.base import ConfigError

        console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2 if isinstance(exc, ConfigError) else 1) from None


@app.command()
def runs(
    run_spec: Annotated[str | None, typer.Argument(metavar="[RUN]", help="Show one run's plan in detail.")] = None,
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
) -> None:
    """List runs with their status (finished, failed at node X round Y, running) and what a resume would redo."""
    _prepare_environment(run_dir, verbose=False)
    from flows.records.listing import find_runs, progress, resolve_run, summarize
    from flows.records.run_state import RunStateError

    out = Console(soft_wrap=True)  # the listing is this command's output: stdout

    if run_spec is not None:
        try:
            path = resolve_run(run_spec, run_dir)
            summary, plan = summarize(path), progress(path)
        except RunStateError as exc:
            _fail(str(exc))
        out.print(
            f"[bold]{summary.name}[/] {path}\n  status: {summary.status} {summary.detail}\n"
            f"  a resume would redo: {summary.redo}",
            highlight=False,
        )
        if plan is not None:
            out.print(f"  root rounds saved: {plan.root_done} of {plan.root_rounds}", highlight=False)
            for line in plan.lines:
                out.print(f"    {line}", highlight=False)
        return
    paths = find_runs(run_dir)
    if not paths:
        out.print(f"no runs under {run_dir}", highlight=False)
    colour = {"finished": "green", "running": "cyan", "failed": "red", "interrupted": "yellow"}
    for path in paths:  # one block per run: long error texts stay readable in a narrow terminal
        try:
            s = summarize(path)
        except RunStateError as exc:
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


@app.command()
def serve(
    config: Annotated[Path, typer.Argument(help="Experiment YAML.")] = DEFAULT_CONFIG,
    cron: Annotated[str, typer.Option(help='Cron schedule, e.g. "0 2 * * *" (every day at 02:00).')] = "0 2 * * *",
    name: Annotated[str | None, typer.Option(help="Deployment name [default: the config's name].")] = None,
    set_: Annotated[list[str], typer.Option("--set", help="Override a config key by dotted path (repeatable).")] = [],
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    tracking_uri: TrackingOption = None,
) -> None:
    """Serve the experiment as a scheduled Prefect deployment (also runnable from the Prefect UI)."""
    cfg = _load_config(config, set_)
    try:
        from prefect.client.schemas.schedules import CronSchedule

        CronSchedule(cron=cron)
    except ValueError as exc:
        _fail(f"--cron {cron!r}: not a valid cron expression ({exc})")
    _prepare_environment(run_dir, verbose=False)
    from bhfl_core.config.schema import dump
    from flows.records.run_record import default_tracking_uri

    uri = tracking_uri or default_tracking_uri(run_dir)
    deployment = name or cfg.name
    if "PREFECT_API_URL" not in os.environ:
        console.print("no PREFECT_API_URL: starting a local Prefect server with its UI (schedules need one) ...")
    with _prefect_api(run_dir, full=True) as prefect_ready:
        from flows.serve import serve_experiment

        prefect_ready()
        ui_url = os.environ["PREFECT_API_URL"].removesuffix("/api")
        console.print(
            f"serving [cyan]bhfl-experiment/{deployment}[/] on cron {cron!r}; Prefect UI {ui_url} "
            f"(trigger a run there or `prefect deployment run bhfl-experiment/{deployment}`); Ctrl-C stops",
            highlight=False,
            soft_wrap=True,
        )
        serve_experiment(dump(cfg), cron, deployment, run_dir.resolve(), uri)


def _print_summary(result: dict, run_dir: Path) -> None:
    table = Table(title="Final evaluation", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in result["headline"].items():
        table.add_row(name, f"{value:.4g}")
    console.print(table)
    uri = result["tracking_uri"]
    ui_cmd = ".venv/bin/bhfl ui" + ("" if run_dir == DEFAULT_RUN_DIR else f" --run-dir {run_dir}")
    if os.environ.get("MLFLOW_TRACKING_URI") or not uri.startswith("sqlite:///"):
        ui_cmd = f".venv/bin/bhfl ui --tracking-uri {uri}"
    console.print(
        f"\n[bold green]done[/] in {result['wall_time_s']:.0f} s\n"
        f"  run files (node models, optimiser states): {result['run_path']}\n"
        f"  MLflow store: {uri}\n"
        f"  MLflow run id: {result['run_id']}  (evaluation matrix: artefact eval/matrix.csv)\n"
        f"  report: {Path(result['run_path']) / 'report' / 'report.md'}  "
        "(artefact report.md; tables and figures in eval/)\n"
        f"  open the UI:  {ui_cmd}   then browse "
        f"http://127.0.0.1:5000/#/experiments/{result['experiment_id']}/runs/{result['run_id']}",
        highlight=False,
    )


@app.command()
def ui(
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    tracking_uri: TrackingOption = None,
    port: Annotated[int, typer.Option(help="Port to serve on.")] = 5000,
    host: Annotated[
        str, typer.Option(help="Interface to bind; keep 127.0.0.1 unless you mean to expose it.")
    ] = "127.0.0.1",
) -> None:
    """Start the MLflow UI for a tracking store (bound to 127.0.0.1 by default)."""
    from flows.records.run_record import default_tracking_uri

    uri = tracking_uri or default_tracking_uri(run_dir)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).exists():
        _fail(f"no MLflow store at {uri}; run `bhfl run` first or pass --tracking-uri")
    console.print(
        f"MLflow UI for {uri} on http://{host}:{port}  (Ctrl-C to stop; open 'Training runs' of your experiment)"
    )
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
    raise typer.Exit(subprocess.call(cmd, env=env))


@app.command()
def compare(
    runs: Annotated[
        list[str], typer.Argument(help="Experiment run ids, or experiment names (their latest finished run).")
    ],
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    tracking_uri: TrackingOption = None,
    csv_path: Annotated[
        Path | None, typer.Option("--csv", help="Write the table as CSV here [default: RUN_DIR/compare.csv].")
    ] = None,
) -> None:
    """Compare runs side by side (markdown on stdout, CSV on disk): per-client, root and communication numbers."""
    from flows.records.run_record import default_tracking_uri

    uri = tracking_uri or default_tracking_uri(run_dir)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).exists():
        _fail(f"no MLflow store at {uri}; run `bhfl run` first or pass --tracking-uri")
    from mlflow import MlflowClient

    from bhfl_core.store.atomic import write_text_atomic
    from flows.cli.compare import CompareError, to_csv, to_markdown
    from flows.cli.compare import compare as compare_runs

    try:
        rows = compare_runs(MlflowClient(uri), runs)
    except CompareError as exc:
        _fail(str(exc))
    target = csv_path or run_dir / "compare.csv"
    write_text_atomic(target, to_csv(rows))
    print(to_markdown(rows))
    console.print(f"\n{len(rows)} run(s) compared; CSV written to {target}", highlight=False)


if __name__ == "__main__":
    app()
