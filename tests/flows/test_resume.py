"""SIGKILL a real run at several moments, resume it each time: the final node models are
bit-identical to an uninterrupted run, and the MLflow store holds what an uninterrupted run's
holds: one parent run, every run FINISHED, the same metric points (run, key, step) each once,
the same artefacts.

The experiment is the B-HFL example (FedAdam both ways, proxy training, up- and
down-residuals, cohort sampling, evaluation every root round), shrunken. It runs as the
user runs it: `bhfl run` / `bhfl resume` in subprocesses against the session's Prefect
server. Each process is killed by the pipeline's fault injector (BHFL_FAULTS, a real
SIGKILL) at a chosen point; the kills form one chain, so a run interrupted several
times, at every kind of point, must still end exactly where the uninterrupted one ends.
"""

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient
from prefect.settings import PREFECT_API_URL

from bhfl_core.store.node_store import StateStore
from flows.experiment import run_experiment
from flows.records.run_record import RunRecord
from flows.tracking.tracker import RUN_KEY_TAG, sqlite_file
from tests.small import REPO, SMALL, small_config

pytestmark = pytest.mark.integration

EXTRA = ["tree.root.rounds=3", "tree.edge.rounds=2", "eval.every=1"]
KILLED = -9  # returncode of a process killed by SIGKILL
# One chain of interruptions, in the order the run meets them:
# (fault, expected return code, text the user must see, what it interrupts)
CHAIN = [
    ("tracking@1", KILLED, "", "the MLflow runs created, their ids not yet in run.json: the resume adopts them"),
    ("artefacts@1", KILLED, "", "the parent run's files half logged, beside the first round's clients"),
    ("round@3", KILLED, "", "mid-subtree: a server round finished and saved, inside a subtree's execution"),
    # a worker task is retried once (runtime.retries): the error must hit twice to fail the run
    ("client@2:oom,client@3:oom", 1, "Out of GPU memory", "a CUDA out-of-memory error while a client trains"),
    ("checkpoint@7", KILLED, "", "a checkpoint write: the temporary file is written, not yet renamed"),
    ("checkpoint@3:enospc,checkpoint@4:enospc", 1, "The disk is full", "disk full while writing a checkpoint"),
    ("eval@1", KILLED, "", "during evaluation: the evaluation after a root round"),
    ("report@1", KILLED, "", "the report: the final evaluation and timings logged, the summary metrics not"),
]

LISTED_AFTER = (1, 4)  # `bhfl runs` is checked after a kill and after a failure (6 s a call: not after each)


def _cli(*args: str, faults: str | None, run_dir: Path) -> tuple[subprocess.CompletedProcess, int]:
    """Run the CLI in a session of its own; returns its result and its session id (its pid)."""
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "HF_HUB_OFFLINE": "1"}
    env.pop("BHFL_FAULTS", None)
    if faults:
        env["BHFL_FAULTS"] = faults
    cmd = [sys.executable, "-m", "flows.cli.app", *args, "--run-dir", str(run_dir)]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), proc.pid


def _leftovers(session: int, grace_s: float = 15.0) -> list[str]:
    """Processes of the killed CLI's session (its workers, forkserver, ...) still alive after it died."""
    deadline = time.time() + grace_s
    while True:
        alive = []
        for proc in psutil.process_iter(["pid", "name", "status"]):
            try:
                if os.getsid(proc.pid) == session and proc.info["status"] != psutil.STATUS_ZOMBIE:
                    alive.append(f"{proc.pid} {proc.info['name']}")
            except (ProcessLookupError, PermissionError):
                continue
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.5)


