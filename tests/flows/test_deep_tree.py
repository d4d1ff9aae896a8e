"""A five-level tree (root -> continent -> region -> edge -> clients) through the real flows."""

import csv
import io
from pathlib import Path

import pytest
from mlflow import MlflowClient

from flows.experiment import run_experiment
from tests.small import small_config

pytestmark = pytest.mark.integration

# node: (depth, role, parent run)
SERVERS = {
    "root": (0, "root", "itest-deep"),
    "west": (1, "server", "root"),
    "east": (1, "server", "root"),
    "atlantic": (2, "server", "west"),
    "central": (2, "server", "east"),
    "edge-en": (3, "edge", "atlantic"),
    "edge-fr": (3, "edge", "atlantic"),
    "edge-de": (3, "edge", "central"),
}


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    root = tmp_path_factory.mktemp("deep-runs")
    config = small_config(
        "name=itest-deep",
        "tree.groups={west: {atlantic: [en, fr]}, east: {central: [de]}}",
        "tree.levels.2.eta_down=0.5",  # regions keep half of their own model on the way down
        "data.proxy.servers=[root, 'depth:1']",
        "tree.levels.1.proxy_train=true",  # continents train on their languages' proxy share
        "tree.residuals.up=[{from: edge, to: root}]",  # a residual that skips three levels
        "eval.during=all",  # the client models after every root round too (default: the servers only)
    )
    return root, run_experiment(config, root)


def test_every_server_at_every_depth_has_a_nested_run_with_metrics(deep):
    _, result = deep
    client = MlflowClient(result["tracking_uri"])
    runs = {
        r.data.tags.get("bhfl.node") or r.data.params["name"]: r
        for r in client.search_runs([result["experiment_id"]], max_results=1000)
    }
    assert set(runs) == set(SERVERS) | {"itest-deep"}
    for name, (depth, role, parent) in SERVERS.items():
        run = runs[name]
        assert run.info.status == "FINISHED"
        tags = run.data.tags
        assert (tags["bhfl.node"], tags["bhfl.level"], tags["bhfl.role"]) == (name, str(depth), role)
        assert tags["mlflow.parentRunId"] == runs[parent].info.run_id
        rid = run.info.run_id
        assert [m.step for m in client.get_metric_history(rid, "Training/loss")] == [1, 2], name
        union = client.get_metric_history(rid, "eval/union/accuracy")
        assert sorted(m.step for m in union) == [1, 2] and all(0 <= m.value <= 1 for m in union), name
    for continent in ("west", "east"):  # tree.levels.1: proxy training at depth 1 only
        assert client.get_metric_history(runs[continent].info.run_id, "Training/proxy_loss")
    assert not client.get_metric_history(runs["atlantic"].info.run_id, "Training/proxy_loss")
    assert runs["itest-deep"].data.params["tree.groups.west.atlantic"] == '["en", "fr"]'
    own = client.get_metric_history(result["run_id"], "client_on_own_clients/accuracy_mean")
    assert sorted(m.step for m in own) == [1, 2]  # eval.during: all


def test_evaluation_has_subtree_unions_at_every_depth(deep):
    root, result = deep
    client = MlflowClient(result["tracking_uri"])
    local = client.download_artifacts(result["run_id"], "eval/matrix.csv", str(root / "dl"))
    rows = list(csv.DictReader(io.StringIO(Path(local).read_text())))
    subtrees = {r["test_set"] for r in rows if r["test_set"].startswith("subtree:")}
    assert subtrees == {f"subtree:{n}" for n in SERVERS if n != "root"}
    levels = {r["node"]: r["level"] for r in rows}
    assert all(levels[n] == str(depth) for n, (depth, _, _) in SERVERS.items())
    assert {levels[n] for n in levels if n not in SERVERS} == {"4"}  # clients
    # every server scored on the union of each subtree (depths 1, 2 and 3)
    scored = {(r["node"], r["test_set"]) for r in rows if r["metric"] == "accuracy" and r["value"] != ""}
    assert {(n, s) for n in SERVERS for s in subtrees} <= scored
    report = (Path(result["run_path"]) / "report" / "report.md").read_text()
    assert "its intermediate server at depth 2" in report  # each client has servers at depths 1 and 2
