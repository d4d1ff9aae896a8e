"""The evaluation report of a finished run, read back from the real MLflow store; `bhfl compare`."""

import base64
import csv
import io
import json
import math
import pickle
from pathlib import Path

import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from mlflow import MlflowClient
from PIL import Image
from typer.testing import CliRunner

from bhfl_core.analysis.evaluation import Evaluation
from bhfl_core.analysis.matrix_axes import ModelRef, client_order
from bhfl_core.analysis.time_to_accuracy import CurvePoint
from bhfl_core.learning.metrics import task_metrics
from bhfl_core.store.transfer import Transfer
from data_prep.figures import MIN_FONT_PT, PNG_DPI
from flows.cli.app import app
from flows.tracking import plots
from flows.tracking.baselines import trivial_baseline
from flows.tracking.links import HEADLINE_VIEW_KEY, SHARED_VIEW_TAG, runs_link
from flows.tracking.tracker import Tracker
from tasks.context import RunContext, open_run
from tasks.worker import WorkerRuntime, worker_device
from tests.flows.commands import scored_with

pytestmark = pytest.mark.integration

CLIENTS = [f"{lang}-{i:02d}" for lang in ("en", "fr", "de") for i in range(3)]
PNG = b"\x89PNG\r\n\x1a\n"


def _runs(client, experiment_id):
    return {
        r.data.tags.get("bhfl.node") or r.data.params["name"]: r
        for r in client.search_runs([experiment_id], max_results=1000)
    }


def _artifact(client, run_id, path, dst):
    return Path(client.download_artifacts(run_id, path, str(dst)))


def _matrix(client, run_id, dst):
    rows = list(csv.DictReader(io.StringIO(_artifact(client, run_id, "eval/matrix.csv", dst).read_text())))
    return rows, {(r["node"], r["test_set"], r["metric"]): float(r["value"]) for r in rows}


def test_report_artifacts_on_the_parent_run(evaluated_runs, tmp_path):
    _, tree, _ = evaluated_runs
    client = MlflowClient(tree["tracking_uri"])
    top = {a.path for a in client.list_artifacts(tree["run_id"])}
    assert {"report.md", "eval", "config.yaml"} <= top
    files = {a.path for a in client.list_artifacts(tree["run_id"], "eval")}
    for name in (
        "matrix.csv",
        "distribution.csv",
        "clients.csv",
        "proximity.csv",
        "proximity_clients.csv",
        "communication.csv",
        "communication_levels.csv",
        "heatmap.png",
        "proximity.png",
    ):
        assert f"eval/{name}" in files, name
    for png in ("eval/heatmap.png", "eval/proximity.png"):
        data = _artifact(client, tree["run_id"], png, tmp_path).read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000
        assert data == (Path(tree["run_path"]) / "report" / png).read_bytes()  # the run folder holds the same
        assert round(Image.open(io.BytesIO(data)).info["dpi"][0]) == PNG_DPI  # sharp enough for a paper
        svg = _artifact(client, tree["run_id"], png.replace(".png", ".svg"), tmp_path).read_text()
        assert svg.startswith("<?xml") and "<svg" in svg  # the vector copy beside it, logged too
    report = _artifact(client, tree["run_id"], "report.md", tmp_path).read_text()
    for section in (
        "# itest-report: evaluation report",
        "## Proximity",
        "## Communication",
        "## Cost",
        "![heatmap](eval/heatmap.png)",
        "local-only model",
        "locally adapted model",
    ):
        assert section in report, section
    # report.html: the same report, every figure inside the page (the MLflow UI's frame fetches nothing beside it)
    page = _artifact(client, tree["run_id"], "report.html", tmp_path).read_text()
    assert "<table>" in page and "<h2>Heatmap</h2>" in page and 'src="eval/' not in page
    for png in ("eval/heatmap.png", "eval/proximity.png"):
        inline = base64.b64encode((Path(tree["run_path"]) / "report" / png).read_bytes()).decode()
        assert f'src="data:image/png;base64,{inline}"' in page, png


