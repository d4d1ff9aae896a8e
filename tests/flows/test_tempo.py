"""Tempo (seeds/001) wired into a real run: the root retunes each edge's client epochs per root round."""

import math
from pathlib import Path

import pytest
from mlflow import MlflowClient

from bhfl_core.algorithm.tempo import omega, tempo_epochs
from bhfl_core.store.node_store import StateStore
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
    client = MlflowClient(result["tracking_uri"])
    runs = {
        r.data.tags.get("bhfl.node") or r.data.params["name"]: r
        for r in client.search_runs([result["experiment_id"]], max_results=1000)
    }
    root_id = runs["root"].info.run_id
    # the distances the root measured after each root round (logged at step round + 1), per edge
    omegas = {
        edge: {m.step: m.value for m in client.get_metric_history(root_id, f"tempo/omega/{edge}")} for edge in EDGES
    }
    assert all(sorted(steps) == list(range(1, ROUNDS + 1)) for steps in omegas.values())
    # Eq. 9 from them: the epochs of the round after each (schedule[r]: the epochs used in root round r)
    schedule = {r: tempo_epochs({e: omegas[e][r] for e in EDGES}, EPOCHS) for r in range(1, ROUNDS + 1)}
    for epochs in schedule.values():
        assert all(EPOCHS / 2 <= e <= 2 * EPOCHS for e in epochs.values())

    # the schedule is part of the root's state: after the last round it holds the epochs of the next one,
    # and the last distances are those between the saved edge and root models
    store = StateStore(run / "state")
    assert store.load("root").child_epochs == schedule[ROUNDS]
    root = store.load("root").theta
    for edge in EDGES:
        assert omega(store.load(edge).theta, root) == pytest.approx(omegas[edge][ROUNDS], rel=1e-9)

    # every client trained with its edge's epochs of the root round it last ran in
    # (tree.edge.rounds = 1, so an edge's round counter is the root round)
    checked, tree = 0, open_run(str(run)).tree
    for path in sorted((run / "state" / "nodes").glob("*.safetensors")):
        info = store.load_info(path.stem)
        caller, metrics = info.get("exec_caller") or "", info.get("metrics", {})
        if not caller.startswith("edge-") or not metrics.get("Training/examples"):
            continue
        edge, root_round = caller.rsplit(":", 1)
        epochs = schedule[int(root_round)][edge] if int(root_round) else EPOCHS
        rows = int(tree[path.stem].weight)  # the client's training rows; examples count every epoch's
        assert metrics["Training/examples"] == rows * epochs, path.stem
        assert metrics["Training/steps"] == math.ceil(rows / BATCH) * epochs, path.stem
        checked += 1
    assert checked >= len(EDGES)

    # the root's MLflow run has the epochs used, per root round
    for edge in EDGES:
        used = client.get_metric_history(root_id, f"tempo/epochs/{edge}")
        assert [(m.step, m.value) for m in sorted(used, key=lambda m: m.step)] == [
            (1, float(EPOCHS)),
            *((r + 1, float(schedule[r][edge])) for r in range(1, ROUNDS)),
        ]
