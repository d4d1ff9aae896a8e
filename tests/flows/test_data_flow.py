"""Data preparation as a Prefect flow inside a real experiment: XGLUE-layout parquet, masked LM, MLflow report."""

import gc
import json
import logging
import os
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
from mlflow import MlflowClient
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterId
from prefect.settings import PREFECT_API_URL

from bhfl_core.analysis.matrix_axes import client_order
from flows.data import _task_step, prepare_data_flow, run_prepare
from flows.experiment import run_experiment
from tasks.context import open_run
from tests.data.xglue_fixtures import write_xglue_nc
from tests.flows.commands import scored_with
from tests.small import small_config

# own_data_cache: the cold and warm preparations of each run dir are checked
pytestmark = [pytest.mark.integration, pytest.mark.own_data_cache]

REPO = Path(__file__).resolve().parents[2]
STEPS = {
    "load-pool",
    "partition",
    "proxy-split",
    "tokenizer",
    "tokenise",
    "assign-edges",
    "write-manifest",
    "partition-report",
}


def _task_names(flow_run_id, expect: int, timeout: float = 20.0) -> set[str]:
    """Task runs of a flow run (the server ingests task-run events shortly after the fact)."""
    deadline = time.time() + timeout
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            names = {r.name.rsplit("-", 1)[0] for r in runs}
            if len(names) >= expect or time.time() > deadline:
                return names
            time.sleep(0.5)


@pytest.fixture(scope="module")
def mlm_run(tmp_path_factory):
    folder = write_xglue_nc(tmp_path_factory.mktemp("xglue"))
    cfg = small_config(
        f"data.source={{kind: xglue, local_dir: '{folder}', languages: [en, de, fr]}}",
        "data.task=mlm",
        "tree.root.rounds=1",
        "eval.every=0",
    )
    root = tmp_path_factory.mktemp("runs")
    return cfg, root, run_experiment(cfg, root)


def test_masked_lm_experiment_on_local_xglue_parquet(mlm_run):
    _cfg, _root, result = mlm_run
    headline = result["headline"]
    perplexities = [v for k, v in headline.items() if k.endswith("perplexity") or "perplexity_" in k]
    assert perplexities and all(1.0 < v < 5 * 400 for v in perplexities)  # vocab 400: far below chance-level blow-up
    manifest = json.loads(
        (
            Path(json.loads((Path(result["run_path"]) / "data.json").read_text())["data_root"]) / "manifest.json"
        ).read_text()
    )
    assert manifest["task"] == "mlm" and manifest["mask_token_id"] == 4 and manifest["source"].startswith("xglue/nc")


def test_masked_lm_masks_stay_with_their_rows_when_a_model_is_scored_on_a_sample(mlm_run):
    """A client model scored on its ring sample (its clients' rows only) meets the masks those rows have in the
    whole table: the same perplexity as the full evaluation gave on each of those clients."""
    _cfg, _root, result = mlm_run
    matrix = (Path(result["run_path"]) / "report" / "eval" / "matrix.csv").read_text().splitlines()
    value = {(n, t, m): float(v) for n, _, t, m, v in (line.split(",") for line in matrix[1:])}
    sampled, _ = scored_with(result["run_path"], "en-01", client_model_sample=1)
    clients = client_order(open_run(result["run_path"]).tree)
    assert len(sampled.clients) == 1 + 3
    for position, (loss, _) in zip(sampled.clients, sampled.on_clients):
        assert loss == pytest.approx(value[("en-01", clients[position], "loss")], abs=1e-6)


def test_partition_report_is_logged_to_the_parent_run(mlm_run):
    _, root, result = mlm_run
    client = MlflowClient(result["tracking_uri"])
    files = {a.path for a in client.list_artifacts(result["run_id"], "data")}
    assert {
        "data/manifest.json",
        "data/summary.json",
        "data/partition.md",
        "data/client_sizes.png",
        "data/label_skew.png",
        "data/client_sizes.svg",  # a vector copy beside each figure
        "data/label_skew.svg",
    } <= files
    png = Path(client.download_artifacts(result["run_id"], "data/label_skew.png", str(root / "dl")))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    parent = client.get_run(result["run_id"]).data
    assert parent.metrics["data/clients"] == 9 and parent.metrics["data/edges"] == 3
    assert parent.tags["bhfl.task"] == "mlm" and parent.tags["bhfl.data_source"].startswith(
        "xglue/nc from local parquet"
    )


def test_prepare_is_a_flow_of_step_tasks_and_a_rerun_is_a_cache_hit(mlm_run, caplog):
    cfg, root, _ = mlm_run
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["prepare-data"])))
    cold = [r for r in runs if r.parameters.get("cache_root") == str((root / "cache").resolve())]
    assert len(cold) == 1 and cold[0].state.is_completed()
    assert _task_names(cold[0].id, len(STEPS)) == STEPS
    # the same config again: the flow finds the fingerprint and runs no step at all
    state = prepare_data_flow(
        cfg.model_dump(mode="json", by_alias=True), str((root / "cache").resolve()), return_state=True
    )
    assert state.result()["cached"] is True
    time.sleep(1.0)
    assert _task_names(state.state_details.flow_run_id, 0, timeout=1.0) == set()
    with caplog.at_level(logging.INFO, logger="bhfl.progress"):  # the progress notes a user sees
        again = run_prepare(cfg, (root / "cache").resolve())
    assert again.cached and any("no tokenisation" in n for n in caplog.messages)


