"""A user's view: `mlflow server` (as `bhfl ui` starts it) serves the finished run over HTTP.

The server runs on 127.0.0.1 and a free port with one worker and no job runner, against
the store of a finished small run; the test reads what the UI reads: the REST API
(`/api/2.0/mlflow/...` and the UI's `/ajax-api/...`), the artefact route the UI uses
to show files, and the UI's page route.
"""

import json
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.flows.mlflow_server import MlflowServer

pytestmark = pytest.mark.integration

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server(evaluated_runs):
    root, tree, _ = evaluated_runs
    running = MlflowServer(tree["tracking_uri"], root / "mlflow-server.log").start()
    try:
        yield running.url, tree
    finally:
        running.stop()  # the server and the uvicorn worker it started


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200
        return r.read()


def _api(base: str, path: str, body: dict | None = None, prefix: str = "api") -> dict:
    url = f"{base}/{prefix}/2.0/mlflow/{path}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


def test_nested_runs_metrics_and_artifacts_are_served(server):
    base, tree = server
    exp = _api(base, "experiments/get-by-name?experiment_name=itest-report")["experiment"]
    runs = _api(base, "runs/search", {"experiment_ids": [exp["experiment_id"]], "max_results": 100})["runs"]
    tags_of = [{t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in runs]
    # node runs by their node, the parent run ("<config> seed=<seed> <hash8>") as itest-report
    by_name = {t.get("bhfl.node", "itest-report"): r for t, r in zip(tags_of, runs)}
    tags = {t.get("bhfl.node", "itest-report"): t for t in tags_of}
    parent_id = tree["run_id"]
    # the tree through nesting: parent -> root -> servers -> edge servers
    expected_parent = {
        "root": "itest-report",
        "west": "root",
        "east": "root",
        "edge-en": "west",
        "edge-fr": "west",
        "edge-de": "east",
    }
    for node, parent in expected_parent.items():
        assert tags[node]["mlflow.parentRunId"] == by_name[parent]["info"]["run_id"], node
    assert by_name["itest-report"]["info"]["run_id"] == parent_id
    assert by_name["itest-report"]["info"]["run_name"].startswith("itest-report seed=0 ")
    assert by_name["itest-report"]["info"]["status"] == "FINISHED"
    assert tags["itest-report"]["bhfl.task"] == "classification"
    parent_metrics = {m["key"]: m["value"] for m in by_name["itest-report"]["data"]["metrics"]}
    assert parent_metrics["proximity/share_clients_rank"] == pytest.approx(
        tree["headline"]["proximity/share_clients_rank"]
    )

    # per-round curves with step = round, as the UI's chart view asks for them (ajax-api)
    root_id = by_name["root"]["info"]["run_id"]
    query = urllib.parse.urlencode({"run_id": root_id, "metric_key": "eval/union/accuracy"})
    history = _api(base, f"metrics/get-history?{query}", prefix="ajax-api")["metrics"]
    assert sorted(int(m["step"]) for m in history) == [1, 2]

    # artefacts: listed, and served byte for byte through the route the UI uses to show them
    listed = {f["path"] for f in _api(base, f"artifacts/list?run_id={parent_id}&path=eval")["files"]}
    assert {"eval/matrix.csv", "eval/heatmap.png", "eval/proximity.png", "eval/communication.csv"} <= listed
    run_folder = Path(tree["run_path"]) / "report"
    for path in ("eval/heatmap.png", "eval/proximity.png", "report.md", "eval/matrix.csv"):
        body = _get(f"{base}/get-artifact?{urllib.parse.urlencode({'path': path, 'run_uuid': parent_id})}")
        assert body == (run_folder / path).read_bytes(), path
    assert _get(f"{base}/get-artifact?path=eval/heatmap.png&run_uuid={parent_id}").startswith(PNG)


def test_ui_page_route_is_served(server):
    base, _ = server
    page = _get(f"{base}/").decode()
    assert "<title>MLflow</title>" in page and 'id="root"' in page
    # the single-page app's script bundle is served too (the UI renders runs from it)
    script = next(part.split('"')[0] for part in page.split('src="')[1:] if part.split('"')[0].endswith(".js"))
    assert len(_get(f"{base}/{script.removeprefix('./')}")) > 100_000
