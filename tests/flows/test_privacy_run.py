"""A shrunken experiment with DP-FedAvg at the edge servers, end to end: deterministic, logged, private where asked."""

from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from bhfl_core.store.node_store import load_tensors
from flows.experiment import PLAIN_CALLS, run_experiment
from tests.flows.kill_chain import killed_and_resumed, node_files
from tests.small import SMALL, small_config

pytestmark = pytest.mark.integration

EDGE_DP = "tree.edge.privacy={clip: 0.5, noise_multiplier: 1.0, adaptive: {quantile: 0.5, lr: 0.2, count_noise: 1.0}}"


SECAGG = "tree.edge.secure_aggregation={threshold: 2}"  # 2 of the cohort of 2
FIXED_DP = "tree.edge.privacy={clip: 0.5, noise_multiplier: 1.0}"
DP_SGD = "tree.client.train.dp_sgd={noise_multiplier: 1.0, max_grad_norm: 1.0}"
# DP-FedBuff: asynchronous edges (2 in flight, flushes of 2), each buffered update clipped, noise per flush
DP_FEDBUFF = ["tree.edge.mode=async", "tree.edge.concurrency=2", "tree.edge.buffer=2", EDGE_DP]
# the same edges with DP around secure aggregation: each flush one masked round over the edge's 3 clients
SECAGG_FEDBUFF = [*DP_FEDBUFF[:3], "tree.edge.aggregate={wrap: [{dp: {clip: 0.5, noise_multiplier: 1.0}}, secagg]}"]
# the workers' runs draw their keys from the OS (each round's root travels in the plan): other masks, the same models
SECURE = "tree.edge.secure_aggregation={threshold: 2, randomness: secure}"
SECURE_FEDBUFF = [
    *DP_FEDBUFF[:3],
    "tree.edge.aggregate={wrap: [{dp: {clip: 0.5, noise_multiplier: 1.0}}, {secagg: {randomness: secure}}]}",
]


def _run(folder: Path, *overrides: str) -> dict:
    return _plain(folder, EDGE_DP, *overrides)


