"""An MLflow tracking server hung, down for a while, or down for good while `bhfl run` trains: nothing is lost.

Real processes throughout: `mlflow server` on a SQLite backend (tests/flows/mlflow_server.py)
stopped with SIGSTOP, killed with SIGKILL and restarted on the same backend; `bhfl run`,
`bhfl sync` and `bhfl resume` as a user runs them (subprocesses, against the session's
Prefect server). Each run's store is compared point by point ((node, key) -> steps, each
once) with an uninterrupted run's, as the kill chain compares (tests/flows/test_resume.py),
and its node files byte for byte.

The retry timings are shortened through their environment variables (docs/runtime.md,
"Faults"): MLflow's client does not retry by itself (``MLFLOW_HTTP_REQUEST_MAX_RETRIES=0``)
and bhfl's courier tries again every 0.3 s.
"""

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient
from prefect.settings import PREFECT_API_URL

from flows.cli.errors import explain
from flows.experiment import PLAIN_CALLS, run_experiment
from flows.records.run_record import RunRecord
from flows.tracking.delivery import SLOW_S, UNDELIVERED_EXIT, Courier, TrackingUnavailable, send
from flows.tracking.spool import Spool
from flows.tracking.tracker import RUN_KEY_TAG, Tracker, sqlite_file
from tests.flows.kill_chain import node_files
from tests.flows.mlflow_server import MlflowServer, free_port
from tests.flows.test_resume import _store_points
from tests.small import REPO, SMALL, small_config

pytestmark = pytest.mark.integration

EXTRA = ["tree.root.rounds=3", "runtime.executor=inprocess"]  # long enough to fault the server mid-run
FAST_RETRIES = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
    "BHFL_TRACKING_RETRY_S": "0.3",
}