def test_matrix_has_subtrees_and_baselines_and_unions_add_up(evaluated_runs, tmp_path):
    _, tree, _ = evaluated_runs
    client = MlflowClient(tree["tracking_uri"])
    rows, value = _matrix(client, tree["run_id"], tmp_path)
    subtrees = {f"subtree:{n}" for n in ("west", "east", "edge-en", "edge-fr", "edge-de")}
    assert {r["test_set"] for r in rows} == set(CLIENTS) | subtrees | {"union", "proxy"}
    models = {r["node"] for r in rows}
    assert {f"local:{c}" for c in CLIENTS} | {f"adapt:{c}" for c in CLIENTS} <= models
    assert {r["level"] for r in rows if r["node"] == "local:de-01"} == {"3"}
    # a union's accuracy is the test-size-weighted mean of its clients' accuracies (sums of confusions)
    sizes = {c.id: c.test.size for c in open_run(tree["run_path"]).manifest.clients}
    for model in ("root", "edge-de", "en-01", "local:fr-02"):
        for test_set, members in (("union", CLIENTS), ("subtree:west", [c for c in CLIENTS if c[:2] in ("en", "fr")])):
            weighted = sum(value[(model, c, "accuracy")] * sizes[c] for c in members) / sum(sizes[c] for c in members)
            assert value[(model, test_set, "accuracy")] == pytest.approx(weighted, abs=2e-6)


def test_baselines_are_reproducible(evaluated_runs, tmp_path):
    _, tree, _ = evaluated_runs
    client = MlflowClient(tree["tracking_uri"])
    _, value = _matrix(client, tree["run_id"], tmp_path)
    # the baselines rebuilt by a fresh worker runtime in this process (not the run's workers)
    models = [ModelRef.local_only("en-00"), ModelRef.adapted("fr-01")]
    again = WorkerRuntime("test", worker_device("cpu")).evaluate(tree["run_path"], models)
    ev = Evaluation(open_run(tree["run_path"]).tree, task_metrics("classification"), again)
    for model, (name, split) in zip(models, (("local:en-00", "en-00"), ("adapt:fr-01", "proxy"))):
        assert model.name == name
        assert ev.value(name, split) == pytest.approx(value[(name, split, "accuracy")], abs=1e-6)
    # what the worker sent back for a model: two numbers a test set it scored, never a whole table's blocks
    for values in again:
        sets = len(values.clients) + len(values.on_sets)
        assert len(pickle.dumps(values)) <= sets * 2 * 8 + 1200 + 40 * len(values.on_sets), values


def test_a_client_model_scored_on_a_ring_sample_scores_those_clients_as_the_full_evaluation(evaluated_runs, tmp_path):
    """The same rows, scored apart from the rest of the table (its clients' rows only), give the same metrics."""
    _, tree, _ = evaluated_runs
    _, value = _matrix(MlflowClient(tree["tracking_uri"]), tree["run_id"], tmp_path)
    sampled, _ = scored_with(tree["run_path"], "en-01", client_model_sample=1)
    clients = client_order(open_run(tree["run_path"]).tree)
    assert sampled.on_clients.shape == (1 + 3, 2)  # its own split and one client of each of its three rings
    for position, (accuracy, f1) in zip(sampled.clients, sampled.on_clients):
        client = clients[position]
        assert accuracy == pytest.approx(value[("en-01", client, "accuracy")], abs=1e-6)
        assert f1 == pytest.approx(value[("en-01", client, "macro_f1")], abs=1e-6)
    assert sampled.on_sets["proxy"][0] == pytest.approx(value[("en-01", "proxy", "accuracy")], abs=1e-6)


def test_a_sampled_population_is_read_and_scored_alone_as_the_full_evaluation_scores_it(evaluated_runs, tmp_path):
    """``eval.clients: N``: a worker reads only the sample's test splits (and the proxy's) and scores a server
    on them in one pass; each client's values are those of the full evaluation."""
    _, tree, _ = evaluated_runs
    _, value = _matrix(MlflowClient(tree["tracking_uri"]), tree["run_id"], tmp_path)
    clients = client_order(open_run(tree["run_path"]).tree)
    sampled, table = scored_with(tree["run_path"], "root", clients=5)
    names = [clients[p] for p in sampled.clients]
    assert len(names) == 5 and sorted(table.names[:-1]) == sorted(names) and table.names[-1] == "proxy"
    assert int(table.sizes.sum()) == len(table.groups) == len(next(iter(table.data.values())))  # those rows only
    for client, (accuracy, f1) in zip(names, sampled.on_clients):
        assert accuracy == pytest.approx(value[("root", client, "accuracy")], abs=1e-6)
        assert f1 == pytest.approx(value[("root", client, "macro_f1")], abs=1e-6)
    assert sampled.on_sets["proxy"][0] == pytest.approx(value[("root", "proxy", "accuracy")], abs=1e-6)
    # the trivial baseline's union is the same sample's test splits, its majority label all clients' training one
    config = open_run(tree["run_path"]).config
    ctx = RunContext.open(
        Path(tree["run_path"]), config.model_copy(update={"eval": config.eval.model_copy(update={"clients": 5})})
    )
    assert ctx.eval_plan.population == names
    hist = {c.id: c for c in ctx.manifest.clients}
    prior = int(torch.tensor([hist[c].train.label_hist for c in hist]).sum(0).argmax())
    tested = torch.tensor([hist[c].test.label_hist for c in names]).sum(0)
    union = trivial_baseline(ctx).scores["union"]["accuracy"]  # type: ignore[union-attr]
    assert union == pytest.approx(int(tested[prior]) / int(tested.sum()))


