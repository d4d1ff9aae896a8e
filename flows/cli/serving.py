"""``bhfl serve`` and ``bhfl ui``: long-running servers a user starts and stops (a scheduled deployment, the
MLflow UI); they run until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from flows.cli.options import DEFAULT_CONFIG, DEFAULT_RUN_DIR, RunDirOption, SetOption, TrackingOption
from flows.cli.shell import console, fail, load_config, serve_on_schedule, ui_hint


def serve(
    config: Annotated[
        Path,
        typer.Argument(
            metavar="CONFIG",
            help="Experiment YAML, a sweep YAML (docs/sweeps.md) or a pipeline YAML (docs/pipelines.md).",
        ),
    ] = DEFAULT_CONFIG,
    cron: Annotated[str, typer.Option(help='Cron schedule, e.g. "0 2 * * *" (every day at 02:00).')] = "0 2 * * *",
    name: Annotated[str | None, typer.Option(show_default="the config's name", help="Deployment name.")] = None,
    set_: SetOption = [],
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    tracking_uri: TrackingOption = None,
) -> None:
    """Serve an experiment, a sweep or a pipeline as a scheduled Prefect deployment (runnable from its UI).

    Deployment bhfl-experiment/NAME (an experiment YAML), bhfl-sweep/NAME (a sweep), bhfl-pipeline/NAME (a pipeline).
    """
    from flows.cli.pipeline import is_pipeline_file, serve_pipeline_command
    from flows.cli.sweep import is_sweep_file, serve_sweep_command

    if is_sweep_file(config):
        serve_sweep_command(config, cron, name, set_, run_dir, tracking_uri)
        return
    if is_pipeline_file(config):
        serve_pipeline_command(config, cron, name, set_, run_dir, tracking_uri)
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


def _address(host: str, port: int) -> str:
    """The UI's address to browse: an IPv6 host in brackets (``http://[::1]:5000``; ``http://::1:5000`` opens
    nothing)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def ui(
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    tracking_uri: TrackingOption = None,
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to serve on.")] = 5000,
    host: Annotated[
        str, typer.Option(help="Interface to bind; keep 127.0.0.1 unless you mean to expose it.")
    ] = "127.0.0.1",
) -> None:
    """Start the MLflow UI for a tracking store (bound to 127.0.0.1 by default)."""
    import errno

    from flows.records.run_record import default_tracking_uri
    from flows.tracking.links import is_tracking_server

    uri = tracking_uri or default_tracking_uri(run_dir)
    if is_tracking_server(uri):  # `mlflow server` takes stores, not servers: it died with a traceback on one
        fail(
            f"--tracking-uri {uri} is an MLflow tracking server, which serves its own UI: browse {uri.rstrip('/')} "
            "(bhfl ui serves a store: the run dir's sqlite:///RUN_DIR/mlflow.db, another database or a folder)"
        )
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).exists():
        fail(f"no MLflow store at {uri}; run `bhfl run` first or pass --tracking-uri")
    if (error := _bind_error(host, port)) is not None:
        if error.errno == errno.EADDRINUSE:  # the same store (and interface) on another port
            again = ui_hint(uri, run_dir) + ("" if host == "127.0.0.1" else f" --host {host}")
            fail(
                f"port {port} on {host} is already in use (another `bhfl ui`, an MLflow server or another "
                f"program listens there), so the MLflow UI cannot start. Pick another port, e.g. "
                f"`{again} --port {port + 1}` and browse {_address(host, port + 1)}, or stop the program that "
                f"holds it (`ss -ltnp 'sport = :{port}'` shows which)."
            )
        fail(
            f"cannot serve the MLflow UI on {host}:{port}: {error.strerror or error}. Pick another "
            "interface with --host (127.0.0.1 is this machine only) or another port with --port."
        )
    console.print(
        f"MLflow UI for {uri} on {_address(host, port)}  (Ctrl-C to stop; your experiment: Model training → Runs)",
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
