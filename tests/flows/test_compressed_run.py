"""Compressed updates end to end, with LoRA adapters as the federated parameters.

Clients send their edge an 8-bit quantised update, edges send their group server the top
10% of theirs (both with error feedback); the root broadcasts 8-bit changes of its model
and the group servers the top 25% of theirs (``compress_down``, with the server's error
feedback); the adapter vector is what is compressed. The runs must be bit-identical across
reruns and worker layouts, and after a kill + resume; ``comm/up_bytes`` and
``comm/down_bytes`` must be the payloads' size.
"""

import math
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from bhfl_core.store.node_store import StateStore, load_tensors
from flows.experiment import PLAIN_CALLS, run_experiment
from tests.flows.kill_chain import killed_and_resumed, node_files
from tests.small import SMALL, small_config

pytestmark = pytest.mark.integration

COMPRESSED = [
    "model.adapter={r: 4, alpha: 8}",
    "tree.edge.aggregate={compress: {kind: int8, block: 256}}",
    "tree.server.aggregate={compress: {kind: topk, fraction: 0.1}}",
    "tree.root.compress_down={kind: int8, block: 256}",
    "tree.server.compress_down={kind: topk, fraction: 0.25}",
]


def _run(folder: Path, *overrides: str) -> dict:
    return run_experiment(small_config(*COMPRESSED, *overrides), folder, orchestration=PLAIN_CALLS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("compressed")
    return {
        "inprocess": _run(base / "a", "runtime.executor=inprocess"),
        "workers": _run(base / "b", "runtime.executor=local", "runtime.workers=2"),
        "uncompressed": run_experiment(
            small_config(COMPRESSED[0], "runtime.executor=inprocess"), base / "c", orchestration=PLAIN_CALLS
        ),
    }


def _by_node(result: dict) -> dict[str, str]:
    client = MlflowClient(result["tracking_uri"])
    exp = client.get_experiment_by_name("itest")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    return {r.data.tags["bhfl.node"]: r.info.run_id for r in runs if r.data.tags.get("bhfl.node")}


def test_a_compressed_lora_run_is_bit_identical_across_worker_layouts_and_differs_from_full_updates(runs):
    first = node_files(Path(runs["inprocess"]["run_path"]))
    assert first == node_files(Path(runs["workers"]["run_path"]))
    assert first["root.safetensors"] != node_files(Path(runs["uncompressed"]["run_path"]))["root.safetensors"]


def test_senders_keep_their_error_feedback_and_payload_and_servers_log_the_payload_bytes(runs):
    result = runs["inprocess"]
    store = StateStore(Path(result["run_path"]) / "state")
    n = store.load_model("root").numel()  # the adapter vector (and head)
    client, edge = store.load("en-00"), store.load("edge-en")
    assert client.feedback is not None and client.feedback.numel() == n and client.feedback.abs().sum() > 0
    assert client.sent["q"].dtype == torch.int8 and client.sent["q"].numel() == n
    assert edge.sent["index"].numel() == math.ceil(0.1 * n) and edge.feedback is not None
    tracking = MlflowClient(result["tracking_uri"])
    by_node = _by_node(result)
    int8_bytes = n + 4 * math.ceil(n / 256)
    for edge_id in ("edge-en", "edge-fr", "edge-de"):
        history = tracking.get_metric_history(by_node[edge_id], "comm/up_bytes")
        models = tracking.get_metric_history(by_node[edge_id], "comm/up_models")
        assert [m.value for m in history] == [m.value * int8_bytes for m in models]  # cohort 2: 2 payloads a round
    west = tracking.get_metric_history(by_node["west"], "comm/up_bytes")
    assert [m.value for m in west] == [2 * 8 * math.ceil(0.1 * n)] * 2  # edge-en and edge-fr: k int32 + k float32


def test_servers_broadcast_compressed_changes_and_log_their_bytes(runs):
    """The first broadcast is the model (4n bytes a child), later ones the payload: every child holds the last."""
    result = runs["inprocess"]
    store = StateStore(Path(result["run_path"]) / "state")
    root, west = store.load("root"), store.load("west")
    n = root.theta.numel()
    assert root.down_ref is not None and root.down_ref.numel() == n and not torch.equal(root.down_ref, root.theta)
    assert west.down_ref is not None and store.load("edge-en").down_ref is None  # edges send their models whole
    tracking, by_node = MlflowClient(result["tracking_uri"]), _by_node(result)
    down = {node: [m.value for m in tracking.get_metric_history(by_node[node], "comm/down_bytes")] for node in by_node}
    assert down["root"] == [2 * 4 * n, 2 * (n + 4 * math.ceil(n / 256))]  # west and east
    assert down["west"] == [2 * 4 * n, 2 * 8 * math.ceil(0.25 * n)]  # edge-en and edge-fr: k int32 + k float32
    assert down["edge-en"] == []  # not set there
    errors = tracking.get_metric_history(by_node["root"], "comm/down_error")
    assert errors[0].value == 0 and 0 < errors[1].value < 0.1  # 8 bits leave a few per cent of the change behind


def test_the_report_counts_the_payloads_not_full_models(runs):
    def total(result: dict) -> float:
        return MlflowClient(result["tracking_uri"]).get_run(result["run_id"]).data.metrics["comm/up_bytes"]

    compressed, full = total(runs["inprocess"]), total(runs["uncompressed"])
    assert 0 < compressed < full / 2  # clients' updates at a quarter of the size, edges' at a fifth
    report = (Path(runs["inprocess"]["run_path"]) / "report" / "report.md").read_text()
    counted = "compressed updates (`aggregate.compress`) and broadcasts (`compress_down`) count their payloads' bytes"
    assert counted in report


def test_the_backbone_is_untouched_and_only_adapter_vectors_are_stored(runs):
    state = Path(runs["inprocess"]["run_path"]) / "state" / "nodes"
    tensors, _ = load_tensors(state / "root.safetensors")
    n = tensors["model"].numel()
    assert n < 20_000  # the tiny model has ~30k parameters in its embeddings alone: these are adapters and the head
    assert all(t.numel() <= n for t in tensors.values())


@pytest.mark.timeout(900)
def test_a_compressed_run_killed_mid_way_resumes_bit_identically(runs, tmp_path):
    """SIGKILL once the fourth server round is committed (clients and edges hold error feedback), then `bhfl resume`."""
    run_path = killed_and_resumed([*SMALL, *COMPRESSED, "runtime.executor=inprocess"], tmp_path)
    assert node_files(run_path) == node_files(Path(runs["inprocess"]["run_path"]))


EVERY_MECHANISM = [
    "tree.edge.mode=async",  # FedBuff edges: stale-weighted adapter updates, buffered
    "tree.edge.concurrency=2",
    "tree.edge.buffer=1",
    "tree.client.personal={mu: 0.5, lr: 0.003, epochs: 1, batch_size: 16}",  # Ditto: a personal adapter vector
    "tree.client.eta_down=0.5",  # partial aggregation down (and FedAdam up/down with residuals: bhfl-full.yaml)
    "eval.every=0",
]


def test_nodeopts_residuals_async_ditto_and_compression_work_on_the_adapter_vector(runs, tmp_path):
    config = small_config(*COMPRESSED, *EVERY_MECHANISM, "runtime.executor=inprocess", config="bhfl-full.yaml")
    result = run_experiment(config, tmp_path, orchestration=PLAIN_CALLS)
    store = StateStore(Path(result["run_path"]) / "state")
    n = store.load_model("root").numel()
    assert n == StateStore(Path(runs["inprocess"]["run_path"]) / "state").load_model("root").numel()
    root = store.load("root")
    assert root.opt_res and all(opt["m"].numel() == n for opt in root.opt_res.values())  # residuals' FedAdam moments
    assert root.opt_up["m"].numel() == root.opt_up["v"].numel() == n
    client = next(store.load(c) for c in ("de-00", "de-01", "de-02") if store.has(c))  # one the async edge called
    assert client.personal is not None and client.personal.numel() == n and client.feedback is not None
    assert not torch.equal(client.personal, client.theta)
    metrics = MlflowClient(result["tracking_uri"]).get_run(_by_node(result)["edge-de"]).data.metrics
    assert metrics["async/buffered"] == 1 and metrics["comm/up_bytes"] == n + 4 * math.ceil(n / 256)


def test_an_edge_model_is_the_example_weighted_mean_of_its_clients_adapter_vectors(runs):
    from tasks.context import RunContext

    ctx = RunContext.open(Path(runs["uncompressed"]["run_path"]))  # LoRA, models sent as they are
    store = ctx.store
    edge = store.load("edge-en")
    last = f"edge-en:{edge.rounds_done - 1}"  # the clients its last round called sent what they saved
    cohort = [c for c in ctx.tree["edge-en"].children if store.load_header(c).exec_caller == last]
    assert len(cohort) == 2  # cohort 2 of 3
    weights = torch.tensor([ctx.tree[c].weight for c in cohort], dtype=torch.float64)
    models = torch.stack([store.load_model(c).double() for c in cohort])
    mean = (weights[:, None] * models).sum(0) / weights.sum()
    assert edge.model is not None and edge.model.numel() < 20_000  # adapters and head
    assert torch.allclose(edge.model.double(), mean, rtol=0, atol=1e-7)
