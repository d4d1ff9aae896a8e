"""Session-wide servers for the flow tests: one Prefect test server, one Dask cluster.

Both are real: Prefect's test server on a throw-away SQLite database, and a Dask
cluster started the way a user starts one (``dask scheduler`` and two ``dask worker``
processes on 127.0.0.1), for the ``runtime.executor: cluster`` tests.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect.settings import temporary_settings
from prefect.testing.utilities import prefect_test_harness

from tests.flows.report_fixtures import evaluated_runs  # noqa: F401  (session fixture: finished small runs)

DASK = str(Path(sys.executable).with_name("dask"))


@pytest.fixture(scope="session", autouse=True)
def prefect_backend():
    with (
        prefect_test_harness(server_startup_timeout=120),
        temporary_settings(updates={"flows.heartbeat_frequency": None}),
    ):
        yield


def _wait(predicate, timeout_s: float, what: str, procs: list[subprocess.Popen]) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if predicate():
            return
        dead = [p.args for p in procs if p.poll() is not None]
        assert not dead, f"{what}: process exited early: {dead}"
        time.sleep(0.2)
    raise AssertionError(f"{what}: not ready after {timeout_s} s")


@pytest.fixture(scope="session")
def dask_cluster(tmp_path_factory):
    """The address of a Dask scheduler with two single-threaded workers, each a separate process."""
    from distributed import Client

    folder = tmp_path_factory.mktemp("dask")
    scheduler_file = folder / "scheduler.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(folder / "cluster.log", "w") as logs:
        common = {"env": env, "stdout": logs, "stderr": subprocess.STDOUT, "cwd": Path(__file__).resolve().parents[2]}
        procs = [
            subprocess.Popen(
                [
                    DASK,
                    "scheduler",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--no-dashboard",
                    "--scheduler-file",
                    str(scheduler_file),
                ],
                **common,
            )
        ]
        try:
            _wait(scheduler_file.exists, 60, "dask scheduler", procs)
            address = json.loads(scheduler_file.read_text())["address"]
            for name in ("w0", "w1"):
                procs.append(
                    subprocess.Popen(
                        [
                            DASK,
                            "worker",
                            address,
                            "--name",
                            name,
                            "--nthreads",
                            "1",
                            "--host",
                            "127.0.0.1",
                            "--no-dashboard",
                            "--memory-limit",
                            "0",
                        ],
                        **common,
                    )
                )
            with Client(address, set_as_default=False) as client:
                _wait(lambda: len(client.scheduler_info()["workers"]) == 2, 120, "dask workers", procs)
            yield address
            with Client(address, set_as_default=False) as client:
                client.shutdown()  # scheduler and workers close together: ~2 s, where SIGTERM each takes ~8 s
        finally:
            for proc in procs[::-1]:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
