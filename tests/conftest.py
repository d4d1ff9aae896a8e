"""Suite-wide settings: no hub access, quiet libraries. Prefect starts only in tests/flows."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")

FLOWS = Path(__file__).resolve().parent / "flows"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The fast lane (``-m "not integration"``) does not collect tests/flows at all.

    Every test there is integration (its conftest starts a Prefect server for the session), so
    this only saves importing Prefect, MLflow and Dask (several seconds) to deselect them.
    """
    if (
        collection_path.name == "flows"
        and collection_path.resolve() == FLOWS
        and " ".join(config.getoption("markexpr").split()) == "not integration"
    ):
        return True
    return None
