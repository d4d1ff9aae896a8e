"""The ``bhfl`` command line: run an experiment, open the MLflow UI.

Heavy imports (prefect, mlflow, torch) happen inside commands, after the environment
for them is set, so ``bhfl --help`` is instant and Prefect picks up the run folder's
settings.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Optional

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

DEFAULT_CONFIG = Path("configs/embedded.yaml")
DEFAULT_RUN_DIR = Path("runs")

RunDirOption = Annotated[Path, typer.Option("--run-dir", help="Folder for run files, the data cache and the default MLflow store.")]
TrackingOption = Annotated[
    Optional[str],
    typer.Option("--tracking-uri", envvar="MLFLOW_TRACKING_URI",
                 help="MLflow tracking URI [default: $MLFLOW_TRACKING_URI, else sqlite:///RUN_DIR/mlflow.db]"),
]


def _fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


def _prepare_environment(run_dir: Path, verbose: bool) -> None:
    """Defaults for Prefect and HF libraries, set before they are imported; user settings win."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if "PREFECT_API_URL" not in os.environ:
        os.environ.setdefault("PREFECT_HOME", str((run_dir / ".prefect").resolve()))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # a brand-new Prefect database migrates on first start: allow for a slow, loaded machine
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")


@app.command()
def run(
    config: Annotated[Path, typer.Argument(help="Experiment YAML.")] = DEFAULT_CONFIG,
    set_: Annotated[list[str], typer.Option("--set", help="Override a config key by dotted path, e.g. --set tree.root.rounds=2 (repeatable).")] = [],
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    tracking_uri: TrackingOption = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show Prefect's run logs.")] = False,
) -> None:
    """Run an experiment: prepare data, train the tree, evaluate every node, log to MLflow."""
    from bhfl_core.config import ConfigError
    from bhfl_core.config_loader import load_config

    try:
        cfg = load_config(config, set_)
    except ConfigError as exc:
        _fail(str(exc))
    _prepare_environment(run_dir, verbose)
    console.print(f"[bold]bhfl[/] running [cyan]{cfg.name}[/] from {config} (seed {cfg.seed}); starting Prefect and MLflow ...")

    from flows.experiment import run_experiment
    from flows.progress import RichReporter

    result = run_experiment(cfg, run_dir, tracking_uri, RichReporter(console))
    _print_summary(result, run_dir)


def _print_summary(result: dict, run_dir: Path) -> None:
    table = Table(title="Final evaluation (accuracy)", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in result["headline"].items():
        table.add_row(name, f"{value:.4f}")
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
        f"  open the UI:  {ui_cmd}   then browse "
        f"http://127.0.0.1:5000/#/experiments/{result['experiment_id']}/runs/{result['run_id']}",
        highlight=False,
    )


@app.command()
def ui(
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    tracking_uri: TrackingOption = None,
    port: Annotated[int, typer.Option(help="Port to serve on.")] = 5000,
    host: Annotated[str, typer.Option(help="Interface to bind; keep 127.0.0.1 unless you mean to expose it.")] = "127.0.0.1",
) -> None:
    """Start the MLflow UI for a tracking store (bound to 127.0.0.1 by default)."""
    from flows.tracking import default_tracking_uri

    uri = tracking_uri or default_tracking_uri(run_dir)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
        _fail(f"no MLflow store at {uri}; run `bhfl run` first or pass --tracking-uri")
    console.print(f"MLflow UI for {uri} on http://{host}:{port}  (Ctrl-C to stop; open 'Training runs' of your experiment)")
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host", host, "--port", str(port), "--workers", "1"]
    raise typer.Exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    app()
