"""Staged pipelines through real Prefect, MLflow and tiny transformers runs: warm starts, nesting, resume.

One shrunken three-stage pipeline: ``a`` flat FedAvg; ``b`` root -> edges -> clients
starting from ``a``'s root (``model.init_from: a:root``); ``c`` the same tree starting
tree-shaped from ``b`` (``model.init_from: b``), its edge servers mixing their copied
model half-and-half with the root's (``eta_down: 0.5``) so that the copy is visible in
what they send down.
"""

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from prefect.settings import PREFECT_API_URL
from typer.testing import CliRunner

from bhfl_core.config.base import ConfigError
from bhfl_core.config.pipeline import pipeline_from_dict
from bhfl_core.store.node_store import StateStore
from bhfl_core.store.transfer import TensorRef, Transfer
from flows.cli.app import app
from flows.experiment import run_experiment
from flows.pipeline import check_sources, pipeline_deployment, pipeline_flow, resume_pipeline, run_pipeline
from flows.records.pipeline_record import PipelineRecord
from flows.records.run_record import RunRecord, default_tracking_uri
from flows.records.warm_source import resolve_init_from
from tasks import faults
from tests.small import REPO, SMALL

pytestmark = pytest.mark.integration

# the small data and model of tests/small.py; training in this process (no worker cluster per stage: ~15 s less)
SHRINK = [s for s in SMALL if not s.startswith(("name=", "tree.", "eval."))] + [
    "tree.client.train.epochs=1",
    "eval.figures=false",
    "runtime.executor=inprocess",
    "runtime.transfer=run_folder",  # the models sent stay in the run folder: the tests look at them
]
STAGES = {
    "a": {"base": "fedavg.yaml", "tree": {"root": {"rounds": 1, "cohort": 3}}},
    "b": {
        "base": "hierfavg.yaml",
        "model": {"init_from": "a:root"},
        "tree": {"root": {"rounds": 1}, "edge": {"rounds": 2, "cohort": 2}},
    },
    "c": {
        "base": "hierfavg.yaml",
        "model": {"init_from": "b"},
        "tree": {"root": {"rounds": 1}, "edge": {"rounds": 1, "cohort": 2, "eta_down": 0.5}},
    },
}
EDGES = ("edge-en", "edge-de", "edge-fr")
CLIENTS = [f"{lang}-{i:02d}" for lang in ("en", "de", "fr") for i in range(3)]


def _pipeline(*extra: str):
    return pipeline_from_dict({"name": "tp", "stages": STAGES}, [*SHRINK, *extra], "tp.yaml", REPO / "configs")


def _store(result, stage: str) -> StateStore:
    return StateStore(Path(result["stages"][stage]["run_path"]) / "state")


def _message(result, stage: str, name: str) -> torch.Tensor:
    """A model the stage sent (kept in the run folder: ``runtime.transfer=run_folder``)."""
    folder = Path(result["stages"][stage]["run_path"]) / "state" / "transfer"
    return Transfer.get(TensorRef(str(folder / name), _store(result, stage).load_model("root").numel()))


def _node_files(result, stage: str) -> dict[str, bytes]:
    folder = Path(result["stages"][stage]["run_path"]) / "state" / "nodes"
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """The pipeline run as `bhfl serve PIPELINE.yaml` runs a scheduled or triggered run: the flow called with the
    deployment's parameters (through JSON, as Prefect keeps them), making its own pipeline folder (the pipeline
    through `bhfl run`'s path: the resume test)."""
    root = tmp_path_factory.mktemp("pipeline-runs")
    deployment = pipeline_deployment(_pipeline(), "0 2 * * *", "nightly", root, default_tracking_uri(root))
    assert deployment.name == "nightly" and deployment.tags == ["bhfl", "pipeline", "tp"]
    state = pipeline_flow(**json.loads(json.dumps(deployment.parameters)), return_state=True)
    return root, state.result(), state.state_details.flow_run_id


