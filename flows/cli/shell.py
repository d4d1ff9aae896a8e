"""What every ``bhfl`` command shares: the console, clean failures, the environment, Prefect and workers.

Kept apart from the commands (flows/cli/app.py, flows/cli/pipeline.py) so that each
command module stays about its command. Heavy imports stay inside the functions.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape

from flows.cli.options import ensure_run_dir
from flows.cli.stopping import STOP

if TYPE_CHECKING:
    from bhfl_core.config.schema import ExperimentConfig
    from tasks.local_cluster import ClusterStart

# Progress, notes, warnings and errors go to stderr; a command's results (summary tables, listings,
# comparisons, JSON) to stdout (``out``), so `bhfl runs > runs.txt` or `bhfl compare ... --json | jq`
# capture the results alone. soft_wrap: rich never breaks a line itself (a path printed stays
# copy-pastable; the terminal folds long lines). Both consoles look up sys.stdout/sys.stderr when
# they print, so test runners that swap the streams see the output.
console = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)
STOP.say = lambda text: console.print(text, highlight=False, soft_wrap=True)


def print_json(data: object) -> None:
    """``data`` as JSON on stdout: plain text (no colour, no wrapping), one document, ending in a newline."""
    import json

    sys.stdout.write(json.dumps(data, indent=2, allow_nan=False) + "\n")
    sys.stdout.flush()


def command_of(script: str, module: str) -> str:
    """How to start ``script`` of this environment, as a user would type it where they stand.

    Hints print commands to copy: ``.venv/bin/bhfl`` is right for the README's set-up but
    not for bhfl installed in a conda environment or on the PATH. The script beside this
    interpreter, as ``bhfl`` when the shell finds that very file, relative when it lies
    under the working directory, absolute otherwise; without one (a bare checkout run
    with ``python -m``), this interpreter with ``-m module``.
    """
    import shlex
    import shutil

    beside = Path(sys.executable).with_name(script)
    if not beside.exists():
        return f"{shlex.quote(sys.executable)} -m {module}"
    found = shutil.which(script)
    if found is not None and Path(found).resolve() == beside.resolve():
        return script
    with contextlib.suppress(ValueError):
        return shlex.quote(str(beside.absolute().relative_to(Path.cwd())))
    return shlex.quote(str(beside.absolute()))


def ui_hint(uri: str, run_dir: Path) -> str:
    """The command that opens the MLflow UI on ``uri``, as a user would type it.

    A store that is not ``run_dir``'s own is named by its folder: ``bhfl resume RUN`` given a
    run folder under another run directory (the command its interruption prints, run from
    anywhere) keeps that run's store, and ``bhfl ui`` alone would open ``runs/``'s.
    """
    bhfl = command_of("bhfl", "flows.cli.main")
    if os.environ.get("MLFLOW_TRACKING_URI") or not uri.startswith("sqlite:///"):
        return f"{bhfl} ui --tracking-uri {uri}"
    db = Path(uri[len("sqlite:///") :])
    if db.name != "mlflow.db":
        return f"{bhfl} ui --tracking-uri {uri}"
    if db.resolve() != (run_dir / "mlflow.db").resolve():
        run_dir = db.parent
    return f"{bhfl} ui" + ("" if str(run_dir) == "runs" else f" --run-dir {run_dir}")


def open_ui(uri: str, run_dir: Path, experiment_id: str, run_id: str) -> str:
    """The summary's last lines: how to start the UI (a tracking server serves its own), the run's page, the
    experiment's runs side by side."""
    from flows.tracking.links import is_tracking_server, run_link, runs_link

    start = "the tracking server serves it," if is_tracking_server(uri) else f"{ui_hint(uri, run_dir)}  "
    return (
        f"  open the UI:  {start} then browse {run_link(uri, experiment_id, run_id)}\n"
        f"  every run of the experiment, headline metrics as columns: {runs_link(uri, experiment_id)}"
    )


def fail(message: str) -> None:
    """``message`` (plain text, not markup: ``'.[gpu]'`` or a list stays as written) in one line; exit 2."""
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


def load_config(path: Path, overrides: list[str]) -> ExperimentConfig:
    """The validated config, or a one-line error naming the key (exit 2) before anything starts."""
    from bhfl_core.config.base import ConfigError
    from bhfl_core.config.loader import load_config as load

    try:
        return load(path, overrides)
    except ConfigError as exc:
        from bhfl_core.config.pipeline import is_pipeline, read_pipeline_yaml

        with contextlib.suppress(ConfigError):
            if is_pipeline(read_pipeline_yaml(path)):
                fail(
                    f"{path} is a pipeline (top-level stages:): `bhfl run {path}` runs it; this command takes "
                    "one experiment config (docs/pipelines.md)"
                )
        fail(str(exc))
        raise  # unreachable: fail exits


