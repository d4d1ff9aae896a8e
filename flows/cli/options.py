"""The options and arguments ``bhfl`` commands share, so each is written (and documented) once, and how a
RUN given as a folder path sets the default ``--run-dir``.

Typer shows a value type beside every option; flags take no value, so they set
``metavar=FLAG`` (empty) and ``Command`` does the same for typer's own flags.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption

# flags take no value: metavar="" keeps typer from showing a <bool> value type beside them
FLAG = ""
DEFAULT_CONFIG = Path("configs/embedded.yaml")
DEFAULT_RUN_DIR = Path("runs")


def _flags_without_type(params: list[Any]) -> list[Any]:
    """Typer shows a value type beside every option, ``<bool>`` beside flags that take no value; ``metavar=""``
    hides it. Ours set it (``FLAG``); this does it for typer's own (``--help``, ``--install-completion``)."""
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = FLAG
    return params


class Command(TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:
        return _flags_without_type(super().get_params(ctx))


class Group(TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _flags_without_type(super().get_params(ctx))


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
    typer.Option("--json", metavar=FLAG, help="Print the result as JSON on stdout (keys: docs/cli.md)."),
]
SetOption = Annotated[
    list[str],
    typer.Option("--set", metavar="KEY=VALUE", help="Override a config key by dotted path (repeatable)."),
]
RunSpecArgument = Annotated[
    str,
    typer.Argument(
        metavar="RUN",
        help="Run folder, <name>/<stamp>, `latest` or an MLflow run id (full or a unique 8+ character prefix).",
    ),
]


def ensure_run_dir(run_dir: Path, create: bool) -> None:
    """Make ``run_dir`` (``create``), or only check that it could be made; NotADirectoryError (or the
    FileExistsError of ``mkdir``) when it, or a folder above it, is a file."""
    if create:
        run_dir.mkdir(parents=True, exist_ok=True)
        return
    nearest = next(p for p in (run_dir.absolute(), *run_dir.absolute().parents) if p.exists())
    if not nearest.is_dir():
        raise NotADirectoryError(run_dir)


def runs_folder_of(run_spec: str | None, run_dir: Path) -> Path:
    """The runs folder a RUN typed as a folder path lives in, when ``--run-dir`` is left at its default.

    Every run, sweep and pipeline folder is ``<runs folder>/<name>/<stamp>`` (its resume reads
    its MLflow store and data cache there already): ``bhfl resume /data/runs/x/<stamp>`` typed
    in another folder uses that runs folder's Prefect home rather than creating ``./runs``.
    """
    from bhfl_core.store.run_layout import CONFIG_FILE
    from flows.records.pipeline_record import PIPELINE_CONFIG
    from flows.records.sweep_record import SWEEP_CONFIG

    if run_spec is None or run_dir != DEFAULT_RUN_DIR:
        return run_dir
    folder = Path(run_spec).expanduser()
    if not any((folder / name).is_file() for name in (CONFIG_FILE, SWEEP_CONFIG, PIPELINE_CONFIG)):
        return run_dir
    runs = folder.resolve().parents[1]
    return run_dir if runs == run_dir.resolve() else runs
