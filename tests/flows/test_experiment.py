"""A shrunken experiment through the real flows, checked in the real MLflow store."""

import csv
import io
from pathlib import Path

import pytest
from mlflow import MlflowClient

from bhfl_core.store.node_store import StateStore
from flows.experiment import run_experiment
from tests.small import small_config

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    # 'east' (languages [de]) also trains on its language-group share of the proxy data
    result = run_experiment(small_config("data.proxy.servers=[root, east]", "tree.nodes.east.proxy_train=true"), root)
    return root, result


def _runs(client, experiment_id):
    return {
        r.data.tags.get("bhfl.node") or r.data.params["name"]: r
        for r in client.search_runs([experiment_id], max_results=1000)
    }


def test_nested_node_runs_with_tags(finished):
    root, result = finished
    client = MlflowClient(result["tracking_uri"])
    assert result["tracking_uri"] == f"sqlite:///{root.resolve() / 'mlflow.db'}"
    exp = client.get_experiment_by_name("itest")
    runs = _runs(client, exp.experiment_id)
    parent = runs["itest"]
    assert parent.info.status == "FINISHED" and parent.info.run_id == result["run_id"]
    assert parent.info.run_name == f"itest seed=0 {parent.data.tags['bhfl.config_hash'][:8]}"  # tells settings apart
    expected = {
        "root": ("0", "root", "itest"),
        "west": ("1", "server", "root"),
        "east": ("1", "server", "root"),
        "edge-en": ("2", "edge", "west"),
        "edge-fr": ("2", "edge", "west"),
        "edge-de": ("2", "edge", "east"),
    }
    assert set(runs) == set(expected) | {"itest"}  # one run per server node, none for clients
    for name, (level, role, parent_name) in expected.items():
        tags = runs[name].data.tags
        assert tags["bhfl.node"] == name and tags["bhfl.level"] == level and tags["bhfl.role"] == role
        assert tags["mlflow.parentRunId"] == runs[parent_name].info.run_id
        assert runs[name].info.status == "FINISHED"
        # the run page's chart sections: one per name prefix, sorted by code point (as the UI does): training first
        sections = sorted({key.rpartition("/")[0] for key in client.get_run(runs[name].info.run_id).data.metrics})
        assert sections[0] == "Training" and len(sections) > 5, (name, sections)
    assert parent.data.params["tree.root.rounds"] == "2"
    assert parent.data.params["tree.groups.west"] == '["en", "fr"]'
    assert parent.data.tags["bhfl.data_fingerprint"] and parent.data.tags["bhfl.config_hash"]


def test_per_round_metrics_use_round_steps(finished):
    _, result = finished
    client = MlflowClient(result["tracking_uri"])
    runs = _runs(client, result["experiment_id"])
    root_id, edge_id = runs["root"].info.run_id, runs["edge-en"].info.run_id
    assert [m.step for m in client.get_metric_history(root_id, "Training/proxy_loss")] == [1, 2]
    edge_loss = client.get_metric_history(edge_id, "Training/loss")
    assert [m.step for m in edge_loss] == [1, 2] and all(m.value > 0 for m in edge_loss)
    assert [m.value for m in client.get_metric_history(edge_id, "Training/clients")] == [2.0, 2.0]  # cohort
    # eval.every = 1: evaluated after root round 1 and at the end (round 2)
    union = client.get_metric_history(root_id, "eval/union/accuracy")
    assert sorted(m.step for m in union) == [1, 2] and all(0 <= m.value <= 1 for m in union)
    assert client.get_metric_history(edge_id, "eval/proxy/macro_f1")
    # proxy training at an intermediate server, on its own language group's proxy rows
    east_id, west_id = runs["east"].info.run_id, runs["west"].info.run_id
    assert [m.step for m in client.get_metric_history(east_id, "Training/proxy_loss")] == [1, 2]
    assert not client.get_metric_history(west_id, "Training/proxy_loss")
    # an intermediate server's training curve: its edges' last-round client loss, per round
    assert [m.step for m in client.get_metric_history(west_id, "Training/loss")] == [1, 2]
    # 30 German proxy rows at batch size 32 -> 1 step; the root trains on all 90 rows -> 3 steps
    assert {m.value for m in client.get_metric_history(east_id, "Training/proxy_steps")} == {1.0}
    assert {m.value for m in client.get_metric_history(root_id, "Training/proxy_steps")} == {3.0}