def test_warm_starts_copy_the_source_models_bit_for_bit(finished):
    _, result, _ = finished
    assert {s["status"] for s in result["stages"].values()} == {"finished"}
    a, b, c = (_store(result, s) for s in "abc")
    # b's root started from a's final root: what it sent down in its one round is that model
    assert torch.equal(_message(result, "b", "root.down"), a.load_model("root"))
    # c (tree-shaped from b): the root from b's root, every edge from b's edge (mixed 0.5 with the root's)
    c_root = _message(result, "c", "root.down")
    assert torch.equal(c_root, b.load_model("root"))
    for edge in EDGES:
        assert torch.equal(_message(result, "c", f"{edge}.down"), torch.lerp(b.load_model(edge), c_root, 0.5))
    # clients c did not train kept the model they were copied from b, with fresh state
    untouched = [n for n in CLIENTS if c.load_info(n).get("rounds_done", 0) == 0]
    assert untouched, "cohorts of 2 of 3 clients leave one client per edge untrained in c"
    for client in untouched:
        copied, source = c.load_model(client), b.load_model(client)
        assert (copied is None) == (source is None)
        assert copied is None or torch.equal(copied, source)
    assert any(b.has(n) for n in untouched)
    # the stages' configs hold the absolute source folder (a resume never depends on the cwd)
    b_config = yaml.safe_load((Path(result["stages"]["b"]["run_path"]) / "config.yaml").read_text())
    assert b_config["model"]["init_from"] == f"{result['stages']['a']['run_path']}:root"
    c_config = yaml.safe_load((Path(result["stages"]["c"]["run_path"]) / "config.yaml").read_text())
    assert c_config["model"]["init_from"] == result["stages"]["b"]["run_path"]


def test_mlflow_nests_pipeline_stage_and_node_runs(finished):
    _, result, _ = finished
    client = MlflowClient(result["tracking_uri"])
    pipeline_run = client.get_run(result["run_id"])
    experiment = client.get_experiment(pipeline_run.info.experiment_id)
    assert experiment.name == "tp" and pipeline_run.info.run_name == "tp" and pipeline_run.info.status == "FINISHED"
    assert "mlflow.parentRunId" not in pipeline_run.data.tags
    assert pipeline_run.data.tags["bhfl.pipeline_path"] == result["pipeline_path"]
    assert pipeline_run.data.tags["bhfl.seed"] == "0"  # its stages' seed, as the stage runs are tagged
    for stage, entry in result["stages"].items():
        run = client.get_run(entry["run_id"])
        assert run.info.experiment_id == experiment.experiment_id and run.info.run_name.startswith(
            f"tp-{stage} seed=0 "
        )
        assert run.data.tags["mlflow.parentRunId"] == result["run_id"]
        assert run.data.tags["bhfl.pipeline_stage"] == stage and run.info.status == "FINISHED"
        nodes = RunRecord.read(Path(entry["run_path"])).node_runs
        root_run = client.get_run(nodes["root"])
        assert root_run.data.tags["mlflow.parentRunId"] == entry["run_id"]
        assert root_run.info.experiment_id == experiment.experiment_id
        # each stage's headlines on the pipeline run, prefixed with the stage
        stage_value = run.data.metrics["client_on_own_clients/accuracy_mean"]
        assert pipeline_run.data.metrics[f"{stage}/client_on_own_clients/accuracy_mean"] == stage_value
    edge_run = client.get_run(RunRecord.read(Path(result["stages"]["b"]["run_path"])).node_runs["edge-de"])
    assert client.get_run(edge_run.data.tags["mlflow.parentRunId"]).info.run_name == "root"
    metrics = pipeline_run.data.metrics
    last = client.get_run(result["stages"]["c"]["run_id"]).data.metrics
    assert metrics["client_on_own_clients/accuracy_mean"] == last["client_on_own_clients/accuracy_mean"]
    stage_comm = [
        client.get_run(e["run_id"]).data.metrics["comm/total_model_equivalents"] for e in result["stages"].values()
    ]
    assert metrics["comm/total_model_equivalents"] == sum(stage_comm) > 0
    assert "pipeline.yaml" in {a.path for a in client.list_artifacts(result["run_id"])}


def test_prefect_runs_the_stages_as_subflows_of_the_pipeline(finished):
    root, result, flow_run_id = finished
    assert Path(result["pipeline_path"]).parent == root.resolve() / "tp"  # a new folder per triggered run
    with get_client(sync_client=True) as client:
        pipeline = client.read_flow_run(flow_run_id)
        stages = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["a", "b", "c"])))
        parents = {r.name: client.read_task_run(r.parent_task_run_id).flow_run_id for r in stages}
    assert pipeline.state.is_completed()
    assert parents == {"a": pipeline.id, "b": pipeline.id, "c": pipeline.id}


