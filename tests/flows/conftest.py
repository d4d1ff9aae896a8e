"""Session-wide servers for the flow tests: one Prefect test server, one Dask cluster.

Both are real: Prefect's test server on a throw-away SQLite database, and a Dask
cluster started the way a user starts one (``dask scheduler`` and two ``dask worker``
processes on 127.0.0.1), for the ``runtime.executor: cluster`` tests.
"""

import os

import pytest
from prefect.settings import temporary_settings
from prefect.testing.utilities import prefect_test_harness

from tests.flows.dask_cluster import user_cluster
from tests.flows.report_fixtures import evaluated_runs  # noqa: F401  (session fixture: finished small runs)


@pytest.fixture(scope="session", autouse=True)
def prefect_backend():
    with (
        prefect_test_harness(server_startup_timeout=120),
        temporary_settings(updates={"flows.heartbeat_frequency": None}),
    ):
        yield


@pytest.fixture(scope="session")
def dask_cluster(tmp_path_factory):
    """The address of a Dask scheduler with two single-threaded workers, each a separate process."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with user_cluster(tmp_path_factory.mktemp("dask"), env) as (address, _):
        yield address
