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


# scripts/test.sh runs the suite on 2 pytest-xdist workers (--dist loadgroup): each file is
# one unit of work (its module fixtures are built once), and files that share a session
# fixture are one unit too (built once, not on both workers).
SHARED_SESSION_FIXTURE = {
    "test_report.py": "evaluated-runs",  # tests/flows/report_fixtures.py::evaluated_runs
    "test_mlflow_server.py": "evaluated-runs",
    "test_determinism.py": "dask-cluster",  # tests/flows/conftest.py::dask_cluster
    "test_executor.py": "dask-cluster",
}
# The longest units start first (measured with --durations beside a CPU burner: about 145, 80, 75,
# 45, 65, 50, 40 s on 2 cores), so neither worker is left alone with a long file at the end; the rest follow
# in collection order.
LONGEST_FIRST = (
    "test_resume",
    "test_resume_async",
    "test_faults",  # about 60 s idle, 80 s busy (one process): runs killed mid-way, two resumes
    "test_disk_full_run",  # three runs whose disk fills, three resumes: ~210 s on 2 busy cores
    "test_cluster_access",  # two user clusters (one over TLS), a run on it: ~200 s on 2 busy cores
    "test_signals",  # about 65 s idle: commands stopped at chosen points, a run stopped and resumed
    "test_sweep",
    "test_pipeline",
    "dask-cluster",
    "test_bad_input",
    "test_serve",
    "evaluated-runs",
    "test_async",
    "test_prefect_server",
    "test_data_flow",
)


def _unit(item: pytest.Item) -> str:
    return SHARED_SESSION_FIXTURE.get(item.path.name, item.path.stem)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_unit(item), len(rank)))  # stable: files stay whole
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            item.add_marker(pytest.mark.xdist_group(_unit(item)))


@pytest.hookimpl(optionalhook=True)  # an xdist hook: `-p no:xdist` (one process, no plugin) must still collect
def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
    """Stop at once if a worker's test ids lack their group: xdist would then spread every file's tests
    over both workers, building each module fixture twice (a silent ~20% slower suite: pytest 9.2 with
    pytest-xdist 3.8, pytest-dev/pytest-xdist#1386)."""
    ungrouped = [nodeid for nodeid in ids if "@" not in nodeid.rsplit("::", 1)[-1]]
    if node.config.getvalue("dist") == "loadgroup" and ungrouped:
        pytest.exit(
            f"pytest-xdist did not group the tests (e.g. {ungrouped[0]} has no @group suffix): "
            "install the versions pyproject.toml pins (bash scripts/bootstrap.sh)",
            returncode=4,
        )
