"""Faults beyond the CLI process, each with a real process killed or stopped (docs/runtime.md, "Faults").

- A local worker process SIGKILLed mid-round: the run is told which worker was lost and
  that its call ran again (stderr, run.json, MLflow); the restarted worker runs it.
- The run's own Prefect server SIGKILLed mid-run: the command stops at once (exit 75,
  one paragraph, nothing left running), and `bhfl resume` finishes the run.
- A worker of a user-started Dask cluster (`dask worker --no-nanny`, nothing restarts
  it) lost mid-round: the run stops with a paragraph; `bhfl resume` finishes it on the
  worker that remains.

Every finished run's node files are compared, byte for byte, with a run that never
stopped (in one process, without Prefect). Commands stopped by SIGTERM or SIGHUP:
tests/flows/test_signals.py.
"""

import os
import re
import signal

import psutil
import pytest
from mlflow import MlflowClient

from flows.records.run_record import RunRecord
from tests.flows.commands import own_servers_env, sets, start, wait_for
from tests.flows.dask_cluster import user_cluster
from tests.flows.kill_chain import cli, leftovers, node_files, uninterrupted

pytestmark = pytest.mark.integration

ROOT_ROUND_1 = "root round 1/2 done"


def _dead(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, bytes]:
    """The node files of a run of the small experiment that never stopped (in one process, no Prefect)."""
    return uninterrupted(tmp_path_factory.mktemp("faults-reference"))


def test_a_lost_local_worker_is_told_and_a_dead_prefect_server_stops_the_run_for_a_resume(tmp_path, reference):
    """Two faults of one run: a worker SIGKILLed in root round 1 (the run goes on), then the run's own Prefect
    server SIGKILLed after it (the command stops at once); `bhfl resume` finishes bit-identically."""
    run_dir, log = tmp_path / "runs", tmp_path / "run.log"
    # client@3: the third client trained anywhere, in root round 1 (6 clients), its worker's batch not finished;
    # eval@1: the run holds still (SIGSTOP) at its first evaluation, after root round 1, while its server is killed
    faults = own_servers_env(BHFL_FAULTS="client@3:die,eval@1:pause")
    proc = start(["run", *sets(), "--run-dir", str(run_dir)], faults, log)
    try:
        wait_for("the pause", lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED, proc, log)
        assert ROOT_ROUND_1 in log.read_text()
        (server,) = [p for p in psutil.Process(proc.pid).children() if "prefect.server" in " ".join(p.cmdline())]
        server.kill()
        wait_for("the server's death", lambda: _dead(server), proc, log)  # a zombie: its parent is stopped
        proc.send_signal(signal.SIGCONT)
        code = proc.wait(timeout=60)  # stops at once, not after minutes of retries against the dead server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    (run_path,) = (run_dir / "itest").iterdir()

    # the lost worker: named on stderr, its call ran again on it once restarted; in run.json's file of losses
    lost = re.findall(r"worker (cpu-\d) was lost before finishing its call \(training [^)]+\); restarted", out)
    assert lost, out[-3000:]
    record = RunRecord.read(run_path)
    original = {w["name"]: int(w["pid"]) for w in record.workers}
    assert not psutil.pid_exists(original[lost[0]]), "the worker named is the one that died"

    # the dead server: one paragraph, exit 75, nothing of the run left running
    assert code == 75, out[-3000:]
    assert f"the Prefect server this command started died (pid {server.pid}, killed by SIGKILL" in out
    assert f"`bhfl resume {run_path}` continues" in out and "Traceback" not in out, out[-3000:]
    assert leftovers(proc.pid) == [], "processes of the run outlived it"
    assert record.effective_status == "interrupted"

    resumed, _ = cli("resume", str(run_path), faults=None, run_dir=run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert node_files(run_path) == reference
    record = RunRecord.read(run_path)
    assert [x["worker"] for x in record.worker_losses] == lost  # kept across attempts
    assert {x["cause"] for x in record.worker_losses} == {"handle-worker-cleanup"}  # its connection closed: it died
    parent = MlflowClient(record.tracking_uri).get_run(record.parent_run_id)
    assert parent.data.metrics["runtime/worker_losses"] == len(lost)
    assert parent.data.tags["bhfl.worker_losses"].startswith(f"{lost[0]} lost during training ")


def test_a_lost_worker_of_a_user_cluster_stops_the_run_and_resume_finishes_on_the_others(tmp_path, reference):
    env = own_servers_env(HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    # the workers' fault plan: the fifth client trained on either, in root round 1 (counted in one file)
    faults = {"BHFL_FAULTS": "client@5:die", "BHFL_FAULTS_COUNTER": str(tmp_path / "faults.txt")}
    with user_cluster(tmp_path, {**env, **faults}, nanny=False) as (address, procs):
        run_dir = tmp_path / "runs"
        cluster = sets("runtime.executor=cluster", f"runtime.cluster={address}", "runtime.workers=auto")
        failed, session = cli("run", *cluster, faults=None, run_dir=run_dir)
        assert failed.returncode == 1, failed.stderr[-3000:]
        err = " ".join(failed.stderr.split())
        lost = re.search(r"worker (w\d) of the Dask cluster at \S+ was lost before finishing its call", err)
        assert lost and "(it has no nanny to restart it)" in err and "Traceback" not in err, err[-3000:]
        (run_path,) = (run_dir / "itest").iterdir()
        assert f"continue with `bhfl resume {run_path}`" in err
        assert [p.args[4] for p in procs[1:] if p.poll() is not None] == [lost.group(1)]  # --name's value
        assert leftovers(session) == []

        resumed, _ = cli("resume", str(run_path), faults=None, run_dir=run_dir)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        remaining = {"w0": "w1", "w1": "w0"}[lost.group(1)]
        assert f"1 worker(s): {remaining} (cpu)" in resumed.stderr  # placed on the worker that remains
        assert node_files(run_path) == reference
