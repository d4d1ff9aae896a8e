"""SIGKILL a real run at several moments, resume it each time: the final node models are
bit-identical to an uninterrupted run, and MLflow holds one parent run without duplicates.

The experiment is the B-HFL example (FedAdam both ways, proxy training, up- and
down-residuals, cohort sampling, evaluation every root round), shrunken. It runs as the
user runs it: `bhfl run` / `bhfl resume` in subprocesses against the session's Prefect
server. Each process is killed by the pipeline's fault injector (BHFL_FAULTS, a real
SIGKILL) at a chosen point; the kills form one chain, so a run interrupted several
times, at every kind of point, must still end exactly where the uninterrupted one ends.
"""

import os
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
from tests.small import REPO, SMALL, small_config

pytestmark = pytest.mark.integration

EXTRA = ["tree.root.rounds=3", "tree.edge.rounds=2", "eval.every=1"]
KILLED = -9  # returncode of a process killed by SIGKILL
# One chain of interruptions, in the order the run meets them:
# (fault, expected return code, text the user must see, what it interrupts)
CHAIN = [
    ("client@2", KILLED, "", "early: the second client of the first edge round, before its training"),
    ("round@3", KILLED, "", "mid-subtree: after edge-fr's first round, inside europe-west's execution"),
    # a worker task is retried once (runtime.retries): the error must hit twice to fail the run
    ("client@2:oom,client@3:oom", 1, "Out of GPU memory", "a CUDA out-of-memory error while a client trains"),
    ("checkpoint@7", KILLED, "", "a checkpoint write: the temporary file is written, not yet renamed"),
    ("checkpoint@3:enospc,checkpoint@4:enospc", 1, "The disk is full", "disk full while writing a checkpoint"),
    ("eval@1", KILLED, "", "during evaluation: the evaluation after a root round"),
]

LISTED_AFTER = (1, 3)  # `bhfl runs` is checked after a kill and after a failure (6 s a call: not after each)


def _cli(*args: str, faults: str | None, run_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "HF_HUB_OFFLINE": "1"}
    env.pop("BHFL_FAULTS", None)
    if faults:
        env["BHFL_FAULTS"] = faults
    cmd = [sys.executable, "-m", "flows.cli.app", *args, "--run-dir", str(run_dir)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)


def _leftovers(run_path: Path, grace_s: float = 15.0) -> list[int]:
    """The run's worker processes (``run.json`` names them) still alive after its orchestrator died."""
    pids = [int(w["pid"]) for w in RunRecord.read(run_path).workers]
    assert pids, "the run recorded no workers"
    deadline = time.time() + grace_s
    while True:
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.5)


def _node_files(run_path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run_path / "state" / "nodes").glob("*.safetensors"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("resume")
    result = run_experiment(small_config(*EXTRA, config="bhfl-full.yaml"), run_dir)
    return run_dir, Path(result["run_path"])


@pytest.mark.timeout(900)  # reference run + 9 `bhfl` processes: ~3 min idle, far more on a busy machine (default 300 s)
def test_killed_and_resumed_run_is_bit_identical_to_uninterrupted(reference):
    run_dir, clean_path = reference
    sets = [arg for s in [*SMALL, *EXTRA] for arg in ("--set", s)]
    run_path = None
    for i, (fault, code, text, what) in enumerate(CHAIN):
        if run_path is None:
            out = _cli("run", "configs/bhfl-full.yaml", *sets, faults=fault, run_dir=run_dir)
            run_path = max((p for p in (run_dir / "itest").iterdir() if p != clean_path), key=lambda p: p.name)
        else:
            if i in LISTED_AFTER:
                listed = _cli("runs", faults=None, run_dir=run_dir)
                assert listed.returncode == 0 and "a resume would redo: root round" in listed.stdout, listed.stdout
            out = _cli("resume", str(run_path), faults=fault, run_dir=run_dir)
        assert out.returncode == code, f"step {i}: {fault} ({what}): rc {out.returncode}\n{out.stderr[-3000:]}"
        assert text in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
        if code != KILLED:
            assert f"bhfl resume {run_path}" in out.stderr.replace("\n", "")  # the message says how to go on
        assert _leftovers(run_path) == [], f"step {i}: processes of the run outlived it"
        assert RunRecord.read(run_path).effective_status == ("interrupted" if code == KILLED else "failed")
    finished = _cli("resume", str(run_path), faults=None, run_dir=run_dir)
    assert finished.returncode == 0, finished.stderr[-3000:]

    clean, resumed = _node_files(clean_path), _node_files(run_path)
    assert len(clean) > 8 and clean.keys() == resumed.keys()
    assert [name for name in clean if clean[name] != resumed[name]] == []
    assert not list((run_path / "state").glob("**/.*.tmp"))  # the killed write's temporary file was removed
    assert StateStore(run_path / "state").load("root").rounds_done == 3

    record = RunRecord.read(run_path)
    assert record.status == "finished" and record.resumes == len(CHAIN)
    client = MlflowClient(record.tracking_uri)
    parent = client.get_run(record.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["bhfl.resumes"] == str(len(CHAIN))
    same_name = client.search_runs([parent.info.experiment_id], f"tags.`bhfl.run_path` = '{run_path}'")
    assert len(same_name) == 1  # one parent run for the whole, interrupted run
    root_run = record.node_runs["root"]
    for key in ("proxy_train/loss", "eval/union/accuracy"):
        steps = [m.step for m in client.get_metric_history(root_run, key)]
        assert sorted(steps) == [1, 2, 3], (key, steps)  # every root round once, none twice
    edge_steps = [m.step for m in client.get_metric_history(record.node_runs["edge-de"], "train/loss")]
    assert sorted(edge_steps) == list(range(1, 7))  # 3 root rounds x 2 edge rounds, each once


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
            out = _cli("run", "configs/bhfl-full.yaml", *sets, faults=fault, run_dir=run_dir)
            run_path = next((run_dir / "itest").iterdir())
        else:
            out = _cli("resume", str(run_path), faults=fault, run_dir=run_dir)
        assert out.returncode == KILLED, f"step {i}: {fault}: rc {out.returncode}\n{out.stderr[-3000:]}"
        assert _leftovers(run_path) == [], f"step {i}: processes of the run outlived it"
    finished = _cli("resume", str(run_path), faults=None, run_dir=run_dir)
    assert finished.returncode == 0, finished.stderr[-3000:]

    want, got = _node_files(clean_path), _node_files(run_path)
    assert len(want) > 8 and got.keys() == want.keys()
    assert [name for name in want if got[name] != want[name]] == []
    assert not list((run_path / "state" / "results").rglob("*.safetensors"))  # saved child results cleared
    record = RunRecord.read(run_path)
    client = MlflowClient(record.tracking_uri)
    flushes = [m.step for m in client.get_metric_history(record.node_runs["edge-de"], "async/buffered")]
    assert sorted(flushes) == list(range(1, 7))  # 3 root rounds x 2 flushes, each logged once
