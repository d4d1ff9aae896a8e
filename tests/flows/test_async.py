"""Asynchronous nodes (FedBuff) in real runs: flat and under a synchronous root, identical across executors."""

from pathlib import Path

import pytest
from mlflow import MlflowClient

from flows.experiment import PLAIN_CALLS, run_experiment
from tests.small import small_config

pytestmark = pytest.mark.integration

FLAT = (
    "tree.flat=true",
    "tree.groups={}",
    "tree.root.mode=async",
    "tree.root.rounds=3",
    "tree.root.concurrency=4",
    "tree.root.buffer=2",
    "tree.root.proxy_train=async",  # the root's proxy TRAIN runs alongside the clients, buffered like one
    "tree.clock={sigma: 0.8, comm_s: 0.1, dropout_p: 0.2}",
    "eval.every=0",
    "model.tiny.dropout=0.1",
)


def _node_files(run_path: str) -> dict[str, bytes]:
    nodes = Path(run_path) / "state" / "nodes"
    return {p.name: p.read_bytes() for p in sorted(nodes.glob("*.safetensors"))}


def _metric(result: dict, node: str, key: str) -> list[float]:
    client = MlflowClient(result["tracking_uri"])
    runs = client.search_runs([result["experiment_id"]], filter_string=f"tags.`bhfl.node` = '{node}'")
    return [m.value for m in sorted(client.get_metric_history(runs[0].info.run_id, key), key=lambda m: m.step)]


def test_flat_fedbuff_is_identical_across_executors_and_logs_staleness_and_virtual_time(tmp_path):
    here = run_experiment(small_config(*FLAT, "runtime.executor=inprocess"), tmp_path / "a", orchestration=PLAIN_CALLS)
    cluster = run_experiment(small_config(*FLAT, "runtime.workers=2"), tmp_path / "b", orchestration=PLAIN_CALLS)
    reference = _node_files(here["run_path"])
    assert "root.safetensors" in reference
    files = _node_files(cluster["run_path"])
    assert files.keys() == reference.keys()
    assert [n for n in reference if files[n] != reference[n]] == []
    assert cluster["headline"] == here["headline"]

    virtual = _metric(here, "root", "time/virtual_s")
    assert len(virtual) == 3 and virtual == sorted(virtual) and virtual[0] > 0
    assert _metric(here, "root", "async/buffered") == [2.0, 2.0, 2.0]
    staleness = _metric(here, "root", "async/staleness_max")
    assert staleness[0] == 0.0  # nothing can be stale before the first flush
    assert max(staleness) >= 1.0  # with 4 in flight and flushes of 2, later results are stale
    proxy_rows = _metric(here, "root", "Training/proxy_examples")
    assert proxy_rows and set(proxy_rows) == {30.0 * 3}  # buffered with its rows as weight (3 languages x 30)
    assert sum(_metric(here, "root", "comm/up_models")) <= 6 - len(proxy_rows)  # it took a client's place
    assert sum(_metric(here, "root", "Training/dropped_clients")) > 0  # clients dropped out on the clock


def test_async_edges_under_a_synchronous_root(tmp_path):
    cfg = small_config(
        "tree.edge.mode=async",
        "tree.edge.rounds=2",
        "tree.edge.concurrency=2",
        "tree.edge.buffer=1",
        "tree.clock={sigma: 0.5}",
        "eval.every=0",
        "runtime.executor=inprocess",
    )
    result = run_experiment(cfg, tmp_path, orchestration=PLAIN_CALLS)
    for edge in ("edge-en", "edge-fr", "edge-de"):
        # 2 root rounds x 2 flushes of one result each
        assert _metric(result, edge, "async/buffered") == [1.0] * 4
    assert len(_metric(result, "root", "Training/proxy_loss")) == 2  # the synchronous root ran its two rounds
    # the synchronous root's virtual clock: each round waits for its slowest (asynchronous) subtree
    root_time = _metric(result, "root", "time/virtual_s")
    assert len(root_time) == 2 and 0 < root_time[0] < root_time[1]
    slowest_edge = max(_metric(result, e, "time/virtual_s")[1] for e in ("edge-en", "edge-fr", "edge-de"))
    assert root_time[0] > slowest_edge  # edges' clocks restart with each execution; the root's does not
