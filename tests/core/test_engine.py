"""EXECUTENODE on a hand-built tree with a deterministic fake TRAIN: exact models per node.

Tree: root -> A(a1 w=1, a2 w=3), B(b1 w=2, b2 w=2); TRAIN adds a1=[1,0], a2=[0,2],
b1=[2,2], b2=[4,0], root=[0,-1] (root proxy training). Root starts at [0, 0].
"""

import pytest
import torch

from bhfl_core.algorithm.contract import RoundPlan
from bhfl_core.algorithm.engine import execute_node
from bhfl_core.algorithm.node_state import Caller, NodeState
from bhfl_core.store.node_store import StateStore
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


def test_round_counter_and_execution_identity(tmp_path):
    """Two executions of a 1-round root (two callers) equal one execution of a 2-round root;
    executing again with the same caller is a no-op that returns the saved result."""
    tree = two_edge_tree(settings(train=True))
    store_a = StateStore(tmp_path / "a")
    store_a.save("root", NodeState(model=torch.zeros(2)))
    hooks = AddVectorHooks(tree, store_a)
    first = execute_node(tree, tree.root, None, store_a, hooks, seed=0, plan=RoundPlan(Caller("run-1")))
    before = (tmp_path / "a" / "nodes" / "root.safetensors").read_bytes()
    again = execute_node(tree, tree.root, None, store_a, hooks, seed=0, plan=RoundPlan(Caller("run-1")))
    assert torch.equal(first.theta, again.theta) and len(hooks.rounds) == 7  # 1 root + 2 edge + 4 client rounds
    assert (tmp_path / "a" / "nodes" / "root.safetensors").read_bytes() == before
    execute_node(tree, tree.root, None, store_a, hooks, seed=0, plan=RoundPlan(Caller("run-2")))
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
    assert (
        sample_cohort(kids, 3, seed=8, node_id="edge", round_index=0) != draws[0]
        or sample_cohort(kids, 3, seed=9, node_id="edge", round_index=0) != draws[0]
    )
    assert sample_cohort(kids, None, 0, "edge", 0) == kids


# ---------------------------------------------------------------- residuals


def with_residuals(tree, **per_node):
    """Replace NodeSettings fields (residual links, receiver optimisers, ...) of nodes of ``tree``."""
    from dataclasses import replace

    from bhfl_core.algorithm.tree import Tree

    nodes = dict(tree.nodes)
    for node_id, fields in per_node.items():
        nodes[node_id] = replace(nodes[node_id], settings=replace(nodes[node_id].settings, **fields))
    return Tree(nodes=nodes, root_id=tree.root_id)


def test_up_residual_top1_by_l2_reaches_root_with_its_own_step(tmp_path):
    from bhfl_core.algorithm.node_opt import NodeOptParams
    from bhfl_core.algorithm.residuals import UpLink

    link = UpLink(rule=0, target="root", k=1, select="l2")
    tree = with_residuals(
        two_edge_tree(settings(train=True), root_rounds=2),
        A={"res_up": (link,)},
        B={"res_up": (link,)},
        root={"res_in": (("up0", NodeOptParams("fedavg", eta=0.5)),)},
    )
    store, _ = run(tree, tmp_path)
    # Round 1 (theta_root = 0): A picks a2 (|[0,2]| = 2 > |[1,0]|), weight 3; B picks b2 (|[4,0]|), weight 2.
    # R_up[root] = (3*[0,2] + 2*[4,0]) / 5 = [1.6, 1.2]; regular mean = [1.625, 1.25];
    # theta = [1.625, 1.25] + 0.5 * [1.6, 1.2] = [2.425, 1.85]; proxy TRAIN -> [2.425, 0.85].
    # Round 2 repeats from phi = [2.425, 0.85] with the same picks: root = 2 * phi.
    assert model(store, "root") == pytest.approx([4.85, 1.7])
    state = store.load("root")
    assert int(state.opt_res["up0"]["step"]) == 2  # the residual kind kept its own optimiser state
    assert int(state.opt_up["step"]) == 2
    assert not list((tmp_path / "residuals").rglob("*.safetensors"))  # accumulators consumed


def test_up_residual_mean_of_top2_is_one_unweighted_input(tmp_path):
    from bhfl_core.algorithm.node_opt import NodeOptParams
    from bhfl_core.algorithm.residuals import UpLink

    link = UpLink(rule=0, target="root", k=2, select="l2", combine="mean")
    tree = with_residuals(
        two_edge_tree(settings(train=True), root_train=False),
        A={"res_up": (link,)},
        B={"res_up": (link,)},
        root={"res_in": (("up0", NodeOptParams("fedavg", eta=1.0)),)},
    )
    store, _ = run(tree, tmp_path)
    # A sends mean(a1, a2) = [0.5, 1] (weight 1), B sends mean(b1, b2) = [3, 1] (weight 1): R = [1.75, 1].
    assert model(store, "root") == pytest.approx([1.625 + 1.75, 1.25 + 1.0])


