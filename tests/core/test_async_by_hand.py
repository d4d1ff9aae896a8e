"""FedBuff / FedAsync edge cases of the asynchronous node, against hand-computed flushes (same fake star as
``test_async_engine.py``: a child returns theta + STEPS[child] after DURATIONS[child] virtual seconds)."""

from dataclasses import replace

import torch

from bhfl_core.algorithm.async_engine import execute_async_node
from bhfl_core.algorithm.asynchrony import AsyncParams, StalenessParams
from bhfl_core.algorithm.node_state import NodeState
from bhfl_core.algorithm.residuals import UpLink
from bhfl_core.algorithm.tree import Tree
from bhfl_core.store.node_store import StateStore
from tests.core.fake_tree import STEPS, settings
from tests.core.test_async_engine import DURATIONS, POLY, WEIGHTS, FakeChildren, star


def run_root(tmp_path, rounds: int, params: AsyncParams, **root_settings):
    tree = star(rounds, params)
    root = replace(tree.root, settings=replace(tree.root.settings, **root_settings))
    tree = Tree(nodes={**tree.nodes, "root": root}, root_id="root")
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    hooks = FakeChildren()
    return execute_async_node(tree, tree.root, None, store, hooks, 0), store, hooks


def test_concurrency_one_and_buffer_one_is_sequential_fedasync(tmp_path):
    """C = 1, K = 1: every result is fresh (s = 0), so each flush is FedAsync's mixing
    x_t = (1 - alpha) x_{t-1} + alpha y_t with alpha = eta_up (fedavg), y_t trained from x_{t-1}:
    x_t = x_{t-1} + alpha STEPS[c_t]. The clock is the sum of the calls' durations; nothing is left in flight."""
    alpha = 0.5
    opt_up = replace(settings().opt_up, eta=alpha)
    params = AsyncParams(concurrency=1, buffer=1, staleness=StalenessParams("poly", a=0.5))
    result, store, hooks = run_root(tmp_path, 4, params, opt_up=opt_up)
    x = torch.zeros(2, dtype=torch.float64)
    for child, _, sent in hooks.started:  # each call was sent the newest model, one at a time
        assert torch.allclose(sent.double(), x, atol=1e-6)
        x = (1 - alpha) * x + alpha * (x + torch.tensor(STEPS[child], dtype=torch.float64))
    assert len(hooks.started) == 4
    assert torch.allclose(result.theta.double(), x, atol=1e-6)
    assert result.virtual_s == sum(DURATIONS[c] for c, _, _ in hooks.started)
    assert all(r["async/staleness_max"] == 0.0 and r["async/buffered"] == 1.0 for r in hooks.rounds)
    assert store.load("root").metrics["async/dropped_results"] == 0.0


def test_a_buffer_larger_than_the_children_takes_a_child_again(tmp_path):
    """K = 5 > 3 children, C = 3, one flush. t=0: a1 @1, b1 @2, a2 @3. t=1: a1 (sent theta0 again, @2);
    t=2: b1 (earlier dispatch; sent again @4), a1 (sent again @3); t=3: a2 (sent again @6), a1 -> flush:
    all fresh, a1 three times with its weight each time:
    theta1 = (3*1*[1, 0] + 2*[2, 2] + 3*[0, 2]) / (3*1 + 2 + 3) = [7/8, 10/8]; b1 and a2 are dropped."""
    params = AsyncParams(concurrency=3, buffer=5, staleness=StalenessParams("poly", a=0.5))
    result, store, hooks = run_root(tmp_path, 1, params)
    assert result.theta.tolist() == [7 / 8, 10 / 8]
    assert sorted(c for c, _, _ in hooks.started) == ["a1", "a1", "a1", "a2", "a2", "b1", "b1"]
    assert result.virtual_s == 3.0
    assert store.load("root").metrics["async/dropped_results"] == 2.0
    assert WEIGHTS["a1"] == 1.0  # the hand sums above take a1's weight as 1


def test_up_residual_candidates_at_an_asynchronous_node_are_the_stale_weighted_models_it_folds(tmp_path):
    """SELECTRESIDUALS at a flush ranks and sends the buffered results as the node folds them,
    theta_v + w(s) (y - theta_{v_i}), not the raw y (trained from an older model: ``y - theta_v`` would
    count the node's own drift since as the child's update). The star of ``test_two_flushes_by_hand``:
    flush 2 buffers a1 (p 1, Delta [1, 0]) and a2 (p 3, Delta [0, 2]), both s 1, at theta1 = [5/3, 4/3];
    l2 with k 1 picks a2 and posts theta1 + [0, 2]/sqrt2 (weight 3), where the raw model is [0, 2]."""
    link = UpLink(rule=0, target="sink", k=1, select="l2")
    _, store, _ = run_root(tmp_path, 2, POLY, res_up=(link,))
    inbox = store.inbox("sink", "up", {})
    total = inbox["up0"].total
    assert dict(inbox["up0"].read) == {"up0/root": 1}
    # flush 1 (fresh): b1's [2, 2], weight 2; flush 2: a2 as folded, weight 3
    want = 2 * torch.tensor([2.0, 2.0], dtype=torch.float64)
    want += 3 * torch.tensor([5 / 3, 4 / 3 + 2 / 2**0.5], dtype=torch.float64)
    assert total.weight == 5.0
    assert torch.allclose(total.total.double(), want, atol=1e-5)