def test_per_round_curves_for_every_node(evaluated_runs):
    _, tree, _ = evaluated_runs
    client = MlflowClient(tree["tracking_uri"])
    runs = _runs(client, tree["experiment_id"])
    for node in ("root", "west", "east", "edge-en", "edge-fr", "edge-de"):
        run_id = runs[node].info.run_id
        for key in (
            "dist/subtree/accuracy_mean",
            "dist/all/accuracy_worst10",
            "eval/union/accuracy",
            "eval/subtree:west/accuracy",
        ):
            assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [1, 2], (node, key)
    parent = tree["run_id"]
    assert sorted(m.step for m in client.get_metric_history(parent, "time/eval_s")) == [1, 2]
    assert [m.step for m in client.get_metric_history(parent, "time/baselines_s")] == [2]  # final evaluation only
    # eval.during: servers (the default): the servers' relations have curves, the client models the final point
    for key, steps in (
        ("root/union/accuracy", [1, 2]),
        ("edge_on_own_clients/accuracy_mean", [1, 2]),
        ("client_on_own_clients/accuracy_mean", [2]),
    ):
        assert sorted(m.step for m in client.get_metric_history(parent, key)) == steps, key
    # the subtree distribution of edge-de is its 3 German clients' accuracies
    _, value = _matrix(client, parent, Path(tree["run_path"]) / "dl")
    de = [value[("edge-de", c, "accuracy")] for c in CLIENTS if c.startswith("de")]
    final = {
        m.step: m.value for m in client.get_metric_history(runs["edge-de"].info.run_id, "dist/subtree/accuracy_mean")
    }
    assert final[2] == pytest.approx(sum(de) / 3, abs=1e-5)


def test_communication_from_persisted_histories(evaluated_runs, tmp_path):
    _, tree, _ = evaluated_runs
    client = MlflowClient(tree["tracking_uri"])
    text = _artifact(client, tree["run_id"], "eval/communication.csv", tmp_path).read_text()
    rows = list(csv.DictReader(io.StringIO(text)))
    down = {
        lvl: sum(float(r["models"]) for r in rows if r["level"] == lvl and r["direction"] == "down") for lvl in "012"
    }
    # 2 root rounds: root -> {west, east}; west -> 2 edges, east -> 1; each edge round samples 2 clients
    assert down == {"0": 2 * 2, "1": 2 * (2 + 1), "2": 2 * 3 * 2}
    assert sum(float(r["models"]) for r in rows if r["direction"] == "up") == 22
    assert not [r for r in rows if r["kind"] == "residual"]  # the small config has no residual rules
    params = int(client.get_run(tree["run_id"]).data.tags["bhfl.model_params"])
    metrics = client.get_run(tree["run_id"]).data.metrics
    assert params == open_run(tree["run_path"]).store.load_model("root").numel()
    assert metrics["comm/total_bytes"] == 44 * params * 4 and metrics["comm/total_model_equivalents"] == 44


def test_history_keeps_the_last_write_of_a_step(evaluated_runs):
    """A round re-run after a crash logs its step again: the table must count it once."""
    _, tree, _ = evaluated_runs
    tracker = Tracker(tree["tracking_uri"])
    exp = tracker.client.create_experiment("itest-history")
    run_id = tracker.client.create_run(exp).info.run_id
    for step, value, ts in ((1, 4.0, 1000), (2, 4.0, 2000), (2, 3.0, 3000)):
        tracker.client.log_metric(run_id, "comm/down_models", value, timestamp=ts, step=step)
    assert tracker.history(run_id, "comm/down_models") == {1: 4.0, 2: 3.0}


