"""A Dask cluster started the way a user starts one: ``dask scheduler`` and two ``dask worker`` processes.

Used by the session's cluster fixture (``conftest.py``), by the worker-loss test, which
needs workers without a nanny (nothing restarts a killed one), and by the tests of a
cluster over TLS and of a worker that does not see the run folder
(tests/flows/test_cluster_access.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from tests.flows.tls_certs import TlsFiles

DASK = str(Path(sys.executable).with_name("dask"))
REPO = Path(__file__).resolve().parents[2]


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, procs: list[subprocess.Popen]) -> None:
    """Poll ``predicate`` until it holds; fail at once, naming the command, if one of ``procs`` has exited."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if predicate():
            return
        dead = [p.args for p in procs if p.poll() is not None]
        assert not dead, f"{what}: process exited early: {dead}"
        time.sleep(0.2)
    raise AssertionError(f"{what}: not ready after {timeout_s} s (see {what}'s log)")


@contextmanager
def user_cluster(
    folder: Path,
    env: Mapping[str, str],
    nanny: bool = True,
    tls: TlsFiles | None = None,
    wrap: Mapping[str, list[str]] | None = None,
) -> Iterator[tuple[str, list[subprocess.Popen]]]:
    """A scheduler and workers ``w0``, ``w1`` (one thread each) on 127.0.0.1; logs in ``folder/cluster.log``.

    Yields the scheduler's address and the processes (scheduler first). At the end the
    scheduler shuts the cluster down (~2 s, where SIGTERM to each process takes ~8 s);
    whatever is still running then is terminated, or killed after 20 s. ``tls``: every
    process speaks TLS with these certificates (``tls://``); ``wrap``: a command prefix
    per worker name (the worker runs under it, e.g. in a mount namespace of its own).
    """
    from distributed import Client

    scheduler_file = folder / "scheduler.json"
    secure = [] if tls is None else tls.dask_args()
    security = None if tls is None else tls.security()
    with open(folder / "cluster.log", "w") as log:
        common = {"env": dict(env), "stdout": log, "stderr": subprocess.STDOUT, "cwd": REPO}
        scheduler = [DASK, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard", *secure]
        scheduler += [] if tls is None else ["--protocol", "tls"]
        procs = [subprocess.Popen([*scheduler, "--scheduler-file", str(scheduler_file)], **common)]
        try:
            wait_until(scheduler_file.exists, 60, "dask scheduler", procs)
            address = json.loads(scheduler_file.read_text())["address"]
            for name in ("w0", "w1"):
                worker = [address, "--name", name, "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard"]
                extra = ([] if nanny else ["--no-nanny"]) + secure
                prefix = (wrap or {}).get(name, [])
                procs.append(
                    subprocess.Popen([*prefix, DASK, "worker", *worker, "--memory-limit", "0", *extra], **common)
                )
            with Client(address, security=security, set_as_default=False) as client:
                wait_until(lambda: len(client.scheduler_info()["workers"]) == 2, 120, "dask workers", procs)
            yield address, procs
            with Client(address, security=security, set_as_default=False) as client:
                client.shutdown()  # scheduler and workers close together
        finally:
            for proc in procs[::-1]:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