def prepare_environment(run_dir: Path, verbose: bool, create: bool = True) -> None:
    """Defaults for Prefect and HF libraries, set before they are imported; user settings win. ``create``: make
    ``run_dir`` (False for a command that only reads: a listing or a refused lookup leaves no folder behind)."""
    try:
        ensure_run_dir(run_dir, create)
    except (FileExistsError, NotADirectoryError):  # the folder, or one above it, is a file (a config, say)
        fail(f"--run-dir {run_dir}: not a folder ({run_dir} or a folder above it is a file)")
    if "PREFECT_API_URL" not in os.environ:
        os.environ.setdefault("PREFECT_HOME", str((run_dir / ".prefect").resolve()))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # a brand-new Prefect database migrates on first start: allow for a slow, loaded machine
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    # Failures reach the user as one paragraph (flows/cli/errors.py); Prefect's console copy of
    # the traceback is noise then. Its API handler still sends the logs to the Prefect UI.
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "INFO" if verbose else "CRITICAL")
    # the run's progress (root and node rounds, notes) in each flow run's logs in the Prefect UI
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "bhfl.progress")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")  # notes before a flow starts
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
    if not verbose:  # a failure is told once, as one paragraph (flows/cli/errors.py), not by libraries on its way
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)  # logs each error it then raises
        logging.getLogger("datasets.packaged_modules.parquet.parquet").setLevel(logging.CRITICAL)  # the same
        logging.raiseExceptions = False  # a log handler's own failure (Prefect's API logs, its server down or full)
    limit_malloc_arenas()


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Fewer glibc malloc arenas in every process started from here (servers, workers); a user's setting wins.

    Prefect, MLflow and the Dask client run dozens of threads; glibc gives each busy
    thread its own arena (up to 8 per core), and freed model buffers stay spread over
    them. Two arenas cut the orchestrator's peak memory by ~20% (measured on the default
    run) at no measurable cost. Children read ``MALLOC_ARENA_MAX`` at start-up; this
    process, already running, was told at the command's start (``tasks/heap.py``).
    """
    if sys.platform.startswith("linux"):
        os.environ.setdefault("MALLOC_ARENA_MAX", str(arenas))


@contextmanager
def local_cluster(cfg: ExperimentConfig, run_path: Path) -> Iterator[ClusterStart | None]:
    """The run's local Dask cluster (``runtime.executor: local``), starting in the background; stopped at the end."""
    if cfg.runtime.executor != "local":
        yield None
        return
    from tasks.local_cluster import ClusterStart

    starting = ClusterStart(cfg.runtime)
    try:
        yield starting
    finally:
        starting.close()


def hub_check(cfg: ExperimentConfig, run_dir: Path, where: str = "") -> None:
    """A hub model or (uncached) dataset, and the hub unreachable? Seconds; before Prefect and the workers start.

    The full ``preflight`` runs beside their start-up; stopped there, the command would
    first wait for the workers to come up.
    """
    from bhfl_core.config.base import ConfigError
    from data_prep.cache_folder import data_cache_folder
    from data_prep.prepare import check_hub

    try:
        check_hub(cfg, data_cache_folder(run_dir))
    except ConfigError as exc:
        fail(f"{where}{exc}")


def preflight(cfg: ExperimentConfig, run_dir: Path, where: str = "") -> None:
    """Model and (unless cached) data reachable, a ``tls://`` cluster's certificates readable? Checked beside
    Prefect's start: one paragraph (after ``where``: which of a job's experiments), exit 2."""
    from bhfl_core.config.base import ConfigError
    from data_prep.cache_folder import data_cache_folder
    from data_prep.prepare import preflight

    try:
        preflight(cfg, data_cache_folder(run_dir))
        if cfg.model.quantization is not None and cfg.runtime.executor != "cluster":  # the workers are this machine
            from bhfl_core.learning.backbone_precision import check_quantization

            check_quantization(cfg.model.quantization)
        if cfg.runtime.executor == "cluster" and cfg.runtime.cluster:
            from tasks.cluster_access import security_for

            security_for(cfg.runtime.cluster, cfg.runtime)
    except ConfigError as exc:
        fail(f"{where}{exc}")


@dataclass(frozen=True)
class PrefectApi:
    """The Prefect API a command talks to; calling it waits until the API answers.

    ``own``: the command's own server (no UI unless ``full``; it stops with the command),
    else the user's ``$PREFECT_API_URL``.
    """

    wait: Callable[[], None]
    own: bool

    def __call__(self) -> None:
        self.wait()
        STOP.watch_prefect()  # before the command's first flow run