def test_matrix_artifact_covers_every_model_and_test_set(finished):
    root, result = finished
    client = MlflowClient(result["tracking_uri"])
    local = client.download_artifacts(result["run_id"], "eval/matrix.csv", str(root / "dl"))
    rows = list(csv.DictReader(io.StringIO(Path(local).read_text())))
    assert list(rows[0]) == ["node", "level", "test_set", "metric", "value"]
    nodes = {r["node"] for r in rows}
    clients = [f"{lang}-{i:02d}" for lang in ("en", "de", "fr") for i in range(3)]
    assert {"root", "west", "east", "edge-en", "edge-de", "edge-fr"} <= nodes
    store = StateStore(Path(result["run_path"]) / "state")
    trained_clients = {c for c in clients if store.has(c)}
    assert trained_clients and nodes - {"root", "west", "east", "edge-en", "edge-de", "edge-fr"} == trained_clients
    test_sets = {r["test_set"] for r in rows}
    subtrees = {f"subtree:{n}" for n in ("west", "east", "edge-en", "edge-de", "edge-fr")}
    assert test_sets == set(clients) | subtrees | {"proxy", "union"}
    assert len(rows) == len(nodes) * len(test_sets) * 2
    assert {r["metric"] for r in rows} == {"accuracy", "macro_f1"}
    assert {r["level"] for r in rows if r["node"] == "root"} == {"0"}
    artifacts = {a.path for a in client.list_artifacts(result["run_id"])}
    assert {"config.yaml", "eval", "data"} <= artifacts


def test_node_state_files_written(finished):
    _, result = finished
    store = StateStore(Path(result["run_path"]) / "state")
    for node in ("root", "west", "east", "edge-en", "edge-de", "edge-fr"):
        assert store.load(node).rounds_done == 2 and store.load_model(node) is not None


def test_prefect_shows_named_runs_tags_and_the_headline_artifact(finished):
    """The Prefect UI tells what ran: the experiment's flow run by config and time, tagged; named (untagged)
    task runs; a markdown artefact with the headline numbers and the MLflow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterTags,
        TaskRunFilter,
        TaskRunFilterName,
    )

    _, result = finished
    client_mlflow = MlflowClient(result["tracking_uri"])
    config_hash = client_mlflow.get_run(result["run_id"]).data.tags["bhfl.config_hash"]
    with get_client(sync_client=True) as client:
        tagged = FlowRunFilter(tags=FlowRunFilterTags(all_=["config:itest", f"hash:{config_hash[:8]}"]))
        (flow_run,) = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["bhfl-experiment"])), flow_run_filter=tagged
        )
        assert len(client.read_flow_runs(flow_run_filter=tagged)) > 1  # its subflows carry the tags too
        assert flow_run.name.startswith("itest 20") and "seed:0" in flow_run.tags  # "itest 2026-11-23 19:54"
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["bhfl-itest"])),
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])),
        )
        assert len(artifacts) == 1, [(a.key, a.flow_run_id, a.type, str(a.data)[:80]) for a in artifacts]
        (artifact,) = artifacts
        # by name on the server: the session's server holds every test's task runs, more than a page
        named = TaskRunFilter(name=TaskRunFilterName(like_="train edge-en r1 ["))
        trains = client.read_task_runs(task_run_filter=named)
        names = {t.name for t in trains}
        prepare = client.read_flow_runs(flow_run_filter=FlowRunFilter(name={"any_": ["prepare-data"]}))
    assert result["run_id"] in artifact.data and "#/experiments/" in artifact.data
    union = client_mlflow.get_run(result["run_id"]).data.metrics["root/union/accuracy"]
    assert f"| `root/union/accuracy` | {union:.4f} |" in artifact.data
    assert any(n.startswith("train edge-en r1 [2 clients") for n in names), sorted(names)[:10]
    # task runs go untagged: a tagged one asks the server for concurrency slots first (a ~2 s stall on
    # SQLite when it meets a write lock: flows/orchestration.py _untagged)
    assert trains and all(t.tags == [] for t in trains), [t.tags for t in trains]
    assert prepare  # the data preparation subflow has a name that says so