def _plain(folder: Path, *overrides: str) -> dict:
    return run_experiment(small_config(*overrides), folder, orchestration=PLAIN_CALLS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("privacy")
    return {
        "inprocess": _run(base / "a", "runtime.executor=inprocess", "eval.figures=true"),
        "again": _run(base / "b", "runtime.executor=inprocess"),
        "workers": _run(base / "c", "runtime.executor=local", "runtime.workers=2"),
        "plain": run_experiment(small_config("runtime.executor=inprocess"), base / "d", orchestration=PLAIN_CALLS),
        "secagg": _plain(base / "e", SECAGG, "runtime.executor=inprocess"),
        "secagg-workers": _plain(base / "f", SECURE, "runtime.executor=local", "runtime.workers=2"),
        "secagg-dp": _plain(base / "g", SECAGG, FIXED_DP, "runtime.executor=inprocess"),
        "dp-sgd": _plain(base / "h", DP_SGD, "runtime.executor=inprocess"),
        "dp-sgd-workers": _plain(base / "i", DP_SGD, "runtime.executor=local", "runtime.workers=2"),
        "dp-fedbuff": _plain(base / "j", *DP_FEDBUFF, "runtime.executor=inprocess"),
        "dp-fedbuff-workers": _plain(base / "k", *DP_FEDBUFF, "runtime.executor=local", "runtime.workers=2"),
        "secagg-fedbuff": _plain(base / "l", *SECAGG_FEDBUFF, "runtime.executor=inprocess"),
        "secagg-fedbuff-workers": _plain(base / "m", *SECURE_FEDBUFF, "runtime.executor=local", "runtime.workers=2"),
        "audit": _run(base / "n", "runtime.executor=inprocess", "eval.privacy_audit={canaries: 20}"),
    }


def test_a_dp_run_is_bit_identical_across_reruns_and_worker_layouts(runs):
    first = node_files(Path(runs["inprocess"]["run_path"]))
    assert first == node_files(Path(runs["again"]["run_path"]))
    assert first == node_files(Path(runs["workers"]["run_path"]))  # clients clipped and folded on 2 worker processes
    plain = node_files(Path(runs["plain"]["run_path"]))
    assert first["root.safetensors"] != plain["root.safetensors"]  # the edges' noise reached the root


def test_eval_figures_false_leaves_out_the_figures_and_nothing_else(runs):
    # "inprocess" draws its figures, "again" (the same run) does not: tests/small.py turns them off
    drawn, bare = (Path(runs[key]["run_path"]) / "report" for key in ("inprocess", "again"))
    figures = {"heatmap", "proximity", "clients_histogram", "time_to_accuracy", "privacy"}
    assert (
        {p.stem for p in (drawn / "eval").glob("*.png")} == {p.stem for p in (drawn / "eval").glob("*.svg")} == figures
    )
    tables = sorted(p.relative_to(bare) for p in bare.rglob("*") if p.is_file() and p.suffix not in (".md", ".html"))
    assert [p.suffix for p in tables] == [".csv"] * len(tables) and len(tables) >= 8  # no figure at all
    for table in tables:  # every number the same
        assert (bare / table).read_bytes() == (drawn / table).read_bytes(), table
    with_figures, without = ((folder / "report.md").read_text().splitlines() for folder in (drawn, bare))
    linked = [line for line in with_figures if ".png" in line or ".svg" in line]
    assert len(linked) >= 4 and not set(linked) & set(without)  # each figure's image and link lines left out
    assert [line for line in with_figures if line.startswith("#")] == [line for line in without if line.startswith("#")]
    assert "No figures (`eval.figures: false`): their numbers are in `eval/*.csv`." in without
    assert ".png" not in "".join(without) and "<img" not in (bare / "report.html").read_text()


def test_each_edge_logs_its_clip_noise_and_growing_epsilon_and_keeps_the_adaptive_clip(runs):
    result = runs["inprocess"]
    client = MlflowClient(result["tracking_uri"])
    exp = client.get_experiment_by_name("itest")
    by_node = {
        r.data.tags.get("bhfl.node"): r
        for r in client.search_runs([exp.experiment_id], max_results=1000)
        if r.data.tags.get("bhfl.node")
    }
    for edge in ("edge-en", "edge-fr", "edge-de"):
        run_id = by_node[edge].info.run_id
        eps = [m.value for m in client.get_metric_history(run_id, "privacy/epsilon")]
        clips = [m.value for m in client.get_metric_history(run_id, "privacy/clip")]
        assert len(eps) == 2 and 0 < eps[0] < eps[1]  # 2 edge rounds (1 per root round): spent, then more
        assert clips[0] == 0.5 and clips[1] != 0.5  # the second round clips at the adaptively moved norm
        noise = client.get_metric_history(run_id, "privacy/noise_std")[0].value
        assert noise == pytest.approx((1.0**-2 - 2.0**-2) ** -0.5 * 0.5 / 2)  # z_delta * C / cohort of 2
        header = load_tensors(Path(result["run_path"]) / "state" / "nodes" / f"{edge}.safetensors", [])[1]
        assert header["rule"]["dp/clip"] > 0 and header["rule"]["dp/clip"] != clips[1]  # the next round's norm
    for server in ("root", "west", "east"):
        assert "privacy/epsilon" not in client.get_run(by_node[server].info.run_id).data.metrics


def test_dp_edges_send_up_models_that_differ_from_the_plain_mean(runs):
    tensors = load_tensors(Path(runs["inprocess"]["run_path"]) / "state" / "nodes" / "edge-en.safetensors", ["model"])
    plain = load_tensors(Path(runs["plain"]["run_path"]) / "state" / "nodes" / "edge-en.safetensors", ["model"])
    assert not torch.equal(tensors[0]["model"], plain[0]["model"])


def test_the_report_and_the_parent_run_give_the_epsilon_spent(runs):
    result = runs["inprocess"]
    client = MlflowClient(result["tracking_uri"])
    exp = client.get_experiment_by_name("itest")
    edges = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("bhfl.role") == "edge"]
    spent = [r.data.metrics["privacy/epsilon"] for r in edges]
    parent = client.get_run(result["run_id"]).data.metrics
    assert parent["privacy/epsilon_max"] == max(spent)
    report = (Path(result["run_path"]) / "report" / "report.md").read_text()
    section = report.split("## Differential privacy", 1)[1].split("\n## ", 1)[0]
    assert section.count("| edge-") == 3 and f"{max(spent):.3g}" in section
    plain = (Path(runs["plain"]["run_path"]) / "report" / "report.md").read_text()
    assert "## Differential privacy" not in plain


def test_secure_aggregation_runs_are_bit_identical_across_workers_and_close_to_the_plain_mean(runs):
    masked = node_files(Path(runs["secagg"]["run_path"]))
    assert masked == node_files(Path(runs["secagg-workers"]["run_path"]))
    plain_root = load_tensors(Path(runs["plain"]["run_path"]) / "state" / "nodes" / "root.safetensors", ["model"])
    root = load_tensors(Path(runs["secagg"]["run_path"]) / "state" / "nodes" / "root.safetensors", ["model"])
    assert torch.allclose(root[0]["model"], plain_root[0]["model"], atol=1e-4)  # fixed point: 2^-24 per value
    client = MlflowClient(runs["secagg"]["tracking_uri"])
    exp = client.get_experiment_by_name("itest")
    edges = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("bhfl.role") == "edge"]
    assert len(edges) == 3 and all(r.data.metrics["secagg/recovered_clients"] == 0 for r in edges)
    assert all(r.data.metrics["secagg/clamped_values"] == 0 for r in edges)