def how_to_go_on(resume: Path | None) -> str:
    """What to do after the command stopped early: resume the run, pipeline or sweep folder it left, or start
    it again."""
    if resume is None:
        return "Start the command again."
    if any((resume / name).exists() for name in ("config.yaml", "pipeline.json", "sweep.json")):
        return f"Nothing is lost (every finished node round is checkpointed): `bhfl resume {resume}` continues."
    return "Nothing was trained yet: run the command again."


def exit_if_stopped(ended: BaseException, line: str) -> None:
    """If the command was told to stop (flows/cli/stopping.py), whatever ``ended`` the work is the stop: say
    ``line`` (unless the command said how it stopped already) and exit 128 + the signal; else return."""
    if STOP.signal_of(ended) is None:
        return
    STOP.tell(line)
    raise typer.Exit(code=STOP.exit_code) from None


@contextmanager
def stopped_by_signals(resume: Path | None = None) -> Iterator[None]:
    """A stop (Ctrl-C, SIGTERM, SIGHUP) that comes outside the guarded work (start-up, the summary) ends here:
    one line, with how to go on from ``resume``, and exit 128 + the signal. (``guarded`` says "interrupted."
    for the work itself; the command's entry installed the handlers.)"""
    STOP.hint = lambda: how_to_go_on(resume)
    try:
        yield
    except BaseException as exc:
        name = signal.Signals(STOP.signal_of(exc) or signal.SIGTERM).name
        exit_if_stopped(exc, f"\n[bold yellow]stopped by {name}.[/] {how_to_go_on(resume)}")
        raise


EXIT_SERVER_DIED = 75  # EX_TEMPFAIL: try again later, here `bhfl resume` (docs/runtime.md, "Faults")


@contextmanager
def prefect_api(run_dir: Path, full: bool, resume: Path | None = None) -> Iterator[PrefectApi]:
    """``$PREFECT_API_URL`` if set, else a Prefect server of this command's own that dies with it.

    (Prefect's own temporary server would outlive a killed run and hold its database.)
    ``full``: ``prefect server start`` with UI and scheduler, for ``bhfl serve``. The
    server boots in the background: call what this yields before the first Prefect
    request (it waits until the server answers). A stop signal outside the guarded
    work ends the command here (``stopped_by_signals``). Should the server die under the command, the
    command stops at once (``server_died``); ``resume`` is the run, pipeline or sweep
    folder that ``bhfl resume`` then continues.
    """
    if "PREFECT_API_URL" in os.environ:  # checked now: before the job's MLflow store and folder are made
        with stopped_by_signals(resume):
            users_server_answers(os.environ["PREFECT_API_URL"], resume)
            yield PrefectApi(lambda: None, own=False)
        return
    from flows.services.prefect_server import start_server

    server = start_server(run_dir.resolve() / ".prefect" / "server.log", full=full, port=4200 if full else None)
    os.environ["PREFECT_API_URL"] = server.api_url
    server.watch(lambda code: server_died(server.proc.pid, code, server.log_file, resume))
    try:
        with stopped_by_signals(resume):
            yield PrefectApi(server.wait_healthy, own=True)
    finally:
        if "prefect.logging.handlers" in sys.modules:  # send the last logs while the server still listens
            from prefect.logging.handlers import APILogHandler

            APILogHandler().flush()
        server.stop()
        os.environ.pop("PREFECT_API_URL", None)


def users_server_answers(api_url: str, resume: Path | None) -> None:
    """A Prefect server of the user's (``PREFECT_API_URL``) that does not listen, or is no Prefect API: one line,
    exit 2, before the job's folder and MLflow store are made (the command's first Prefect call ended in a
    traceback, exit 1, and left them behind)."""
    from flows.services.prefect_server import unreachable

    if (problem := unreachable(api_url)) is not None:
        fail(
            f"PREFECT_API_URL is {api_url}: {problem}. Start that Prefect server (`prefect server start`), or unset "
            f"PREFECT_API_URL to have the command start one of its own. {how_to_go_on(resume)}"
        )


def server_died(pid: int, code: int, log_file: Path, resume: Path | None) -> None:
    """(The server's watcher thread.) The command's own Prefect server died: say so, and stop everything now.

    Every Prefect call from here on would fail after a minute of retries (each call's
    ConnectError is retried with backoff), and unwinding a flow makes several: so the
    command does not unwind. It ends the way a kill ends it, the path `bhfl resume` is
    built and tested for: its worker processes are killed, then the process exits with
    ``EXIT_SERVER_DIED`` (no cleanup of its own: the record of the run says
    "interrupted"). Restarting the server instead would leave the run's calls that were
    in flight in unknown states (docs/runtime.md, "Faults").
    """
    how = f"exit status {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"
    console.show_cursor(True)  # a live progress bar hid it
    STOP.end_now(
        f"error: the Prefect server this command started died (pid {pid}, {how}; its log: {log_file}). Without "
        "it nothing can be recorded in Prefect, so the command stops now. " + how_to_go_on(resume),
        code=EXIT_SERVER_DIED,
    )


