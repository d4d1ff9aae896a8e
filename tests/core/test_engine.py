"""EXECUTENODE on a hand-built tree with a deterministic fake TRAIN: exact models per node.

Tree: root -> A(a1 w=1, a2 w=3), B(b1 w=2, b2 w=2); TRAIN adds a1=[1,0], a2=[0,2],
b1=[2,2], b2=[4,0], root=[0,-1] (root proxy training). Root starts at [0, 0].
"""

import pytest
import torch

from bhfl_core.engine import execute_node
from bhfl_core.state_store import NodeState, StateStore
from tests.core.fake_tree import AddVectorHooks, settings, two_edge_tree


def run(tree, tmp_path, root_executions=1):
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    hooks = AddVectorHooks(tree, store)
    for _ in range(root_executions):
        execute_node(tree, tree.root, None, store, hooks, seed=0)
    return store, hooks


def model(store, node):
    return store.load_model(node).tolist()


def test_fedavg_replacement_one_round(tmp_path):
    store, _ = run(two_edge_tree(settings(train=True)), tmp_path)
    # clients start from phi = 0: a1=[1,0], a2=[0,2] -> A = (1*a1 + 3*a2)/4 = [0.25, 1.5]
    assert model(store, "a1") == [1.0, 0.0] and model(store, "a2") == [0.0, 2.0]
    assert model(store, "A") == [0.25, 1.5]
    assert model(store, "B") == [3.0, 1.0]  # (2*[2,2] + 2*[4,0]) / 4
    # root = (4*A + 4*B)/8 = [1.625, 1.25], then proxy TRAIN adds [0,-1]
    assert model(store, "root") == [1.625, 0.25]


def test_fedavg_replacement_two_rounds(tmp_path):
    store, hooks = run(two_edge_tree(settings(train=True), root_rounds=2), tmp_path)
    phi = [1.625, 0.25]  # root after round 1; eta_down = 1 replaces every child model with it
    a1, a2 = [phi[0] + 1, phi[1]], [phi[0], phi[1] + 2]  # [2.625, 0.25], [1.625, 2.25]
    b1, b2 = [phi[0] + 2, phi[1] + 2], [phi[0] + 4, phi[1]]
    A = [(a1[i] + 3 * a2[i]) / 4 for i in range(2)]  # [1.875, 1.75]
    B = [(b1[i] + b2[i]) / 2 for i in range(2)]  # [4.625, 1.25]
    assert model(store, "a1") == a1 and model(store, "a2") == a2
    assert model(store, "A") == A == [1.875, 1.75]
    assert model(store, "B") == B
    assert model(store, "root") == [(A[0] + B[0]) / 2, (A[1] + B[1]) / 2 - 1] == [3.25, 0.5]
    assert ("root", 1) in hooks.rounds and ("A", 1) in hooks.rounds and ("a1", 1) in hooks.rounds


def test_partial_aggregation_down_keeps_half_of_client_model(tmp_path):
    store, _ = run(two_edge_tree(settings(train=True, eta_down=0.5), root_rounds=2), tmp_path)
    phi = [1.625, 0.25]  # round 1 is identical: clients without a model adopt phi
    # round 2: theta_0 = W + 0.5 * (phi - W), then TRAIN
    a1 = [1.0 + 0.5 * (phi[0] - 1.0) + 1, 0.0 + 0.5 * (phi[1] - 0.0)]  # [2.3125, 0.125]
    a2 = [0.0 + 0.5 * phi[0], 2.0 + 0.5 * (phi[1] - 2.0) + 2]  # [0.8125, 3.125]
    b1 = [2.0 + 0.5 * (phi[0] - 2.0) + 2, 2.0 + 0.5 * (phi[1] - 2.0) + 2]  # [3.8125, 3.125]
    b2 = [4.0 + 0.5 * (phi[0] - 4.0) + 4, 0.0 + 0.5 * phi[1]]  # [6.8125, 0.125]
    for node, want in {"a1": a1, "a2": a2, "b1": b1, "b2": b2}.items():
        assert model(store, node) == pytest.approx(want)
    A = [(a1[i] + 3 * a2[i]) / 4 for i in range(2)]
    B = [(b1[i] + b2[i]) / 2 for i in range(2)]
    assert model(store, "root") == pytest.approx([(A[0] + B[0]) / 2, (A[1] + B[1]) / 2 - 1])


def test_non_persistent_clients_start_from_parent(tmp_path):
    store, _ = run(two_edge_tree(settings(train=True, eta_down=0.5, persistent=False), root_rounds=2), tmp_path)
    assert not store.has("a1")  # keeps no state
    phi = [1.625, 0.25]
    A = [phi[0] + 0.25, phi[1] + 1.5]  # clients start exactly from phi despite eta_down = 0.5
    B = [phi[0] + 3.0, phi[1] + 1.0]
    assert model(store, "root") == pytest.approx([(A[0] + B[0]) / 2, (A[1] + B[1]) / 2 - 1])


def test_round_counter_and_resume_from_state(tmp_path):
    """Two executions of a 1-round root equal one execution of a 2-round root."""
    store_a, _ = run(two_edge_tree(settings(train=True)), tmp_path / "a", root_executions=2)
    store_b, _ = run(two_edge_tree(settings(train=True), root_rounds=2), tmp_path / "b")
    assert model(store_a, "root") == model(store_b, "root")
    assert store_a.load("root").rounds_done == 2 and store_a.load("A").rounds_done == 2


def test_cohort_sampling_is_seeded(tmp_path):
    from bhfl_core.rng import sample_cohort

    kids = [f"c{i}" for i in range(10)]
    draws = [sample_cohort(kids, 3, seed=7, node_id="edge", round_index=r) for r in range(5)]
    assert draws == [sample_cohort(kids, 3, seed=7, node_id="edge", round_index=r) for r in range(5)]
    assert all(len(d) == 3 and d == sorted(d, key=kids.index) for d in draws)
    assert len({tuple(d) for d in draws}) > 1  # rounds differ
    assert sample_cohort(kids, 3, seed=8, node_id="edge", round_index=0) != draws[0] or \
        sample_cohort(kids, 3, seed=9, node_id="edge", round_index=0) != draws[0]
    assert sample_cohort(kids, None, 0, "edge", 0) == kids
