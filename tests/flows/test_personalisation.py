"""Ditto, interp (APFL-style) and Tempo in real runs: wired, evaluated, logged, and bit-identical across executors.

One config turns on all three: clients keep a Ditto personal model and tune their
down-aggregation with ``interp`` on held-out rows; the root tunes its up-aggregation
with ``interp`` on held-out proxy rows (scored on a worker); the root retunes the
client epochs with Tempo. The run is made in this process (no workers) and on a local
cluster of two worker processes, with dropout on: the node states must be the same bytes.
"""

import math
from pathlib import Path

import pytest
from mlflow import MlflowClient

from bhfl_core.algorithm.node_opt import NodeOptParams
from bhfl_core.analysis.matrix_axes import ModelRef
from bhfl_core.learning.local_train import planned_steps
from bhfl_core.store.node_store import StateStore
from flows.experiment import PLAIN_CALLS, run_experiment
from tasks.context import open_run
from tests.small import small_config

pytestmark = pytest.mark.integration

GRID = NodeOptParams().alphas
PROXY_BATCH = 8
CONFIG = (
    "tree.groups={}",
    "tree.tempo=true",
    "tree.root.rounds=2",
    "eval.every=0",
    "model.tiny.dropout=0.1",
    "tree.client.personal={mu: 0.5, lr: 0.003, epochs: 1, batch_size: 16}",
    "tree.client.opt_down={kind: interp}",
    "tree.client.eta_down=1.0",
    "tree.client.holdout=0.2",
    "tree.root.opt_up={kind: interp}",
    "tree.root.holdout=0.2",
    f"tree.root.train.batch_size={PROXY_BATCH}",
)


def _node_files(run_path: str) -> dict[str, bytes]:
    nodes = Path(run_path) / "state" / "nodes"
    return {p.name: p.read_bytes() for p in sorted(nodes.glob("*.safetensors"))}


def test_ditto_interp_and_tempo_run_are_evaluated_and_identical_across_executors(tmp_path):
    inprocess = small_config(*CONFIG, "runtime.executor=inprocess")
    here = run_experiment(inprocess, tmp_path / "a", orchestration=PLAIN_CALLS)
    cluster = run_experiment(small_config(*CONFIG, "runtime.workers=2"), tmp_path / "b", orchestration=PLAIN_CALLS)
    reference = _node_files(here["run_path"])
    files = _node_files(cluster["run_path"])
    assert files.keys() == reference.keys()
    assert [n for n in reference if files[n] != reference[n]] == []
    assert cluster["headline"] == here["headline"]

    run = Path(here["run_path"])
    ctx = open_run(str(run))
    store = StateStore(run / "state")
    client_ids = [c.id for c in ctx.tree.clients()]

    # interp at the root: alpha chosen from the grid every round, logged on the root's MLflow run
    mlflow = MlflowClient(here["tracking_uri"])
    node_runs = {r.data.tags["bhfl.node"]: r.info.run_id for r in _node_runs(mlflow, here)}
    alphas = mlflow.get_metric_history(node_runs["root"], "opt/alpha_up")
    assert [m.step for m in alphas] == [1, 2] and all(m.value in GRID for m in alphas)
    assert store.load("root").opt_up["alpha"].item() == alphas[-1].value
    # its proxy TRAIN saw only the kept rows (held-out rows are never trained on)
    proxy_rows = ctx.manifest.proxy_train.size
    held = round(0.2 * proxy_rows)
    root_train = ctx.tree.root.settings.train
    steps = mlflow.get_metric_history(node_runs["root"], "Training/proxy_steps")
    assert steps[-1].value == planned_steps(proxy_rows - held, root_train) != planned_steps(proxy_rows, root_train)

    # interp at the clients: a client that ran twice tuned its second down-aggregation
    tuned = [c for c in client_ids if "alpha" in store.load(c).opt_down]
    assert tuned, "no client ran in both root rounds"
    assert all(store.load(c).opt_down["alpha"].item() in GRID for c in tuned)

    # Ditto: every client that trained has a personal model, different from its federated one, evaluated
    trained = [c for c in client_ids if store.load_info(c).get("rounds_done")]
    assert trained
    for c in trained:
        state = store.load(c)
        assert state.personal is not None and state.personal.shape == state.theta.shape
        assert not state.personal.equal(state.theta)
    matrix = (run / "report" / "eval" / "matrix.csv").read_text()
    for c in trained:
        assert f"{ModelRef.personal(c).name},2,{c}," in matrix  # the personal model on its client's test split
    headline = here["headline"]
    personal_mean = headline["personal_on_own_clients/accuracy_mean"]
    assert 0.0 <= personal_mean <= 1.0 and not math.isnan(personal_mean)
    assert "client_on_own_clients/accuracy_mean" in headline  # the federated client models are evaluated too


def _node_runs(client: MlflowClient, result: dict) -> list:
    return client.search_runs(
        [result["experiment_id"]], filter_string=f"tags.mlflow.parentRunId = '{result['run_id']}'"
    )