def test_resume_skips_finished_stages_and_ends_bit_identical(finished, monkeypatch, tmp_path, caplog):
    root, clean, _ = finished
    monkeypatch.setenv(faults.COUNTER_ENV, str(tmp_path / "faults.txt"))  # one hit counter across the stages
    # server rounds: a's root (1), then b's edges (2-4: first rounds, 5-7: second rounds) and root (8)
    monkeypatch.setenv(faults.ENV, "round@5:raise")
    folder = root / "tp" / "interrupted"
    with caplog.at_level(logging.INFO, logger="bhfl.progress"), pytest.raises(RuntimeError, match="round #5"):
        run_pipeline(_pipeline(), root, folder=folder)
    record = PipelineRecord.read(folder)
    assert record.status == "failed" and "injected fault" in record.error
    assert [record.stages[s].status for s in "abc"] == ["finished", "failed", "pending"]
    with get_client(sync_client=True) as prefect:  # what the Prefect UI shows: the pipeline and its stage b Failed
        # named as `bhfl run` names an experiment's: the pipeline's name and the minute (it was the folder's name)
        named = prefect.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="tp 20")))
        (failed,) = [r for r in named if r.parameters.get("pipeline_path") == str(folder.resolve())]
        assert re.fullmatch(r"tp \d{4}-\d\d-\d\d \d\d:\d\d", failed.name), failed.name
        stage_b = {
            prefect.read_task_run(r.parent_task_run_id).flow_run_id: r.state
            for r in prefect.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["b"])))
        }
    assert failed.state.is_failed() and stage_b[failed.id].is_failed()
    a_path, b_path = (Path(record.stages[s].run_path) for s in "ab")
    assert RunRecord.read(b_path).status == "failed"
    a_before = {
        "record": (a_path / "run.json").read_bytes(),
        "mtime": (a_path / "run.json").stat().st_mtime_ns,
        "nodes": {p.name: p.read_bytes() for p in (a_path / "state" / "nodes").iterdir()},
    }
    b_run_id = RunRecord.read(b_path).parent_run_id

    monkeypatch.delenv(faults.ENV)
    result = resume_pipeline(folder)
    assert [result["stages"][s]["status"] for s in "abc"] == ["finished"] * 3
    assert result["run_id"] == record.run_id and result["resumes"] == 1
    # a was not run again: its folder is untouched
    assert (a_path / "run.json").read_bytes() == a_before["record"]
    assert (a_path / "run.json").stat().st_mtime_ns == a_before["mtime"]
    assert {p.name: p.read_bytes() for p in (a_path / "state" / "nodes").iterdir()} == a_before["nodes"]
    assert RunRecord.read(a_path).resumes == 0
    # b resumed in its folder (same MLflow parent run), c started; both end where the clean pipeline ended
    assert result["stages"]["b"]["run_path"] == str(b_path) and RunRecord.read(b_path).resumes == 1
    assert RunRecord.read(b_path).parent_run_id == b_run_id == result["stages"]["b"]["run_id"]
    for stage in "bc":
        assert _node_files(result, stage) == _node_files(clean, stage), stage
    copies = [m for m in caplog.messages if m.startswith("warm start from") and str(a_path) in m]
    assert len(copies) == 1  # b copied a's root once, not again when resumed
    client = MlflowClient(result["tracking_uri"])
    pipeline_run = client.get_run(result["run_id"])
    assert pipeline_run.info.status == "FINISHED" and pipeline_run.data.tags["bhfl.resumes"] == "1"
    stage_runs = client.search_runs(
        [pipeline_run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{result['run_id']}'"
    )
    assert sorted(r.data.tags["bhfl.pipeline_stage"] for r in stage_runs) == ["a", "b", "c"]  # one per stage
    # every metric point once: the pipeline's (a's headlines were logged before the failure) and resumed b's
    for run_id in (result["run_id"], result["stages"]["b"]["run_id"]):
        for key in client.get_run(run_id).data.metrics:
            steps = [m.step for m in client.get_metric_history(run_id, key)]
            assert len(steps) == len(set(steps)), (run_id, key, steps)


def test_bad_init_from_values_are_config_errors_naming_the_key(finished, tmp_path):
    root, result, _ = finished
    a_path = Path(result["stages"]["a"]["run_path"])
    b_config = _pipeline()["b"].config

    def error(value, config=b_config, run_dir=root):
        cfg = config.model_copy(update={"model": config.model.model_copy(update={"init_from": value})})
        with pytest.raises(ConfigError) as err:
            resolve_init_from(cfg, run_dir)
        message = str(err.value)
        assert message.startswith(f"model.init_from: {value!r}: "), message
        return message

    assert "no run folder" in error(str(tmp_path / "nowhere"))
    no_record = tmp_path / "copied"
    shutil.copytree(a_path, no_record, ignore=shutil.ignore_patterns("state"))
    (no_record / "run.json").unlink()
    assert "has no run.json" in error(str(no_record))
    record = json.loads((a_path / "run.json").read_text())
    (no_record / "run.json").write_text(json.dumps({**record, "status": "failed"}))
    assert "is failed; a warm start needs a finished run (finish it first: `bhfl resume " in error(str(no_record))
    live = {**record, "status": "running", "pid": os.getpid(), "host": socket.gethostname()}  # its process lives
    (no_record / "run.json").write_text(json.dumps(live))
    assert f"is running; a warm start needs a finished run (wait for it to finish; `bhfl runs {no_record}`" in error(
        str(no_record)
    )
    other = _pipeline("model.max_length=16")["b"].config
    assert "model.max_length differs: 32 in the source run, 16 here" in error(f"{a_path}:root", other)
    assert "saved no node 'edge-de'; its saved nodes: " in error(f"{a_path}:edge-de")
    # relative to the run dir, and made absolute
    relative = f"{a_path.parent.name}/{a_path.name}:root"
    assert (
        resolve_init_from(
            b_config.model_copy(update={"model": b_config.model.model_copy(update={"init_from": relative})}), root
        ).model.init_from
        == f"{a_path}:root"
    )
    # in a pipeline: the stage is named, and that the value is no stage either
    bad = _pipeline("stages.c.model.init_from=nope:root")
    with pytest.raises(ConfigError) as err:
        check_sources(bad, root)
    assert str(err.value).startswith("stages.c: model.init_from: 'nope:root': no run folder 'nope'")
    assert "no stage of this pipeline is called 'nope': stages a, b, c" in str(err.value)
    # a single run checks before it writes anything
    with pytest.raises(ConfigError, match="no run folder"):
        run_experiment(b_config.model_copy(update={"name": "never"}), tmp_path / "runs")
    assert not (tmp_path / "runs" / "never").exists()


def test_cli_lists_compares_and_rejects_a_bad_pipeline_cleanly(finished, tmp_path):
    root, result, _ = finished
    runner = CliRunner()
    listed = runner.invoke(app, ["runs", "--run-dir", str(root)])
    assert listed.exit_code == 0, listed.output
    assert f"pipeline tp/{Path(result['pipeline_path']).name}" in listed.output
    assert f"c: finished  {result['stages']['c']['run_path']}" in listed.output
    one = runner.invoke(app, ["runs", result["pipeline_path"], "--run-dir", str(root)])
    assert one.exit_code == 0 and "a: finished" in one.output and "pipeline tp/" in one.output, one.output
    again = runner.invoke(app, ["resume", result["pipeline_path"], "--run-dir", str(root)])
    assert again.exit_code == 0 and "finished; nothing to resume" in " ".join(again.output.split()), again.output
    # a pipeline.yaml edited since it ran: one paragraph naming the file and the key, exit 2, the record untouched
    edited = tmp_path / "tp" / "edited"
    shutil.copytree(result["pipeline_path"], edited)
    (edited / "pipeline.json").write_text(
        json.dumps({**json.loads((edited / "pipeline.json").read_text()), "status": "failed"})
    )
    record = (edited / "pipeline.json").read_bytes()
    config = yaml.safe_load((edited / "pipeline.yaml").read_text())
    config["stages"]["c"]["tree"]["root"]["rounds"] = "two"
    (edited / "pipeline.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    broken = runner.invoke(app, ["resume", str(edited), "--run-dir", str(tmp_path)])
    assert broken.exit_code == 2 and "Traceback" not in broken.output, broken.output
    said = " ".join(broken.output.split())
    assert f"{edited / 'pipeline.yaml'} cannot be read as the pipeline it ran (stages.c: " in said, said
    assert "tree.root.rounds" in said and (edited / "pipeline.json").read_bytes() == record
    compared = runner.invoke(
        app, ["compare", result["run_id"], result["stages"]["b"]["run_id"], "--run-dir", str(root)]
    )
    assert compared.exit_code == 0, compared.output
    assert "| tp |" in compared.output and compared.output.count("| tp |") == 2

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"name": "bad", "stages": {"x": {"model": {"init_from": "gone:root"}}}}))
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli.app", "run", str(path), "--run-dir", str(tmp_path / "runs")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    message = " ".join(out.stderr.split())
    assert "stages.x: model.init_from: 'gone:root': no run folder 'gone'" in message
    assert "Traceback" not in out.stderr and not (tmp_path / "runs" / "bad").exists()
    # `bhfl serve` of the pipeline checks the same before its Prefect server starts: nothing written
    served = runner.invoke(app, ["serve", str(path), "--run-dir", str(tmp_path / "served")])
    assert served.exit_code == 2, served.output
    assert "stages.x: model.init_from: 'gone:root': no run folder 'gone'" in " ".join(served.output.split())
    assert not (tmp_path / "served").exists()
