"""Session-wide servers for the flow tests: one Prefect test server, one Dask cluster; one data cache.

Both servers are real: Prefect's test server on a throw-away SQLite database, and a Dask
cluster started the way a user starts one (``dask scheduler`` and two ``dask worker``
processes on 127.0.0.1), for the ``runtime.executor: cluster`` tests.

The runs share one data cache (``BHFL_DATA_CACHE``, as a user's runs under several run
folders may: docs/data.md), so each config's data are prepared once per test process, not
once per run (preparing them was about half of a small in-process run: 9 of 20 s). Tests
of preparation itself (a fresh folder, a stop or a full disk while preparing, a cache
entry damaged) are marked ``own_data_cache``: their runs prepare in ``<run-dir>/cache``.
"""

import os
from collections.abc import Iterator

import pytest
from prefect.settings import temporary_settings
from prefect.testing.utilities import prefect_test_harness

from data_prep.cache_folder import DATA_CACHE_ENV
from tests.flows.dask_cluster import user_cluster
from tests.flows.report_fixtures import evaluated_runs  # noqa: F401  (session fixture: finished small runs)


@pytest.fixture(scope="session", autouse=True)
def prefect_backend():
    with (
        prefect_test_harness(server_startup_timeout=120),
        temporary_settings(updates={"flows.heartbeat_frequency": None}),
    ):
        yield


@pytest.fixture(scope="session", autouse=True)
def shared_data_cache(tmp_path_factory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DATA_CACHE_ENV, str(tmp_path_factory.mktemp("data-cache")))
        yield


def _own_data_cache(node: pytest.Item | pytest.Module) -> Iterator[None]:
    if node.get_closest_marker("own_data_cache") is None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(DATA_CACHE_ENV, raising=False)
        yield


@pytest.fixture(scope="module", autouse=True)
def own_data_cache_of_module(request) -> Iterator[None]:
    """A module marked ``own_data_cache``: its module fixtures' runs too."""
    yield from _own_data_cache(request.node)


@pytest.fixture(autouse=True)
def own_data_cache_of_test(request) -> Iterator[None]:
    yield from _own_data_cache(request.node)


@pytest.fixture(scope="session")
def dask_cluster(tmp_path_factory):
    """The address of a Dask scheduler with two single-threaded workers, each a separate process."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with user_cluster(tmp_path_factory.mktemp("dask"), env) as (address, _):
        yield address