def test_down_residual_from_root_skips_the_edges(tmp_path):
    from bhfl_core.algorithm.node_opt import NodeOptParams
    from bhfl_core.algorithm.residuals import DownLink

    clients = ("a1", "a2", "b1", "b2")
    tree = with_residuals(
        two_edge_tree(settings(train=True, eta_down=0.5), root_rounds=2),
        root={"res_down": tuple(DownLink(0, c) for c in clients)},
        **{c: {"res_in": (("down0", NodeOptParams("fedavg", eta=0.25)),)} for c in clients},
    )
    store, _ = run(tree, tmp_path)
    # Round 1: R_down = theta_root = 0 = phi, and clients without a model adopt phi: as before.
    # Round 2: phi = R = [1.625, 0.25]; theta_0 = W + 0.5 (phi - W) + 0.25 (R - W) = W + 0.75 (phi - W).
    phi = torch.tensor([1.625, 0.25])
    first = {"a1": [1.0, 0.0], "a2": [0.0, 2.0], "b1": [2.0, 2.0], "b2": [4.0, 0.0]}
    from tests.core.fake_tree import STEPS

    for c in clients:
        w = torch.tensor(first[c])
        want = w + 0.75 * (phi - w) + torch.tensor(STEPS[c])
        assert model(store, c) == pytest.approx(want.tolist())
    assert int(store.load("a1").opt_res["down0"]["step"]) == 2
    assert not list((tmp_path / "residuals").rglob("*.safetensors"))


def test_residual_selection_criteria_and_streaming_top_k():
    from bhfl_core.algorithm.residuals import Candidate, keep_top, select_residuals

    theta = torch.zeros(2)
    cands = [
        Candidate("x", torch.tensor([3.0, 0.0]), 1.0, loss=0.1),
        Candidate("y", torch.tensor([0.0, 1.0]), 1.0, loss=0.9),
        Candidate("z", torch.tensor([1.0, 0.1]), 1.0, loss=0.5),
    ]
    assert [c.node_id for c in select_residuals(cands, theta, 1, "l2")] == ["x"]
    assert [c.node_id for c in select_residuals(cands, theta, 2, "loss")] == ["y", "z"]
    # mean update [4/3, 11/30]: y (orthogonal-ish) is the least similar
    mean = torch.stack([c.theta for c in cands]).mean(0)
    assert [c.node_id for c in select_residuals(cands, theta, 1, "cosine", mean)] == ["y"]
    kept: list = []
    for c in cands:
        kept = keep_top(kept, c, theta, 2, "l2")
        assert len(kept) <= 2
    assert [c.node_id for c in kept] == [c.node_id for c in select_residuals(cands, theta, 2, "l2")]


def test_stateful_up_optimiser_carries_momentum_across_rounds(tmp_path):
    from bhfl_core.algorithm.node_opt import NodeOptParams

    tree = with_residuals(
        two_edge_tree(settings(train=True), root_rounds=2),
        root={"opt_up": NodeOptParams("fedavgm", eta=1.0, beta1=0.5)},
    )
    store, _ = run(tree, tmp_path)
    # Round 1: Delta1 = [1.625, 1.25] (the children's mean - 0); m = Delta1; TRAIN -> [1.625, 0.25].
    # Round 2: children adopt phi, so Delta2 = [1.625, 1.25] again; m = 0.5 * Delta1 + Delta2 = [2.4375, 1.875];
    # theta = phi + m = [4.0625, 2.125]; TRAIN -> [4.0625, 1.125].
    assert model(store, "root") == pytest.approx([4.0625, 1.125])
    state = store.load("root")
    assert state.opt_up["m"].tolist() == pytest.approx([2.4375, 1.875]) and state.opt_down == {}


def test_communication_counts_per_round(tmp_path):
    from bhfl_core.algorithm.node_opt import NodeOptParams
    from bhfl_core.algorithm.residuals import DownLink, UpLink

    link = UpLink(rule=0, target="root", k=2, select="l2")
    tree = with_residuals(
        two_edge_tree(settings(train=True, cohort=None)),
        A={"res_up": (link,), "cohort": 1, "res_in": (("down0", NodeOptParams("fedavg")),)},
        B={"res_up": (link,)},
        root={"res_in": (("up0", NodeOptParams("fedavg", eta=0.5)),), "res_down": (DownLink(0, "A"),)},
    )
    _, hooks = run(tree, tmp_path)
    # root: 2 children down and up, one down-residual to A; A: cohort of 1, so only 1 residual model up
    assert {k: v for k, v in hooks.metrics[("root", 0)].items() if k.startswith("comm/")} == {
        "comm/down_models": 2.0,
        "comm/up_models": 2.0,
        "comm/res_down_models": 1.0,
        "comm/res_up_models": 0.0,
    }
    assert hooks.metrics[("A", 0)]["comm/res_up_models"] == 1.0 and hooks.metrics[("A", 0)]["comm/up_models"] == 1.0
    assert hooks.metrics[("B", 0)]["comm/res_up_models"] == 2.0
    assert not any(k.startswith("comm/") for k in hooks.metrics[("b1", 0)])  # clients send, servers count
