"""Commands stopped by a signal (Ctrl-C, a supervisor's SIGTERM, a closed terminal's SIGHUP) end with one line
and exit 128 + the first signal, wherever it lands, and leave no process behind.

`bhfl ui` (an MLflow server and its uvicorn), `bhfl prepare` on a cache miss and `bhfl run`
(their own Prefect server) run as a user runs them, each in a session of its own; the
signal goes to the bhfl process only, as `kill PID` sends it. Each signal lands at the
same point on every run: sent from inside the function it is meant to interrupt
(tests/flows/signal_at.py), or while the run is held at a fault point (``BHFL_FAULTS``'s
``pause``) — never at a moment found by polling a log, which lands anywhere in the
seconds after and once hit a window of milliseconds inside Prefect's task engine. (Runs
killed mid-way, and their servers and workers killed under them:
tests/flows/test_faults.py; docs/runtime.md, "Faults".)
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient
from prefect.settings import PREFECT_API_URL

from data_prep.prepare import cached_data
from flows.records.run_record import RunRecord
from flows.services.stop_signals import Stopped, signal_behind
from tests.flows.commands import left_behind, own_servers_env, sets, start, wait_for
from tests.flows.kill_chain import cli, node_files, uninterrupted
from tests.small import small_config

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


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, bytes]:
    return uninterrupted(tmp_path_factory.mktemp("signals-reference"))


# Where a signal lands (tests/flows/signal_at.py): inside Prefect's task engine before its task run exists (a
# crash reported there fails: "Task run is not set"), inside its crash report, and while it creates a flow run
TASK_RUN_CREATED = "prefect.task_engine:_create_task_run_locally"
CRASH_REPORTED = "prefect.task_engine:SyncTaskRunEngine.handle_crash"
FLOW_RUN_CREATED = "prefect.flow_engine:FlowRunEngine.create_flow_run"


def _stopped(proc: subprocess.Popen, log: Path, timeout_s: float = 120) -> tuple[int, str]:
    """The exit code of a command that stops itself, and its output; nothing of its session may be left."""
    try:
        code = proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert left_behind(proc.pid) == [], f"processes outlived the command:\n{log.read_text()[-3000:]}"
    return code, log.read_text()


def _one_line(out: str, line: str) -> None:
    """``line`` said once, and no traceback (the stop is not an error)."""
    assert out.count(line) == 1 and "Traceback" not in out and not re.search(r"Error|\bERROR\b", out), out[-3000:]


@pytest.mark.own_data_cache  # stopped while it prepares: nothing half-prepared left in the run dir's cache
def test_sigterm_as_prefect_starts_a_task_ends_with_one_line_and_leaves_nothing(tmp_path):
    """`bhfl prepare` (its own Prefect server, as a user without one runs it) stopped inside Prefect's task engine
    before the task run exists: it used to end with Prefect's `ValueError: Task run is not set`, exit 1."""
    log, run_dir = tmp_path / "prepare.log", tmp_path / "runs"
    proc = start(
        ["prepare", *sets(), "--run-dir", str(run_dir)], own_servers_env(), log, [f"{TASK_RUN_CREATED}@1=SIGTERM"]
    )
    code, out = _stopped(proc, log)
    assert code == 143, out[-3000:]
    _one_line(out, "interrupted.")
    assert "preparing data" in out  # it was stopped in the first step, not before
    assert cached_data(small_config(), run_dir / "cache") is None  # nothing half-prepared is reused
    assert [p.name for p in (run_dir / "cache").iterdir() if not p.name.startswith(".")] == [], "a partial entry"


@pytest.mark.own_data_cache  # `bhfl prepare` afresh: its steps are the Prefect tasks signalled
@pytest.mark.parametrize(
    ("where", "code"),
    [
        ([f"{FLOW_RUN_CREATED}@1=SIGHUP"], 129),
        ([f"{TASK_RUN_CREATED}@2=SIGINT"], 130),
        # the first signal decides; a second one, while Prefect reports the crash of the first, is let pass
        ([f"{TASK_RUN_CREATED}@1=SIGTERM", f"{CRASH_REPORTED}@1=SIGHUP"], 143),
        ([f"{TASK_RUN_CREATED}@1=SIGHUP", f"{CRASH_REPORTED}@1=SIGTERM"], 129),
    ],
    ids=[
        "SIGHUP-creating-the-flow-run",
        "SIGINT-starting-the-second-task",
        "SIGTERM-then-SIGHUP",
        "SIGHUP-then-SIGTERM",
    ],
)
def test_a_signal_anywhere_in_prefects_engines_exits_128_plus_the_first(tmp_path, where, code):
    log = tmp_path / "prepare.log"
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "HF_HUB_OFFLINE": "1"}  # the session's server
    proc = start(["prepare", *sets(), "--run-dir", str(tmp_path / "runs")], env, log, where)
    got, out = _stopped(proc, log)
    assert got == code, out[-3000:]
    _one_line(out, "interrupted.")