def test_a_synchronous_root_receives_its_asynchronous_edge_after_exactly_its_flushes(tmp_path):
    """sync root (2 rounds) -> async edge A (1 flush per execution, C 2, K 1) -> persistent clients a1, a2
    (eta_down 0.5, TRAIN adds [1, 0] / [0, 2]); a1 takes 1 s, a2 3 s on its first call and 0.5 s after.

    Root round 0 sends [0, 0]: A sends it to both; a1 arrives first, A's flush adopts [1, 0] (fedavg, eta 1,
    s 0) and A returns it after 1 s: a2, still in flight, is awaited and dropped, but it saved its model
    [0, 2]. Root round 1 sends [1, 0]: a2 now arrives first, from its own advanced model:
    0.5 [0, 2] + 0.5 [1, 0] + [0, 2] = [0.5, 3], which A adopts and the root receives; a1 (dropped) saved
    0.5 [1, 0] + 0.5 [1, 0] + [1, 0] = [2, 0]. The root's clock: 1 + 0.5."""
    from bhfl_core.algorithm.contract import ROOT_PLAN
    from bhfl_core.algorithm.tree import Node, Role
    from tests.core.test_async_resume import AsyncHooks

    client = settings(train=True, eta_down=0.5)
    nodes = {c: Node(c, Role.CLIENT, 2, "A", (), client, w) for c, w in (("a1", 1.0), ("a2", 3.0))}
    edge = replace(settings(rounds=1), asynchronous=AsyncParams(concurrency=2, buffer=1))
    nodes["A"] = Node("A", Role.EDGE, 1, "root", ("a1", "a2"), edge, 4.0)
    nodes["root"] = Node("root", Role.ROOT, 0, None, ("A",), settings(rounds=2), 4.0)
    tree = Tree(nodes=nodes, root_id="root")

    class Timed(AsyncHooks):
        def call_duration(self, node, child, plan):
            return 1.0 if child.id == "a1" else (3.0 if plan.caller.round < 2 else 0.5)

    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    hooks = Timed(tree, store, None, eager=False)
    result = hooks.execute(tree.root, None, ROOT_PLAN)
    assert result.theta.tolist() == [0.5, 3.0]
    assert store.load("A").rounds_done == 2  # one flush per execution, versions counted on
    assert (store.load_model("a1").tolist(), store.load_model("a2").tolist()) == ([2.0, 0.0], [0.5, 3.0])
    assert [hooks.metrics[("A", r)]["async/dropped_results"] for r in (0, 1)] == [1.0, 1.0]
    assert result.virtual_s == 1.5


def test_an_asynchronous_root_weighs_a_synchronous_edge_by_the_flushes_since_it_was_sent(tmp_path):
    """async root (2 flushes, C 2, K 1, 1/sqrt(1+s)) -> sync edges A (1 round) and B (2 rounds) -> clients
    (1 virtual second a call; TRAIN adds STEPS; edges take the example-weighted mean).

    t=0: A and B are sent theta0 = 0. A's execution takes 1 s: [0, 0] + ([1, 0] + 3 [0, 2]) / 4 = [1/4, 3/2]
    -> flush 1 adopts it (s 0); A is sent theta1 again. t=2: B (2 rounds of + (2 [2, 2] + 2 [4, 0]) / 4,
    so [6, 2] from theta0) ties with A's second call and goes first (earlier dispatch): s 1 ->
    flush 2: theta2 = theta1 + [6, 2] / sqrt2; A's second result is dropped."""
    from bhfl_core.algorithm.contract import ROOT_PLAN
    from bhfl_core.algorithm.tree import Node, Role
    from tests.core.test_async_resume import AsyncHooks

    weights = {"a1": 1.0, "a2": 3.0, "b1": 2.0, "b2": 2.0}
    nodes = {c: Node(c, Role.CLIENT, 2, c[0].upper(), (), settings(train=True), w) for c, w in weights.items()}
    nodes["A"] = Node("A", Role.EDGE, 1, "root", ("a1", "a2"), settings(rounds=1), 4.0)
    nodes["B"] = Node("B", Role.EDGE, 1, "root", ("b1", "b2"), settings(rounds=2), 4.0)
    root = replace(settings(rounds=2), asynchronous=AsyncParams(concurrency=2, buffer=1))
    nodes["root"] = Node("root", Role.ROOT, 0, None, ("A", "B"), root, 8.0)
    tree = Tree(nodes=nodes, root_id="root")
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    hooks = AsyncHooks(tree, store, None, eager=False)
    result = hooks.execute(tree.root, None, ROOT_PLAN)
    r2 = 2**0.5
    want = torch.tensor([1 / 4 + 6 / r2, 3 / 2 + 2 / r2], dtype=torch.float64)
    assert torch.allclose(result.theta.double(), want, atol=1e-6)
    assert result.virtual_s == 2.0
    assert [hooks.metrics[("root", r)]["async/staleness_max"] for r in (0, 1)] == [0.0, 1.0]
    assert hooks.metrics[("root", 1)]["async/dropped_results"] == 1.0
    assert (store.load("A").rounds_done, store.load("B").rounds_done) == (2, 2)  # A ran twice, B once