def test_secure_aggregation_with_dp_clips_and_noises_and_reports_epsilon(runs):
    result = runs["secagg-dp"]
    client = MlflowClient(result["tracking_uri"])
    exp = client.get_experiment_by_name("itest")
    edges = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("bhfl.role") == "edge"]
    assert all(r.data.metrics["privacy/epsilon"] > 0 and "secagg/clamped_values" in r.data.metrics for r in edges)
    assert (
        node_files(Path(result["run_path"]))["root.safetensors"]
        != node_files(Path(runs["secagg"]["run_path"]))["root.safetensors"]
    )


def test_dp_sgd_clients_count_their_steps_and_the_report_gives_their_epsilon(runs):
    from bhfl_core.store.node_store import StateStore

    result = runs["dp-sgd"]
    run_path = Path(result["run_path"])
    assert node_files(run_path) == node_files(Path(runs["dp-sgd-workers"]["run_path"]))  # seeded noise, any layout
    assert node_files(run_path)["root.safetensors"] != node_files(Path(runs["plain"]["run_path"]))["root.safetensors"]
    store = StateStore(run_path / "state")
    steps = {c: store.load_header(c).dp_steps for c in ("en-00", "en-01", "en-02", "de-00", "fr-02")}
    assert all(n > 0 for n in steps.values()), steps  # every client trained at least once (cohort 2 of 3, 2 rounds)
    parent = MlflowClient(result["tracking_uri"]).get_run(result["run_id"]).data.metrics
    assert parent["privacy/client_epsilon_max"] > 0
    # a client's training loss is un-noised over the examples its DP-SGD protects: it does not go to its edge
    tracking = MlflowClient(result["tracking_uri"])
    runs_there = tracking.search_runs([tracking.get_experiment_by_name("itest").experiment_id])
    edges = [r.data.metrics for r in runs_there if r.data.tags.get("bhfl.role") == "edge"]
    assert len(edges) == 3 and all("Training/loss" not in m and m["Training/clients"] > 0 for m in edges)
    report = (run_path / "report" / "report.md").read_text()
    assert "Sample-level DP-SGD at 9 clients (noise multiplier 1, per-example clip 1)" in report


@pytest.mark.timeout(900)
def test_a_dp_run_killed_after_an_adaptive_round_resumes_bit_identically(runs, tmp_path):
    """Killed by SIGKILL once the fourth server round is committed (edges with an adaptive clip in their state),
    `bhfl resume` finishes it: the same noise, the same clips, the same node files as the uninterrupted run."""
    run_path = killed_and_resumed([*SMALL, EDGE_DP, "runtime.executor=inprocess"], tmp_path)
    assert node_files(run_path) == node_files(Path(runs["inprocess"]["run_path"]))


def test_a_dp_fedbuff_run_is_the_same_on_any_workers_and_logs_epsilon_per_flush(runs):
    """DP at asynchronous edges: each flush's epsilon is the accountant's for that many flushes of the Gaussian
    mechanism on a buffer of 2 with no sampling assumed (docs/privacy.md, "At an asynchronous server")."""
    from bhfl_core.algorithm.privacy_accounting import epsilon
    from bhfl_core.config.topology import build_tree, placeholder_clients

    result = runs["dp-fedbuff"]
    assert node_files(Path(result["run_path"])) == node_files(Path(runs["dp-fedbuff-workers"]["run_path"]))
    config = small_config(*DP_FEDBUFF)
    params = build_tree(config, placeholder_clients(config))["edge-en"].settings.aggregate.privacy
    assert params is not None and (params.expected, params.population) == (2, 2)
    client = MlflowClient(result["tracking_uri"])
    exp = client.get_experiment_by_name("itest")
    (edge,) = client.search_runs([exp.experiment_id], "tags.`bhfl.node` = 'edge-en'")
    history = sorted(client.get_metric_history(edge.info.run_id, "privacy/epsilon"), key=lambda m: m.step)
    flushes = [m.step for m in client.get_metric_history(edge.info.run_id, "async/buffered")]
    assert len(history) == len(flushes) >= 2
    assert [m.value for m in history] == pytest.approx([epsilon(params, i + 1) for i in range(len(history))])
    assert history[0].value < history[-1].value < float("inf")