@pytest.mark.own_data_cache  # `bhfl prepare` afresh: its first step is the Prefect task signalled
def test_a_stop_that_cannot_finish_ends_as_a_kill_after_the_grace_period(tmp_path):
    """Clean-up that hangs (here: stopping the command's own Prefect server) does not hold the command: after
    BHFL_STOP_GRACE_S it ends as a kill does, with its processes killed, exit 143."""
    log = tmp_path / "prepare.log"
    hang = "flows.services.prefect_server:PrefectServer.stop@1=hang"
    env = own_servers_env(BHFL_STOP_GRACE_S="2")
    proc = start(
        ["prepare", *sets(), "--run-dir", str(tmp_path / "runs")], env, log, [f"{TASK_RUN_CREATED}@1=SIGTERM", hang]
    )
    code, out = _stopped(proc, log)  # without the grace period: still waiting when the wait times out
    assert code == 143, out[-3000:]
    _one_line(out, "interrupted.")


def test_sigterm_mid_run_then_resume_is_bit_identical(tmp_path, reference):
    """`bhfl run` held at its first evaluation (BHFL_FAULTS's pause: a SIGSTOP), SIGTERMed there, let go: it stops
    with one line naming the resume; what it wrote is complete, so `bhfl resume` ends as a run never stopped."""
    run_dir, log = tmp_path / "runs", tmp_path / "run.log"
    proc = start(["run", *sets(), "--run-dir", str(run_dir)], own_servers_env(BHFL_FAULTS="eval@1:pause"), log)
    wait_for("the pause", lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED, proc, log)
    proc.send_signal(signal.SIGTERM)  # pending while it is stopped: handled right at the pause
    proc.send_signal(signal.SIGCONT)
    code, out = _stopped(proc, log)
    (run_path,) = (run_dir / "itest").iterdir()
    assert code == 143, out[-3000:]
    _one_line(out, "interrupted.")
    assert f"`bhfl resume {run_path}` continues" in " ".join(out.split())
    record = RunRecord.read(run_path)
    assert (record.effective_status, record.error) == ("interrupted", "stopped by SIGTERM")
    mlflow = MlflowClient(record.tracking_uri)
    assert mlflow.get_run(record.parent_run_id).info.status == "KILLED"

    resumed, _ = cli("resume", str(run_path), faults=None, run_dir=run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert node_files(run_path) == reference
    assert mlflow.get_run(record.parent_run_id).info.status == "FINISHED"


def test_sigint_mid_sweep_ends_with_one_line_and_records_the_point_interrupted(tmp_path):
    """`bhfl sweep` Ctrl-C'd while its second point trains (in a thread of the command, on the workers the command
    started): one line, exit 130, no Dask traceback (the point's client logged its failed reconnections to the
    stopped workers at ERROR, after the line), and the point's own run.json says interrupted, not `running` under
    the dead pid nor failed with what the stopped workers raised (the stop is raised in the main thread only)."""
    run_dir, log = tmp_path / "runs", tmp_path / "sweep.log"
    grid = ["--grid", "tree.edge.eta_down=1.0,0.5", "--seeds", "0", "--parallel", "1"]
    proc = start(["sweep", *sets("tree.root.rounds=5"), *grid, "--run-dir", str(run_dir)], own_servers_env(), log)
    # a process-directed signal goes to the main thread (waiting on the point), as a terminal's Ctrl-C does
    rounds = lambda: len(list(run_dir.glob("itest/*/state/nodes/root.safetensors"))) == 2  # noqa: E731
    wait_for("the second point's first root round", rounds, proc, log)
    proc.send_signal(signal.SIGINT)
    code, out = _stopped(proc, log)
    assert code == 130, out[-3000:]
    _one_line(out, "interrupted.")
    records = sorted((r.status, r.error) for r in map(RunRecord.read, (run_dir / "itest").iterdir()))
    assert records == [("finished", ""), ("interrupted", "stopped by SIGINT")], out[-3000:]


def test_what_a_stop_ended_with_is_traced_to_its_first_signal():
    """The chain of what the work ended with names the stop: a ``Stopped`` wins over the KeyboardInterrupt an
    event loop raised around it, Prefect's TerminationSignal carries its signal, a bare KeyboardInterrupt is
    Ctrl-C; an error with no stop behind it is none."""
    from prefect.exceptions import TerminationSignal

    def raised(outer: BaseException, inner: BaseException) -> BaseException:
        try:
            try:
                raise inner
            except BaseException:
                raise outer  # noqa: B904  (its context: inner)
        except BaseException as exc:
            return exc

    assert signal_behind(raised(ValueError("Task run is not set"), Stopped(signal.SIGHUP))) == signal.SIGHUP
    assert signal_behind(raised(KeyboardInterrupt(), Stopped(signal.SIGTERM))) == signal.SIGTERM
    assert signal_behind(raised(RuntimeError(), TerminationSignal(signal=signal.SIGTERM))) == signal.SIGTERM
    assert signal_behind(raised(RuntimeError(), KeyboardInterrupt())) == signal.SIGINT
    assert signal_behind(raised(RuntimeError("a"), ValueError("b"))) is None


DROPPED_IN_A_FINALISER = """
import gc, signal, sys, time
from flows.cli.stopping import run_command

class Finalised:
    def __del__(self):
        signal.raise_signal(signal.SIG{name})  # its handler runs here, where an exception is printed and dropped

def app():
    if {prefect}:  # inside a flow run: Prefect's SIGTERM handler (as the command wraps it) raises TerminationSignal
        from prefect.utilities import engine
        from flows.cli.stopping import STOP

        STOP.watch_prefect()
        signal.signal(signal.SIGTERM, engine._prefect_sigterm_handler)
    Finalised()  # collected at once: the stop lands in its __del__
    time.sleep(20)
    print("ran on", flush=True)

run_command(lambda: app)
"""


@pytest.mark.parametrize(
    "name, code, prefect", [("TERM", 143, False), ("INT", 130, False), ("TERM", 143, True)], ids=["TERM", "INT", "flow"]
)
def test_a_stop_that_lands_in_a_finaliser_still_stops_the_command(name, code, prefect):
    """A signal whose handler runs inside a ``__del__`` (the garbage collector runs them anywhere: asyncio's
    transports, Prefect's clients) raises the stop where Python drops exceptions; it is raised again outside,
    at once, not after the grace period, and nothing is printed about the dropped one."""
    env = {**os.environ, "BHFL_STOP_GRACE_S": "10"}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", DROPPED_IN_A_FINALISER.format(name=name, prefect=prefect)],
        cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (code, ""), done.stderr
    assert time.monotonic() - started < 8  # the grace period (10 s) did not end it
    assert done.stderr.strip() == f"stopped by SIG{name}.", done.stderr


FAILING_FINALISER_WHILE_STOPPING = """
import signal, time
from flows.cli.stopping import run_command

class Failing:
    def __del__(self):
        raise ValueError("a finaliser that fails while the stop unwinds")  # its context: the stop

def app():
    try:
        signal.raise_signal(signal.SIGTERM)
    finally:
        Failing()
        time.sleep(0.3)  # clean-up the stop must not interrupt a second time
        print("cleaned up", flush=True)

run_command(lambda: app)
"""


def test_a_finaliser_failing_while_a_stop_unwinds_does_not_raise_the_stop_again():
    done = subprocess.run(
        [sys.executable, "-c", FAILING_FINALISER_WHILE_STOPPING],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (143, "cleaned up\n"), done.stderr
    assert "ValueError: a finaliser that fails" in done.stderr  # an error of its own: reported as Python does


def test_a_bad_grace_period_is_named_before_anything_runs():
    env = {**os.environ, "BHFL_STOP_GRACE_S": "soon"}
    cmd = [sys.executable, "-m", "flows.cli.app", "runs"]
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "BHFL_STOP_GRACE_S='soon': not a number of seconds" in done.stderr, done
