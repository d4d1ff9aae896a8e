"""Bad input during a run: one paragraph, a non-zero exit, and a run that resumes once it is fixed.

(Config mistakes found before any work are in tests/flows/test_cli.py and
tests/core/test_config*.py; damaged data in tests/data/test_bad_data.py; out-of-memory and
disk-full errors in the kill-and-resume chain of tests/flows/test_resume.py.)
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient
from prefect.settings import PREFECT_API_URL

from flows.experiment import run_experiment
from flows.records.run_record import RunRecord
from tasks import faults
from tests.data.xglue_fixtures import write_xglue_nc
from tests.small import REPO, SMALL, small_config

pytestmark = pytest.mark.integration


def _cli(*args: str, run_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "flows.cli.app", *args, "--run-dir", str(run_dir)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)


def test_corrupt_parquet_mid_run_is_one_paragraph_and_the_run_resumes_once_fixed(tmp_path):
    data = write_xglue_nc(tmp_path / "xglue")
    good = (data / "nc" / "validation.fr.parquet").read_bytes()
    (data / "nc" / "validation.fr.parquet").write_bytes(b"PAR1 truncated by a failed copy")
    sets = [arg for s in [*SMALL, "tree.root.rounds=1", f"data.source.local_dir={data}"] for arg in ("--set", s)]
    failed = _cli("run", "configs/xglue-nc-parquet.yaml", *sets, run_dir=tmp_path / "runs")
    assert failed.returncode == 2, failed.stderr[-3000:]
    message = " ".join(failed.stderr.split())
    assert "Traceback" not in failed.stderr
    assert "could not load parquet files" in message and "validation.fr.parquet" in message
    (run_path,) = (tmp_path / "runs" / "itest").iterdir()
    assert f"bhfl resume {run_path}" in message
    assert RunRecord.read(run_path).status == "failed"

    (data / "nc" / "validation.fr.parquet").write_bytes(good)  # the user fixes the file
    resumed = _cli("resume", str(run_path), run_dir=tmp_path / "runs")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert RunRecord.read(run_path).status == "finished"


def test_a_client_that_keeps_failing_is_dropped_and_counted(tmp_path, monkeypatch):
    # the first client to train fails on both attempts (1 + runtime.retries) and is dropped;
    # a later client fails once and succeeds when retried in place
    monkeypatch.setenv(faults.ENV, "client@1:raise,client@2:raise,client@4:raise")
    cfg = small_config(
        "tree.root.rounds=1",
        "eval.every=0",
        "runtime.on_client_failure=drop",
        "runtime.retry_delay_s=0",
        "runtime.workers=1",
    )
    result = run_experiment(cfg, tmp_path)
    client = MlflowClient(result["tracking_uri"])
    runs = {
        r.data.tags.get("bhfl.node") or r.data.params["name"]: r for r in client.search_runs([result["experiment_id"]])
    }
    assert runs["itest"].info.status == "FINISHED"
    dropped = {
        name: [m.value for m in client.get_metric_history(r.info.run_id, "Training/dropped_clients")]
        for name, r in runs.items()
    }
    assert sum(sum(v) for v in dropped.values()) == 1.0  # exactly one client dropped, in one edge round
    (edge,) = [name for name, values in dropped.items() if values]
    up = client.get_metric_history(runs[edge].info.run_id, "comm/up_models")
    assert [m.value for m in up] == [1.0]  # cohort of 2, one model came back