class _Table:
    """Stands for a step's value (the raw pool, its tokenised tables): something only a reference keeps alive."""


def test_a_steps_value_is_not_kept_by_prefect_once_the_flow_is_done():
    """The preparation's tables die with their last use: Prefect keeps a task's result alive in its run states,
    which held ~300 MB in the command for a whole 10,000-client run."""
    seen: list[weakref.ref] = []

    @flow(name="steps-values")
    def steps() -> bool:
        table = _task_step("load-pool", _Table)
        seen.append(weakref.ref(table))
        return isinstance(table, _Table)

    assert steps() is True  # the value still arrives
    gc.collect()
    assert seen and seen[0]() is None


def _cli(*args, cwd=REPO):
    # the session's Prefect test server, so the CLI does not start (and migrate) one of its own
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    return subprocess.run(
        [sys.executable, "-m", "flows.cli.app", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )


def test_cli_hub_model_offline_is_one_clear_paragraph(tmp_path):
    out = _cli("run", "configs/xglue-nc-mbert.yaml", "--run-dir", str(tmp_path))
    assert out.returncode == 2 and "Traceback" not in out.stderr + out.stdout
    assert "model.name: could not load the model 'bert-base-multilingual-cased'" in out.stderr
    assert "set model.name: DIR" in " ".join(out.stderr.split())
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "cache").exists()  # stopped before any work


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])  # nothing listens there once the socket is closed


def test_cli_hub_names_fail_fast_without_hf_hub_offline(tmp_path):
    """No HF_HUB_OFFLINE and no hub: one quick probe, not the hub client's ~30 s of retries, then one paragraph.

    The hub is a closed local port (HF_ENDPOINT), so the check cannot pass by accident on a machine with network.
    """
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}", "COLUMNS": "200"}
    for online in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "PREFECT_API_URL"):
        env.pop(online, None)

    def failure(*args: str) -> str:
        """``bhfl ARGS``'s error paragraph (exit 2, no traceback), whitespace folded."""
        out = subprocess.run(
            [sys.executable, "-m", "flows.cli.app", *args, "--run-dir", str(tmp_path)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,  # a retried load takes ~30 s after the imports; the probe fails at once
            env=env,
            check=False,
        )
        assert out.returncode == 2 and "Traceback" not in out.stderr + out.stdout, out.stderr[-3000:]
        return " ".join(out.stderr.split())

    hub = env["HF_ENDPOINT"]
    model = failure("run", "configs/xglue-nc-mbert.yaml")
    assert f"model.name: 'bert-base-multilingual-cased' is a Hugging Face hub name, but the hub at {hub}" in model
    assert "set HF_HUB_OFFLINE=1" in model and "set model.name: DIR" in model
    assert not (tmp_path / ".prefect").exists() and not (tmp_path / "mlflow.db").exists()  # nothing started
    local_model_hub_data = ("--set", "model.name=tiny-bert", "--set", "data.source.local_dir=null")
    data = failure("prepare", "configs/xglue-nc-mbert.yaml", *local_model_hub_data)
    assert f"data.source.repo: 'microsoft/xglue' is a Hugging Face hub name, but the hub at {hub}" in data
    assert "data.source.local_dir: <folder of XGLUE parquet files>" in data and not (tmp_path / "cache").exists()


def test_cli_prepare_prints_the_partition_and_missing_files_are_clear(tmp_path):
    out = _cli(
        "prepare",
        "configs/xglue-nc-parquet.yaml",
        "--set",
        f"data.source.local_dir={tmp_path / 'none'}",
        "--run-dir",
        str(tmp_path),
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"data.source.local_dir: '{tmp_path / 'none'}' does not exist" in " ".join(out.stderr.split())
    folder = write_xglue_nc(tmp_path / "xglue", languages=("en", "de", "es", "fr", "ru"))
    out = _cli(
        "prepare",
        "configs/xglue-nc-parquet.yaml",
        "--set",
        f"data.source.local_dir={folder}",
        "--set",
        "data.clients_per_language=3",
        "--set",
        "data.sizes={median: 30, sigma: 0.5, min: 10, max: 60}",
        "--set",
        "data.proxy={train_per_language: 20, test_per_language: 10}",
        "--set",
        "model.tiny.vocab_size=300",
        "--set",
        "tree.edge.cohort=2",
        "--run-dir",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    assert "| de | 3 | 1 |" in out.stdout and "Held out: test.en, test.de, test.es, test.fr, test.ru." in out.stdout
    assert "prepared in" in out.stdout and len(list((tmp_path / "cache").glob("*/manifest.json"))) == 1
