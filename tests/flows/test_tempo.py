"""Tempo (seeds/001) wired into a real run: the root retunes each edge's client epochs per root round."""

import math
from pathlib import Path

import pytest
from mlflow import MlflowClient

from bhfl_core.algorithm.tempo import omega, tempo_epochs
from bhfl_core.store.node_store import StateStore
from bhfl_core.store.tempo_schedule import read_schedule
from flows.experiment import PLAIN_CALLS, run_experiment
from tasks.context import open_run
from tests.small import small_config

pytestmark = pytest.mark.integration

ROUNDS = 3
EPOCHS = 2  # c
BATCH = 8
EDGES = ("edge-de", "edge-en", "edge-fr")


def test_tempo_schedule_drives_client_epochs(tmp_path):
    cfg = small_config(
        "tree.groups={}",
        "tree.root.proxy_train=false",
        "tree.tempo=true",
        f"tree.root.rounds={ROUNDS}",
        f"tree.client.train.epochs={EPOCHS}",
        f"tree.client.train.batch_size={BATCH}",
        "eval.every=0",
        "runtime.executor=inprocess",
    )
    result = run_experiment(cfg, tmp_path, orchestration=PLAIN_CALLS)
    run = Path(result["run_path"])
    schedule = read_schedule(run / "state" / "tempo.json")
    # one entry per root round after the first (the epochs used in it), and one for after the last
    assert sorted(schedule) == list(range(1, ROUNDS + 1))
    for entry in schedule.values():
        assert set(entry["epochs"]) == set(entry["omega"]) == set(EDGES)
        assert all(e >= 1 for e in entry["epochs"].values())
        assert entry["epochs"] == tempo_epochs(entry["omega"], EPOCHS)
        assert all(EPOCHS / 2 <= e <= 2 * EPOCHS for e in entry["epochs"].values())

    # the last entry's omegas are the distances between the saved edge and root models
    store = StateStore(run / "state")
    root = store.load("root").theta
    last = schedule[ROUNDS]["omega"]
    for edge in EDGES:
        assert omega(store.load(edge).theta, root) == pytest.approx(last[edge], rel=1e-9)

    # every client trained with its edge's epochs of the root round it last ran in
    # (tree.edge.rounds = 1, so an edge's round counter is the root round)
    checked, tree = 0, open_run(str(run)).tree
    for path in sorted((run / "state" / "nodes").glob("*.safetensors")):
        info = store.load_info(path.stem)
        caller, metrics = info.get("exec_caller") or "", info.get("metrics", {})
        if not caller.startswith("edge-") or not metrics.get("Training/examples"):
            continue
        edge, root_round = caller.rsplit(":", 1)
        epochs = schedule.get(int(root_round), {}).get("epochs", {}).get(edge, EPOCHS) if int(root_round) else EPOCHS
        rows = int(tree[path.stem].weight)  # the client's training rows; examples count every epoch's
        assert metrics["Training/examples"] == rows * epochs, path.stem
        assert metrics["Training/steps"] == math.ceil(rows / BATCH) * epochs, path.stem
        checked += 1
    assert checked >= len(EDGES)

    # the root's MLflow run has omega and the epochs used, per root round
    client = MlflowClient(result["tracking_uri"])
    runs = {
        r.data.tags.get("bhfl.node") or r.data.params["name"]: r
        for r in client.search_runs([result["experiment_id"]], max_results=1000)
    }
    root_id = runs["root"].info.run_id
    for edge in EDGES:
        used = client.get_metric_history(root_id, f"tempo/epochs/{edge}")
        assert [(m.step, m.value) for m in sorted(used, key=lambda m: m.step)] == [
            (1, float(EPOCHS)),
            *((r + 1, float(schedule[r]["epochs"][edge])) for r in range(1, ROUNDS)),
        ]
        measured = client.get_metric_history(root_id, f"tempo/omega/{edge}")
        assert sorted(m.step for m in measured) == list(range(1, ROUNDS + 1))
        assert {m.step: m.value for m in measured}[ROUNDS] == pytest.approx(last[edge])
