"""What every benchmark script sets before importing the pipeline: offline, quiet, patient."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",  # a new Prefect database migrates first
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def offline_quiet() -> None:
    """Set the defaults above (the caller's own settings win)."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)


def config_args(doc: str) -> argparse.Namespace:
    """``[CONFIG] [--set KEY=VALUE ...]`` as ``bhfl run`` takes them (CONFIG: the embedded default)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("config", nargs="?", default=str(REPO / "configs" / "embedded.yaml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    return parser.parse_args()


def add_set_option(parser: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE`` (repeatable): a bhfl config override passed through to every bhfl run."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra bhfl config override (repeatable), e.g. runtime.workers=1",
    )
