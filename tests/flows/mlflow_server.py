"""A real `mlflow server` process for tests (as `bhfl ui` starts it): started, stopped, killed, restarted.

It runs on 127.0.0.1 and a free port with one worker and no job runner, in a session of
its own, so a signal reaches the server and the uvicorn worker it starts. A restart
keeps the port and the backend store: what a user's server does after a crash.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MlflowServer:
    """``mlflow server`` on ``backend`` (a store URI); ``artifacts``: where it keeps uploads (None: its default)."""

    def __init__(
        self, backend: str, log: Path, artifacts: Path | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.backend, self.log, self.artifacts, self.env = backend, log, artifacts, env or {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 240) -> MlflowServer:
        """Start it and wait until it answers. ``timeout_s``: 3x the slowest start measured on a loaded 2-core
        machine, 43 s for a new store (its migrations) and 28 s for a restart, beside two busy loops."""
        cmd = [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            self.backend,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        if self.artifacts is not None:
            cmd += ["--artifacts-destination", str(self.artifacts)]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **self.env}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout_s
        while not self.healthy():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"mlflow server did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.3)
        return self

    def running(self) -> MlflowServer:
        """Started, or going again (an earlier test may have left it killed or stopped)."""
        if self.proc is None:
            return self.start()
        self.signal(signal.SIGCONT)
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, ConnectionError, OSError):
            return False

    def signal(self, sig: int) -> None:
        """``sig`` to the server and its worker (SIGSTOP: hung; SIGCONT: going again; SIGKILL: crashed)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)
        if sig == signal.SIGKILL:
            self.proc.wait(timeout=20)
            self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)  # a stopped server cannot act on SIGTERM
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=20)
        except ProcessLookupError:
            pass
        self.proc = None
