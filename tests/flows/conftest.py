"""One Prefect test server per session (real server, throw-away SQLite) for the flow tests."""

import pytest
from prefect.settings import temporary_settings
from prefect.testing.utilities import prefect_test_harness

from tests.flows.report_fixtures import evaluated_runs  # noqa: F401  (session fixture: finished small runs)


@pytest.fixture(scope="session", autouse=True)
def prefect_backend():
    with prefect_test_harness(server_startup_timeout=120):
        with temporary_settings(updates={"flows.heartbeat_frequency": None}):
            yield
