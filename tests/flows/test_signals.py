"""Commands stopped by SIGTERM or SIGHUP (a supervisor, `kill`, a closed terminal) leave no process behind.

`bhfl ui` (an MLflow server and its uvicorn) and `bhfl prepare` on a cache miss (its own
Prefect server) run as a user runs them, each in a session of its own; the signal goes to
the bhfl process only, as `kill PID` sends it. (Runs killed mid-way, and their servers and
workers killed under them: tests/flows/test_faults.py; docs/runtime.md, "Faults".)
"""

import os
import signal
import socket
import urllib.request

import psutil
import pytest
from mlflow import MlflowClient

from tests.flows.commands import left_behind, own_servers_env, sets, start, wait_for

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no clash
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _serving(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_ui_stopped_by_a_signal_leaves_no_process_and_frees_its_port(tmp_path, monkeypatch, stop):
    run_dir, port, log = tmp_path / "runs", _free_port(), tmp_path / "ui.log"
    run_dir.mkdir()
    monkeypatch.chdir(tmp_path)  # the store's default experiment puts its artefacts under the working folder
    MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}").search_experiments()  # an (empty) MLflow store
    proc = start(["ui", "--run-dir", str(run_dir), "--port", str(port)], own_servers_env(), log)
    try:
        wait_for("the MLflow UI", lambda: _serving(f"http://127.0.0.1:{port}/health"), proc, log, 120)
        servers = psutil.Process(proc.pid).children(recursive=True)
        assert len(servers) >= 2, servers  # `mlflow server` and its uvicorn
        proc.send_signal(stop)  # the bhfl process only, as a supervisor or `kill` does
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert left_behind(proc.pid) == [], "the MLflow server outlived `bhfl ui`"
    assert not [p.pid for p in servers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert _port_free(port)
    assert code == 128 + stop, log.read_text()[-3000:]


def test_prepare_stopped_by_sigterm_stops_its_prefect_server(tmp_path):
    """A cache miss runs the prepare-data flow on the command's own Prefect server; SIGTERM leaves nothing."""
    log = tmp_path / "prepare.log"
    proc = start(["prepare", *sets(), "--run-dir", str(tmp_path / "runs")], own_servers_env(), log)
    try:
        wait_for("data preparation", lambda: "preparing data" in log.read_text(), proc, log)
        assert [p for p in psutil.Process(proc.pid).children() if "prefect.server" in " ".join(p.cmdline())]
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert left_behind(proc.pid) == [], "the Prefect server outlived `bhfl prepare`"
    assert code == 143, log.read_text()[-3000:]
    assert "interrupted." in log.read_text() and "Traceback" not in log.read_text(), log.read_text()[-3000:]