def cron_problem(cron: str) -> str | None:
    """Why Prefect refuses ``cron`` as a schedule, in its words (None: it takes it); also six or seven fields.

    Prefect's croniter takes a sixth field as seconds and a seventh as the year, so one
    ``*`` too many (``0 2 * * * *``) would start a run every second from 02:00:00 to
    02:00:59: refused here, with the five fields spelt out. Imports Prefect, which reads
    its settings (``PREFECT_API_URL`` among them) once, when first imported: call it only
    once the command's Prefect API is in the environment.
    """
    from prefect.client.schemas.schedules import CronSchedule
    from pydantic import ValidationError

    fields = cron.split()
    if len(fields) > 5 and not cron.strip().startswith("@"):
        return f"{len(fields)} fields: Prefect reads a sixth as seconds, so this would start a run every second"
    try:
        CronSchedule(cron=cron)
    except ValidationError as exc:
        return "; ".join(str(error["msg"]).removeprefix("Value error, ") for error in exc.errors())
    return None


def serve_on_schedule(run_dir: Path, cron: str, deployment: str, note: str, serve: Callable[[], None]) -> None:
    """``bhfl serve``: bring up a Prefect API (schedules need a real server), check the cron, serve until Ctrl-C.

    ``deployment`` is ``<flow>/<name>``; ``note`` says what it runs (shown beside it).
    Prefect is imported only once ``PREFECT_API_URL`` names that server: imported before,
    it kept no API URL and, to register and poll the deployment, started a temporary
    server of its own on the same database beside the command's. The cron is checked
    while the server boots, before anything is registered.
    """
    prepare_environment(run_dir, verbose=False)
    own = "PREFECT_API_URL" not in os.environ
    with prefect_api(run_dir, full=True) as prefect_ready:
        if (problem := cron_problem(cron)) is not None:
            fail(
                f"--cron {cron!r}: not a valid cron expression ({problem}); five fields, minute hour day-of-month "
                'month day-of-week: "0 2 * * *" is every day at 02:00'
            )
        if own:
            console.print("no PREFECT_API_URL: starting a local Prefect server with its UI (schedules need one) ...")
        prefect_ready()
        api_url = os.environ["PREFECT_API_URL"]
        prefect = command_of("prefect", "prefect")
        trigger = f"PREFECT_API_URL={api_url} {prefect}" if own else prefect  # another shell must name this server
        console.print(
            f"serving [cyan]{deployment}[/]{note} on cron {cron!r}; Prefect UI {api_url.removesuffix('/api')} "
            f"(trigger a run there or `{trigger} deployment run {deployment}`); Ctrl-C stops",
            highlight=False,
            soft_wrap=True,
        )
        ended: BaseException | None = None
        try:
            serve()  # a stop signal: the runner unwinds and returns (flows/serve.py::serve_deployment)
        except BaseException as exc:
            ended = exc
            raise
        finally:
            if (signum := STOP.signal_of(ended)) is not None:
                STOP.tell(
                    f"\n[bold yellow]stopped by {signal.Signals(signum).name}.[/] A run it had started and not "
                    f"finished is interrupted, nothing of it lost: `bhfl runs --run-dir {run_dir}` lists it, `bhfl "
                    "resume RUN` continues it; the same `bhfl serve` serves the deployment again."
                )


def tracking_store_ready(
    run_dir: Path, tracking_uri: str | None, prefect_ready: Callable[[], None], module: str
) -> str:
    """Open the MLflow store (``tracking_uri`` or the run dir's) and import ``module`` (the job's flow) while Prefect
    finishes starting; the store's URI.

    Each takes seconds of CPU on a fresh machine, and the server's boot is what the first
    client training waits for: done beside it rather than after, a run starts sooner.
    """
    from flows.records.run_record import default_tracking_uri
    from flows.tracking.tracker import Tracker

    uri = tracking_uri or default_tracking_uri(run_dir.resolve())
    store = threading.Thread(target=Tracker, args=(uri,), daemon=True)
    store.start()
    importlib.import_module(module)
    prefect_ready()
    store.join()
    return uri


def guarded(work: Callable[[], dict], run_path: Path | None, verbose: bool) -> dict:
    """Run ``work``; known failures become one paragraph (cause, fix, how to resume) and a non-zero exit."""
    from flows.cli.errors import exit_code, explain

    try:
        return work()
    except BaseException as exc:
        exit_if_stopped(exc, f"\n[bold yellow]interrupted.[/] {how_to_go_on(run_path)}")
        if not isinstance(exc, Exception):
            raise
        message = explain(exc, run_path)
        if message is None or verbose:
            raise
        console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=exit_code(exc, run_path)) from None