def _store_points(tracking_uri: str, run_key: str) -> dict[tuple[str, str], list[int]]:
    """Every metric point of a run's MLflow runs, read from the store's tables: (node or "parent", key) -> steps."""
    db = sqlite3.connect(sqlite_file(tracking_uri))
    rows = db.execute(
        "SELECT COALESCE(n.value, 'parent'), m.key, m.step FROM metrics m "
        "JOIN tags t ON t.run_uuid = m.run_uuid AND t.key = ? AND t.value = ? "
        "LEFT JOIN tags n ON n.run_uuid = m.run_uuid AND n.key = 'bhfl.node'",
        (RUN_KEY_TAG, run_key),
    ).fetchall()
    db.close()
    points: dict[tuple[str, str], list[int]] = {}
    for name, key, step in rows:
        points.setdefault((name, key), []).append(step)
    return {k: sorted(v) for k, v in points.items()}


def _artefacts(client: MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    found = set()
    for item in client.list_artifacts(run_id, path):
        found |= _artefacts(client, run_id, item.path) if item.is_dir else {item.path}
    return found


def _node_files(run_path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run_path / "state" / "nodes").glob("*.safetensors"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("resume")
    result = run_experiment(small_config(*EXTRA, config="bhfl-full.yaml"), run_dir)
    return run_dir, Path(result["run_path"])


@pytest.mark.timeout(1200)  # reference run + 11 `bhfl` processes: ~4 min idle, far more on a busy machine
def test_killed_and_resumed_run_is_bit_identical_to_uninterrupted(reference):
    run_dir, clean_path = reference
    sets = [arg for s in [*SMALL, *EXTRA] for arg in ("--set", s)]
    run_path = None
    for i, (fault, code, text, what) in enumerate(CHAIN):
        if run_path is None:
            out, session = _cli("run", "configs/bhfl-full.yaml", *sets, faults=fault, run_dir=run_dir)
            run_path = max((p for p in (run_dir / "itest").iterdir() if p != clean_path), key=lambda p: p.name)
        else:
            if i in LISTED_AFTER:
                listed, _ = _cli("runs", faults=None, run_dir=run_dir)
                assert listed.returncode == 0 and "a resume would redo: root round" in listed.stdout, listed.stdout
            out, session = _cli("resume", str(run_path), faults=fault, run_dir=run_dir)
        assert out.returncode == code, f"step {i}: {fault} ({what}): rc {out.returncode}\n{out.stderr[-3000:]}"
        assert text in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
        if code != KILLED:
            assert f"bhfl resume {run_path}" in out.stderr.replace("\n", "")  # the message says how to go on
        assert _leftovers(session) == [], f"step {i}: processes of the run outlived it"
        assert RunRecord.read(run_path).effective_status == ("interrupted" if code == KILLED else "failed")
    finished, _ = _cli("resume", str(run_path), faults=None, run_dir=run_dir)
    assert finished.returncode == 0, finished.stderr[-3000:]

    clean, resumed = _node_files(clean_path), _node_files(run_path)
    assert len(clean) > 8 and clean.keys() == resumed.keys()
    assert [name for name in clean if clean[name] != resumed[name]] == []
    assert not list((run_path / "state").glob("**/.*.tmp"))  # the killed write's temporary file was removed
    assert StateStore(run_path / "state").load("root").rounds_done == 3

    # MLflow: exactly the record of the uninterrupted run
    record, clean_record = RunRecord.read(run_path), RunRecord.read(clean_path)
    assert record.status == "finished" and record.resumes == len(CHAIN)
    client = MlflowClient(record.tracking_uri)
    parent = client.get_run(record.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["bhfl.resumes"] == str(len(CHAIN))
    runs = client.search_runs([parent.info.experiment_id], f"tags.`{RUN_KEY_TAG}` = '{record.run_key}'")
    assert sorted(r.info.run_id for r in runs) == sorted([record.parent_run_id, *record.node_runs.values()])
    assert {r.info.status for r in runs} == {"FINISHED"}  # the runs the first attempt created were adopted
    same_path = client.search_runs([parent.info.experiment_id], f"tags.`bhfl.run_path` = '{run_path}'")
    assert len(same_path) == 1  # one parent run for the whole, interrupted run
    got, want = (
        _store_points(record.tracking_uri, record.run_key),
        _store_points(clean_record.tracking_uri, clean_record.run_key),
    )
    twice = {k: steps for k, steps in got.items() if len(steps) != len(set(steps))}
    assert twice == {}, f"{len(twice)} metric histories have a step logged twice: {sorted(twice)[:5]}"
    assert got == want  # every point the uninterrupted run logged, at the same steps (timings at step 0)
    assert got[("parent", "time/total_s")] == [0]
    clean_client = MlflowClient(clean_record.tracking_uri)
    promised = _artefacts(clean_client, clean_record.parent_run_id)
    assert {"config.yaml", "environment/packages.txt", "data/manifest.json", "report.md"} <= promised
    assert _artefacts(client, record.parent_run_id) == promised

    # resuming the finished run changes nothing: no attempt, no MLflow write
    run_json, parent_end = (run_path / "run.json").read_bytes(), parent.info.end_time
    again, _ = _cli("resume", str(run_path), faults=None, run_dir=run_dir)
    assert again.returncode == 0 and "finished; nothing to resume" in " ".join(again.stderr.split()), again.stderr
    assert (run_path / "run.json").read_bytes() == run_json
    assert client.get_run(record.parent_run_id).info.end_time == parent_end
    assert _store_points(record.tracking_uri, record.run_key) == got


# Asynchronous edges (FedBuff, 2 in flight, a flush per result) in the same B-HFL example,
# with the root's proxy TRAIN alongside its subtrees: kills while clients are in flight and
# while a saved child result or a flush is written (every other point: tests/core/test_async_resume.py).
# The clients are persistent, so a client that ran ahead of its edge's checkpoint, or was
# trained twice, would change the final models.
ASYNC_EXTRA = [
    *EXTRA,
    "tree.edge.mode=async",
    "tree.edge.concurrency=2",
    "tree.edge.buffer=1",
    "tree.root.proxy_train=async",
    "tree.clock={sigma: 0.8, comm_s: 0.1}",
    "eval.every=0",
]
ASYNC_CHAIN = ["client@5", "checkpoint@9"]  # in flight; a saved child result or a flush being written


@pytest.mark.timeout(900)
def test_killed_asynchronous_run_resumes_bit_identically(tmp_path):
    clean = run_experiment(small_config(*ASYNC_EXTRA, config="bhfl-full.yaml"), tmp_path / "clean")
    clean_path = Path(clean["run_path"])
    run_dir = tmp_path / "killed"
    sets = [arg for s in [*SMALL, *ASYNC_EXTRA] for arg in ("--set", s)]
    run_path = None
    for i, fault in enumerate(ASYNC_CHAIN):
        if run_path is None:
            out, session = _cli("run", "configs/bhfl-full.yaml", *sets, faults=fault, run_dir=run_dir)
            run_path = next((run_dir / "itest").iterdir())
        else:
            out, session = _cli("resume", str(run_path), faults=fault, run_dir=run_dir)
        assert out.returncode == KILLED, f"step {i}: {fault}: rc {out.returncode}\n{out.stderr[-3000:]}"
        assert _leftovers(session) == [], f"step {i}: processes of the run outlived it"
    finished, _ = _cli("resume", str(run_path), faults=None, run_dir=run_dir)
    assert finished.returncode == 0, finished.stderr[-3000:]

    want, got = _node_files(clean_path), _node_files(run_path)
    assert len(want) > 8 and got.keys() == want.keys()
    assert [name for name in want if got[name] != want[name]] == []
    assert not list((run_path / "state" / "results").rglob("*.safetensors"))  # saved child results cleared
    record = RunRecord.read(run_path)
    client = MlflowClient(record.tracking_uri)
    flushes = [m.step for m in client.get_metric_history(record.node_runs["edge-de"], "async/buffered")]
    assert sorted(flushes) == list(range(1, 7))  # 3 root rounds x 2 flushes, each logged once