@pytest.mark.timeout(900)
def test_a_dp_fedbuff_run_killed_mid_way_resumes_bit_identically(runs, tmp_path):
    run_path = killed_and_resumed([*SMALL, *DP_FEDBUFF, "runtime.executor=inprocess"], tmp_path)
    assert node_files(run_path) == node_files(Path(runs["dp-fedbuff"]["run_path"]))


def test_secure_aggregation_at_asynchronous_edges_unmasks_every_flush_the_same_on_any_workers(runs):
    result = runs["secagg-fedbuff"]
    assert node_files(Path(result["run_path"])) == node_files(Path(runs["secagg-fedbuff-workers"]["run_path"]))
    client = MlflowClient(result["tracking_uri"])
    exp = client.get_experiment_by_name("itest")
    (edge,) = client.search_runs([exp.experiment_id], "tags.`bhfl.node` = 'edge-en'")
    recovered = [m.value for m in client.get_metric_history(edge.info.run_id, "secagg/recovered_clients")]
    epsilons = client.get_metric_history(edge.info.run_id, "privacy/epsilon")
    assert len(recovered) == len(epsilons) >= 2 and set(recovered) == {1.0}  # 3 children, flushes of 2


def test_no_childs_loss_leaves_a_dp_server_and_a_secagg_server_sees_none(runs):
    """Side values: a DP edge reports no training loss or example total to its parent (only its noised model
    goes up), so the servers above log none; a secure-aggregation edge is not even told its clients' losses."""

    def metrics(result: dict, node: str) -> dict[str, float]:
        client = MlflowClient(result["tracking_uri"])
        exp = client.get_experiment_by_name("itest")
        (run,) = client.search_runs([exp.experiment_id], f"tags.`bhfl.node` = '{node}'")
        return run.data.metrics

    assert "Training/loss" in metrics(runs["plain"], "west") and "Training/loss" in metrics(runs["plain"], "edge-en")
    dp = runs["inprocess"]
    assert "Training/loss" in metrics(dp, "edge-en")  # the DP server is trusted with its children's values
    assert "Training/loss" not in metrics(dp, "west") and "Training/loss" not in metrics(dp, "root")
    secure = metrics(runs["secagg"], "edge-en")
    assert "Training/loss" not in secure and secure["Training/clients"] == 2.0


def test_the_report_plots_each_dp_servers_epsilon_per_round_beside_its_plan(runs):
    from bhfl_core.config.topology import build_tree, placeholder_clients

    result = runs["inprocess"]
    report = Path(result["run_path"]) / "report"
    lines = (report / "eval" / "privacy_epsilon.csv").read_text().splitlines()
    client = MlflowClient(result["tracking_uri"])
    exp = client.get_experiment_by_name("itest")
    (edge,) = client.search_runs([exp.experiment_id], "tags.`bhfl.node` = 'edge-en'")
    logged = sorted(client.get_metric_history(edge.info.run_id, "privacy/epsilon"), key=lambda m: m.step)
    mine = [line.split(",") for line in lines[1:] if line.startswith("edge-en,")]
    assert lines[0] == "server,step,round,epsilon" and [float(v) for *_, v in mine] == [m.value for m in logged]
    assert (report / "eval" / "privacy.png").stat().st_size > 0
    config = small_config(EDGE_DP)
    tree = build_tree(config, placeholder_clients(config))
    planned = tree["edge-en"].settings.aggregate.privacy.budget.planned_rounds
    assert planned == tree["edge-en"].settings.rounds * tree.root.settings.rounds == len(logged)  # all it could run
    assert "| planned rounds | planned epsilon | budget |" in (report / "report.md").read_text()


def test_an_audit_run_reports_each_edges_empirical_epsilon_below_its_bound(runs):
    """Canary clients at every DP edge (eval.privacy_audit): the report's audit column and the parent's
    privacy/epsilon_empirical_max, below the analytical privacy/epsilon_max; the canaries changed the run."""
    result = runs["audit"]
    parent = MlflowClient(result["tracking_uri"]).get_run(result["run_id"]).data.metrics
    assert 0 <= parent["privacy/epsilon_empirical_max"] < parent["privacy/epsilon_max"]
    lines = (Path(result["run_path"]) / "report" / "report.md").read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.endswith("| budget | audit epsilon |"))
    table = lines[header + 2 : header + 5]  # the privacy table's rows: one per DP edge
    audited = [float(line.split("|")[-2]) for line in table]
    assert all(line.startswith("| edge-") for line in table) and all(0 <= value < float("inf") for value in audited)
    files = node_files(Path(result["run_path"]))
    assert files["edge-en.safetensors"] != node_files(Path(runs["inprocess"]["run_path"]))["edge-en.safetensors"]
