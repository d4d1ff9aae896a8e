"""SIGKILL an asynchronous run while clients are in flight and while a saved child result
or a buffer flush is written; each resume must end bit-identical to a run that never
stopped (every other kill point of the asynchronous engine: tests/core/test_async_resume.py).

The B-HFL example (tests/flows/test_resume.py) with FedBuff edges, run and resumed as
`bhfl run` / `bhfl resume` subprocesses against the session's Prefect server.
"""

from pathlib import Path

import pytest
from mlflow import MlflowClient

from flows.experiment import PLAIN_CALLS, run_experiment
from flows.records.run_record import RunRecord
from tests.flows.kill_chain import EXAMPLE, KILLED, cli, leftovers, node_files
from tests.small import SMALL, small_config

pytestmark = pytest.mark.integration

# Asynchronous edges (FedBuff, 2 in flight, a flush per result) in the same B-HFL example,
# with the root's proxy TRAIN alongside its subtrees: kills while clients are in flight and
# while a saved child result or a flush is written (every other point: tests/core/test_async_resume.py).
# The clients are persistent, so a client that ran ahead of its edge's checkpoint, or was
# trained twice, would change the final models.
ASYNC_EXTRA = [
    *EXAMPLE,
    "tree.edge.mode=async",
    "tree.edge.concurrency=2",
    "tree.edge.buffer=1",
    "tree.root.proxy_train=async",
    "tree.clock={sigma: 0.8, comm_s: 0.1}",
    "eval.every=0",
]
ASYNC_CHAIN = ["client@5", "checkpoint@9"]  # in flight; a saved child result or a flush being written


@pytest.mark.timeout(1200)
def test_killed_asynchronous_run_resumes_bit_identically(tmp_path):
    clean = run_experiment(
        small_config(*ASYNC_EXTRA, config="bhfl-full.yaml"), tmp_path / "clean", orchestration=PLAIN_CALLS
    )
    clean_path = Path(clean["run_path"])
    run_dir = tmp_path / "killed"
    sets = [arg for s in [*SMALL, *ASYNC_EXTRA] for arg in ("--set", s)]
    run_path = None
    for i, fault in enumerate(ASYNC_CHAIN):
        if run_path is None:
            out, session = cli("run", "configs/bhfl-full.yaml", *sets, faults=fault, run_dir=run_dir)
            run_path = next((run_dir / "itest").iterdir())
        else:
            out, session = cli("resume", str(run_path), faults=fault, run_dir=run_dir)
        assert out.returncode == KILLED, f"step {i}: {fault}: rc {out.returncode}\n{out.stderr[-3000:]}"
        assert leftovers(session) == [], f"step {i}: processes of the run outlived it"
    # The last resume runs in-process (a runtime.* change, which must not change results either).
    finished, _ = cli("resume", str(run_path), "--set", "runtime.executor=inprocess", faults=None, run_dir=run_dir)
    assert finished.returncode == 0, finished.stderr[-3000:]

    want, got = node_files(clean_path), node_files(run_path)
    assert len(want) > 8 and got.keys() == want.keys()
    assert [name for name in want if got[name] != want[name]] == []
    assert not list((run_path / "state" / "results").rglob("*.safetensors"))  # saved child results cleared
    record = RunRecord.read(run_path)
    client = MlflowClient(record.tracking_uri)
    flushes = [m.step for m in client.get_metric_history(record.node_runs["edge-de"], "async/buffered")]
    assert sorted(flushes) == list(range(1, 7))  # 3 root rounds x 2 flushes, each logged once