class Bhfl:
    """One `bhfl` command in a session of its own; its stderr read line by line as it comes."""

    def __init__(self, *args: str, run_dir: Path, env: dict[str, str]) -> None:
        full = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "HF_HUB_OFFLINE": "1", **env}
        full.pop("BHFL_FAULTS", None)
        cmd = [sys.executable, "-m", "flows.cli.app", *args, "--run-dir", str(run_dir)]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        self.lines: list[tuple[float, str]] = []
        self.stdout = ""
        self._seen = threading.Condition()
        self._readers = [threading.Thread(target=self._read_err), threading.Thread(target=self._read_out)]
        for reader in self._readers:
            reader.start()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._seen:
                self.lines.append((time.time(), line))
                self._seen.notify_all()

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        self.stdout = self.proc.stdout.read()

    def wait_for(self, text: str, timeout_s: float = 300) -> float:
        """When a stderr line with ``text`` came (waiting for it)."""
        deadline = time.time() + timeout_s
        with self._seen:
            while True:
                for at, line in self.lines:
                    if text in line:
                        return at
                ended = self.proc.poll() is not None and not self._readers[0].is_alive()
                assert not ended, f"exited {self.proc.returncode} without {text!r}:\n{self.stderr[-3000:]}"
                assert time.time() < deadline, f"no {text!r} after {timeout_s} s:\n{self.stderr[-3000:]}"
                self._seen.wait(0.2)

    @property
    def stderr(self) -> str:
        return "".join(line for _, line in self.lines)

    def finish(self, timeout_s: float = 400) -> int:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        for reader in self._readers:
            reader.join()
        return code


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same experiment, uninterrupted, on a local store (no Prefect: it must not change the record).

    The faulted runs share its run folder root, so its prepared data too (as a user's runs do).
    """
    run_dir = tmp_path_factory.mktemp("tracking")
    result = run_experiment(small_config(*EXTRA), run_dir, orchestration=PLAIN_CALLS)
    return Path(result["run_path"])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tracking-server")
    running = MlflowServer(f"sqlite:///{folder / 'mlflow.db'}", folder / "server.log", folder / "artifacts").start()
    yield running
    running.stop()


@pytest.fixture
def started():
    """The `bhfl run` commands a test starts: one still running when the test ends (it failed) is killed."""
    commands: list[Bhfl] = []
    yield commands
    for command in commands:
        if command.proc.poll() is None:
            os.killpg(command.proc.pid, signal.SIGKILL)


def _run(reference: Path, server: MlflowServer, env: dict[str, str], started: list[Bhfl]) -> tuple[Bhfl, Path]:
    """`bhfl run` of the reference's experiment against ``server``, and the folder it runs in."""
    server.running()
    before = set(reference.parent.iterdir())
    sets = [arg for s in [*SMALL, *EXTRA] for arg in ("--set", s)]
    run = Bhfl("run", *sets, "--tracking-uri", server.url, run_dir=reference.parents[1], env={**FAST_RETRIES, **env})
    started.append(run)
    run.wait_for("worker(s): ")  # the run folder and its MLflow runs exist
    (path,) = set(reference.parent.iterdir()) - before
    return run, path


def _same_record(server: MlflowServer, run_path: Path, reference: Path) -> dict[tuple[str, str], list[int]]:
    """The run's points in the server's store equal the uninterrupted run's, each once; every run FINISHED."""
    record, clean = RunRecord.read(run_path), RunRecord.read(reference)
    got = _store_points(server.backend, record.run_key)
    assert {k: s for k, s in got.items() if len(s) != len(set(s))} == {}, "a metric point logged twice"
    assert got == _store_points(clean.tracking_uri, clean.run_key)
    runs = MlflowClient(server.url).search_runs([record.experiment_id], f"tags.`{RUN_KEY_TAG}` = '{record.run_key}'")
    assert sorted(r.info.run_id for r in runs) == sorted([record.parent_run_id, *record.node_runs.values()])
    assert {r.info.status for r in runs} == {"FINISHED"}
    return got


def _timestamps(server: MlflowServer, run_key: str) -> list[int]:
    """Every metric point's timestamp (ms) of the run's MLflow runs, from the server's database."""
    db = sqlite3.connect(sqlite_file(server.backend))
    rows = db.execute(
        "SELECT m.timestamp FROM metrics m JOIN tags t ON t.run_uuid = m.run_uuid AND t.key = ? AND t.value = ?",
        (RUN_KEY_TAG, run_key),
    ).fetchall()
    db.close()
    return [ts for (ts,) in rows]


def test_hung_then_crashed_server_costs_no_training_time_and_loses_nothing(server, reference, started):
    # the run's end waits for the restarted server (exit 3 if the wait runs out first): the restart took 20 s idle,
    # 44 s beside four busy loops, and ended 4 s into the run's wait there; a wait ends as soon as all arrived
    run, run_path = _run(reference, server, {"BHFL_TRACKING_WAIT_S": "180"}, started)
    run.wait_for("root round 1/3 done")
    server.signal(signal.SIGSTOP)  # hung: connections are accepted, nothing answers
    stopped = time.time()
    # training goes on while the server answers nothing (a blocked run would wait here) ...
    run.wait_for("root round 2/3 done", timeout_s=120)
    # ... and the user is told once a call has waited SLOW_S for an answer. Waited for, not assumed: the crash
    # below fails the waiting call at once, and whichever comes first is the outage's one notice (it was
    # "not answering" when root round 2 took under 10 s, and the test failed when it took longer: 19 s beside
    # four busy loops on 2 cores)
    run.wait_for(f"has not answered for {SLOW_S:.0f} s", timeout_s=120)
    assert run.proc.poll() is None
    server.signal(signal.SIGKILL)  # ... then it crashes, and comes back on the same database
    time.sleep(1.0)
    server.start()
    restarted = time.time()
    assert run.finish() == 0, run.stderr[-3000:]
    told = [line for _, line in run.lines if "MLflow tracking server" in line]
    assert "has not answered" in told[0] and "answers again" in told[-1], run.stderr[-3000:]
    assert "Traceback" not in run.stderr

    _same_record(server, run_path, reference)
    assert node_files(run_path) == node_files(reference)
    # points produced while the server was away arrived with the time they were produced
    stamps = _timestamps(server, RunRecord.read(run_path).run_key)
    assert any(stopped * 1000 < ts < restarted * 1000 for ts in stamps)
    assert Spool(run_path).count() == 0


def test_server_gone_for_good_the_run_finishes_and_sync_delivers_later(server, reference, started):
    run, run_path = _run(reference, server, {"BHFL_TRACKING_WAIT_S": "2"}, started)
    run_dir = reference.parents[1]
    run.wait_for("root round 1/3 done")
    server.signal(signal.SIGKILL)
    gone = time.time()
    code = run.finish()
    err = " ".join(run.stderr.split())
    assert code == UNDELIVERED_EXIT, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    assert "could not be delivered" in err and f"bhfl sync {run_path}" in err, err[-2000:]
    # the run itself finished: its record, node files and report are complete
    assert RunRecord.read(run_path).status == "finished"
    assert node_files(run_path) == node_files(reference)
    communication = "report/eval/communication.csv"  # from metric histories: the journal stood in for the server
    assert (run_path / communication).read_text() == (reference / communication).read_text()
    pending = Spool(run_path).count()
    assert pending > 0

    # while the server is still down, `bhfl sync` says so (and keeps every call)
    still = Bhfl("sync", str(run_path), "--wait", "1", run_dir=run_dir, env=FAST_RETRIES)
    assert still.finish() == UNDELIVERED_EXIT and "could not be delivered" in still.stderr
    told = " ".join(still.stderr.split())  # (it said "training goes on", of a run that had finished)
    assert "not answering" in told and "bhfl sync tries again until --wait ends" in told, told
    assert "training goes on" not in told
    assert Spool(run_path).count() == pending

    server.start()
    back = time.time()
    resumed = Bhfl("resume", str(run_path), run_dir=run_dir, env=FAST_RETRIES)  # a finished run: delivers only
    assert resumed.finish() == 0, resumed.stderr[-3000:]
    assert f"delivered {pending} of {pending}" in resumed.stderr
    _same_record(server, run_path, reference)
    assert Spool(run_path).count() == 0
    # late, but with the times they were produced: none of the run's points is stamped after the server came back
    record = RunRecord.read(run_path)
    assert max(_timestamps(server, record.run_key)) < back * 1000
    parent = MlflowClient(server.url).get_run(record.parent_run_id)
    assert gone * 1000 < parent.info.end_time < back * 1000

    again = Bhfl("sync", str(run_path), run_dir=run_dir, env=FAST_RETRIES)
    assert again.finish() == 0 and "no tracking calls waiting" in again.stderr


def test_a_batch_that_arrived_before_its_answer_was_lost_is_not_logged_twice(tmp_path):
    """The courier's own check, on a store that keeps exact duplicates (MLflow's file store; SQL stores drop them)."""
    server = MlflowServer(
        f"file://{tmp_path / 'mlruns'}",
        tmp_path / "server.log",
        tmp_path / "artifacts",
        {"MLFLOW_ALLOW_FILE_STORE": "true"},
    ).start()
    try:
        client = MlflowClient(server.url)
        run_id = client.create_run(client.create_experiment("spool")).info.run_id
        spool = Spool(tmp_path / "run")
        courier = Courier(client, spool, server.url)
        first = {"op": "log_batch", "run_id": run_id, "metrics": [["m", 0.5, 1_000, 1], ["n", 2.0, 1_000, 1]]}
        send(client, first)  # the first attempt reached the server ...
        spool.mark_tried(spool.add(first))  # ... and its answer was lost: still pending, marked as sent once
        courier.post({**first, "metrics": [["m", 0.5, 2_000, 1]], "check": True})  # a resumed attempt's (new time)
        courier.post({"op": "set_tag", "run_id": "0" * 32, "key": "k", "value": "v"})  # refused: no such run
        courier.post({"op": "log_batch", "run_id": run_id, "metrics": [["m", 0.7, 3_000, 2]]})
        assert courier.wait(60) == 0
        history = [(p.step, p.timestamp) for p in client.get_metric_history(run_id, "m")]
    finally:
        server.stop()
    assert history == [(1, 1_000), (2, 3_000)]  # once each; the refused call held nothing up
    assert spool.rejected_count() == 1 and spool.count() == 0


def test_a_resumed_attempt_journals_what_the_store_keeps(server, tmp_path, monkeypatch):
    """The run folder's journal (what the report reads) holds each point once, as the store does, after a resume.

    A killed attempt evaluated round 1; the resume evaluates it again (other seconds) and goes on.
    """
    for key, value in FAST_RETRIES.items():
        monkeypatch.setenv(key, value)
    server.running()
    client = MlflowClient(server.url)
    run_id = client.create_run(client.create_experiment("journal-after-resume")).info.run_id
    killed = Tracker(server.url, run_path=tmp_path)
    assert killed.journal is not None
    killed.journal.begin()
    killed.log_metrics(run_id, {"time/eval_s": 1.5, "acc": 0.5}, step=1)
    assert killed.close(60) is None
    resumed = Tracker(server.url, resumed=True, run_path=tmp_path)
    resumed.log_metrics(run_id, {"time/eval_s": 2.5, "acc": 0.5}, step=1)
    resumed.log_metrics(run_id, {"time/eval_s": 1.0, "acc": 0.6}, step=2)
    assert resumed.close(60) is None
    assert resumed.journal is not None
    for key in ("time/eval_s", "acc"):
        store = sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, key))
        assert sorted((m.step, m.value, m.timestamp) for m in resumed.journal.points(run_id, key)) == store, key
    assert resumed.history(run_id, "time/eval_s") == {1: 1.5, 2: 1.0}  # the value MLflow shows for round 1


def test_a_server_unreachable_at_the_start_stops_the_run_with_a_paragraph(tmp_path, monkeypatch):
    """Creating the MLflow runs needs the server (their ids are needed at once): a clear stop, then `bhfl resume`."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # (MLflow's client would retry ~4 min)
    nowhere = f"http://127.0.0.1:{free_port()}"
    config = small_config("runtime.executor=inprocess")
    with pytest.raises(TrackingUnavailable) as caught:
        run_experiment(config, tmp_path, tracking_uri=nowhere, orchestration=PLAIN_CALLS)
    (run_path,) = (tmp_path / "itest").iterdir()
    message = explain(caught.value, run_path)  # what the CLI prints, exit 2 (a ConfigError)
    assert message is not None and f"{nowhere} cannot be reached" in message
    assert f"bhfl resume {run_path}" in " ".join(message.split())
    assert RunRecord.read(run_path).status == "failed"