def test_parent_run_is_sortable_and_described(evaluated_runs):
    _, tree, _ = evaluated_runs
    client = MlflowClient(tree["tracking_uri"])
    parent = client.get_run(tree["run_id"])
    for key in (
        "client_on_own_clients/accuracy_mean",
        "edge_on_own_clients/accuracy_worst10",
        "root/union/accuracy",
        "local_only_on_own_clients/accuracy_mean",
        "gain_vs_local/edge/accuracy_mean",
        "proximity/share_clients_rank",
        "proximity/union_rho_depth",
        "comm/total_bytes",
        "time/eval_share",
    ):
        assert key in parent.data.metrics, key
    assert 0 <= parent.data.metrics["proximity/share_clients_rank"] <= 1
    assert parent.data.metrics["time/eval_share"] > 0
    assert parent.data.tags["bhfl.task"] == "classification" and parent.data.tags["bhfl.data_fingerprint"]
    assert "**Results** (accuracy)" in parent.data.tags["mlflow.note.content"]
    edge = _runs(client, tree["experiment_id"])["edge-en"]
    assert "Edge server `edge-en`" in edge.data.tags["mlflow.note.content"]
    assert tree["headline"]["root/union/accuracy"] == parent.data.metrics["root/union/accuracy"]


def test_compare_prints_markdown_and_writes_csv(evaluated_runs, tmp_path):
    root, tree, flat = evaluated_runs
    out = tmp_path / "cmp.csv"
    result = CliRunner().invoke(
        app, ["compare", "itest-report", flat["run_id"], "--run-dir", str(root), "--csv", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "| experiment | run | metric | own model: mean" in result.stdout
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [r["experiment"] for r in rows] == ["itest-report", "itest-flat"]
    client = MlflowClient(tree["tracking_uri"])
    for row, run in zip(rows, (tree, flat)):
        metrics = client.get_run(run["run_id"]).data.metrics
        assert row["run_id"] == run["run_id"]
        assert float(row["leaf_mean"]) == pytest.approx(metrics["client_on_own_clients/accuracy_mean"])
        assert float(row["root_proxy"]) == pytest.approx(metrics["root/proxy/accuracy"])
        assert float(row["comm_mb"]) == pytest.approx(metrics["comm/total_bytes"] / 1e6)
    assert float(rows[0]["comm_model_equivalents"]) == 44
    # flat FedAvg: the parent server of every client is the root
    assert float(rows[1]["parent_mean"]) == pytest.approx(
        client.get_run(flat["run_id"]).data.metrics["root_on_own_clients/accuracy_mean"]
    )
    assert not math.isnan(float(rows[1]["closer_is_better_share"]))


def test_compare_rejects_unknown_and_node_runs(evaluated_runs, tmp_path):
    root, tree, _ = evaluated_runs
    runner = CliRunner()
    result = runner.invoke(
        app, ["compare", "no-such-experiment", "--run-dir", str(root), "--csv", str(tmp_path / "x.csv")]
    )
    assert result.exit_code == 2 and "'no-such-experiment' is neither a run id nor an experiment name" in result.output
    assert not (tmp_path / "x.csv").exists()
    node_run = _runs(MlflowClient(tree["tracking_uri"]), tree["experiment_id"])["edge-fr"].info.run_id
    result = runner.invoke(app, ["compare", node_run, "--run-dir", str(root)])
    assert result.exit_code == 2 and "this is the run of node 'edge-fr'" in result.output
    result = runner.invoke(app, ["compare", "x", "--run-dir", str(tmp_path / "empty")])
    assert result.exit_code == 2 and "no MLflow store" in result.output


def test_time_to_accuracy_in_report_and_compare(evaluated_runs, tmp_path):
    root, tree, _ = evaluated_runs  # the tree run evaluates after every root round (eval.every = 1)
    client = MlflowClient(tree["tracking_uri"])

    def history(key):
        return {m.step: m.value for m in client.get_metric_history(tree["run_id"], key)}

    virtual, accuracy = history("time/virtual_s"), history("root/union/accuracy")
    assert sorted(virtual) == sorted(accuracy) == [1, 2]
    assert 0 < virtual[1] < virtual[2]  # the root's virtual clock at each evaluation
    folder = Path(tree["run_path"]) / "report"
    rows = list(csv.DictReader(io.StringIO((folder / "eval" / "time_to_accuracy.csv").read_text())))
    root_rows = [r for r in rows if r["population"] == "root on union"]
    assert [(int(r["step"]), float(r["virtual_s"])) for r in root_rows] == [(1, virtual[1]), (2, virtual[2])]
    assert (folder / "eval" / "time_to_accuracy.png").stat().st_size > 0
    assert "## Quality against virtual time (accuracy)" in (folder / "report.md").read_text()

    target = min(accuracy.values())
    first = min(step for step, value in accuracy.items() if value >= target)
    out = tmp_path / "cmp.csv"
    for goal, want in ((target, virtual[first]), (1.5, math.nan)):
        result = CliRunner().invoke(
            app, ["compare", tree["run_id"], "--target", str(goal), "--run-dir", str(root), "--csv", str(out)]
        )
        assert result.exit_code == 0, result.output
        assert "virtual s to target (root on union)" in result.stdout
        (row,) = csv.DictReader(io.StringIO(out.read_text()))
        got = float(row["time_to_target"])
        assert got == pytest.approx(want) if not math.isnan(want) else math.isnan(got)


def test_figure_legends_sit_outside_the_data_and_text_is_readable():
    """The legend is laid out under the axes (it never hides a point), every text at least MIN_FONT_PT."""
    points = [CurvePoint(step=i, virtual_s=10.0 * i, value=0.1 * i) for i in range(1, 6)]
    fig: Figure = plots.time_to_accuracy_plot({"root on union": points, "client's own model (mean)": points}, "acc")
    renderer = FigureCanvasAgg(fig).get_renderer()  # (attaches itself to the figure)
    fig.draw(renderer)  # lays the legend out
    (ax,) = fig.axes
    legend, data_area = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
    assert legend.y1 < data_area.y0  # wholly below the axes
    texts = [*ax.get_xticklabels(), *ax.get_yticklabels(), *ax.get_legend().get_texts()]
    assert min(t.get_fontsize() for t in texts) >= MIN_FONT_PT


def test_the_run_list_view_shows_the_headline_metrics_as_columns(evaluated_runs):
    """The experiment carries a shared view of its run list with the headlines as columns (runs_link opens it)."""
    _, tree, _ = evaluated_runs
    client = MlflowClient(tree["tracking_uri"])
    run = client.get_run(tree["run_id"])
    experiment = client.get_experiment(run.info.experiment_id)
    view = json.loads(experiment.tags[SHARED_VIEW_TAG + HEADLINE_VIEW_KEY])
    columns = [c.removeprefix("metrics.`").removesuffix("`") for c in view["selectedColumns"]]
    assert columns == [*tree["headline"], "time/total_s"]
    assert set(columns) <= set(run.data.metrics)  # each column has a value on the parent run
    link = runs_link(tree["tracking_uri"], experiment.experiment_id)
    assert link.endswith(f"/runs?viewStateShareKey={HEADLINE_VIEW_KEY}&workflowType=machine_learning")


def test_a_batch_that_is_its_whole_round_sends_the_closed_mean(evaluated_runs):
    """A worker that trains all of a round's clients closes the fold on its device: it sends the float32 mean
    (not the 16-byte sum), leaves no other file, and the parent's mean_input is bit for bit the open fold's."""
    from bhfl_core.algorithm.aggregation_rule import fold_results
    from bhfl_core.algorithm.contract import RoundPlan
    from bhfl_core.algorithm.node_state import RoundKey
    from bhfl_core.algorithm.rules import rule_for
    from bhfl_core.store.transfer import receive_result
    from tasks.client_training import BatchCall

    _, tree, _ = evaluated_runs
    ctx = open_run(tree["run_path"])
    edge = next(n for n in ctx.tree.nodes.values() if n.children and ctx.tree[n.children[0]].is_leaf)
    clients, key = list(edge.children), RoundKey(edge.id, 0)
    rule = rule_for(edge.settings.aggregate)
    phi = ctx.transfer.put("test.down", ctx.store.load_model(edge.id))
    runtime = WorkerRuntime("test", worker_device("cpu"))
    means, sizes = [], []
    for whole in (False, True, True):  # the second whole round folds into the buffers of the first, zeroed
        plan, batch_call = RoundPlan(key.as_caller()), BatchCall(whole_round=whole)
        sent = runtime.train_clients(tree["run_path"], plan, clients, phi, batch_call)
        sizes.append({part: Path(ref.path).stat().st_size for part, ref in sent.partial.items()})
        folded = fold_results(rule, key, [receive_result(sent, rule)], [*clients, edge.id])
        means.append(rule.finalize(folded.partial, key).input)
    numel = means[0].numel()
    assert sizes == [{"hi": 8 * numel, "lo": 8 * numel}, {"mean": 4 * numel}, {"mean": 4 * numel}]
    assert torch.equal(means[0], means[1]) and torch.equal(means[0], means[2])
    assert [p.name for p in ctx.transfer.folder.iterdir()] == ["test.down"]  # the closed sum's files are gone
    Transfer.drop(phi)
