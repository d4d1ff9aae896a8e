"""The asynchronous node loop (FedBuff at a node) against hand-computed flushes, with fake children."""

import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from bhfl_core.algorithm.async_engine import execute_async_node, next_arrival, pick_idle
from bhfl_core.algorithm.asynchrony import AsyncParams, StalenessParams
from bhfl_core.algorithm.contract import ChildResult, MemberLoss
from bhfl_core.algorithm.node_state import InFlight, NodeResult, NodeState
from bhfl_core.algorithm.tree import Node, Role, TrainParams, Tree
from bhfl_core.store.node_store import StateStore
from tests.core.fake_tree import STEPS, settings

WEIGHTS = {"a1": 1.0, "a2": 3.0, "b1": 2.0}
DURATIONS = {"a1": 1.0, "a2": 3.0, "b1": 2.0}
POLY = AsyncParams(concurrency=3, buffer=2, staleness=StalenessParams("poly", a=0.5))


def star(rounds: int, params: AsyncParams) -> Tree:
    """root (async) -> clients a1 (1 example), a2 (3), b1 (2)."""
    nodes = {c: Node(c, Role.CLIENT, 1, "root", (), settings(train=True), w) for c, w in WEIGHTS.items()}
    root = replace(settings(rounds=rounds), asynchronous=params)
    nodes["root"] = Node("root", Role.ROOT, 0, None, tuple(WEIGHTS), root, 6.0)
    return Tree(nodes=nodes, root_id="root")


class Done:
    def __init__(self, result) -> None:
        self._result = result

    def result(self):
        return self._result


class FakeChildren:
    """A child's execution returns theta + STEPS[child]; its virtual duration is DURATIONS[child]."""

    def __init__(self, pool: ThreadPoolExecutor | None = None) -> None:
        self.pool = pool
        self.started: list[tuple[str, int, torch.Tensor]] = []
        self.rounds: list[dict[str, float]] = []
        self.lock = threading.Lock()

    def start_child(self, node, child, theta, plan):
        with self.lock:
            self.started.append((child.id, plan.caller.round, theta.clone()))
        losses = (MemberLoss(child.id, 0.0, 0),)
        result = ChildResult(
            members=(child.id,), model=theta + torch.tensor(STEPS[child.id]), weight=child.weight, losses=losses
        )
        if self.pool is None:
            return Done(result)

        def late():  # real completion order scrambled on purpose
            time.sleep(random.random() * 0.02)
            return result

        return self.pool.submit(late)

    def call_duration(self, node, child, plan):
        return DURATIONS[child.id]

    def train(self, node, theta, key, plan):
        raise AssertionError("no TRAIN at this node")

    def round_done(self, node, key, theta, metrics):
        self.rounds.append(dict(metrics))

    def run_children(self, node, cohort, theta, plans):
        raise AssertionError("an asynchronous node does not run synchronous rounds")

    def score(self, node, candidates):
        raise AssertionError

    def train_personal(self, node, personal, anchor, key):
        raise AssertionError


def run(tmp_path, hooks, rounds=2, params=POLY, seed=0):
    tree = star(rounds, params)
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    return execute_async_node(tree, tree.root, None, store, hooks, seed), store


def test_two_flushes_by_hand(tmp_path):
    # t=0: dispatches 0-2 send theta0 = [0, 0] (version 0) to all three clients: a1 @1, b1 @2, a2 @3.
    # t=1: a1 arrives (p 1, s 0, Delta [1, 0]); a1 is idle again: dispatch 3 sends it theta0 (v0), @2.
    # t=2: b1 (dispatch < 3) and a1 (dispatch 3) tie: b1 arrives (p 2, s 0, Delta [2, 2]) -> flush 1:
    #   theta1 = 0 + (1*[1,0] + 2*[2,2]) / 3 = [5/3, 4/3]          (fedavg, eta 1)
    #   b1 is idle: dispatch 4 sends it theta1 (v1), @4. Then a1 arrives (s 1, w 1/sqrt2, Delta [1, 0]);
    #   dispatch 5 sends a1 theta1 (v1), @3.
    # t=3: a2 (dispatch < 5) and a1 tie: a2 arrives (p 3, s 1, w 1/sqrt2, Delta [0, 2]) -> flush 2:
    #   theta2 = theta1 + (1/sqrt2 [1, 0] + 3/sqrt2 [0, 2]) / 4;  b1 and a1 (in flight) are dropped.
    hooks = FakeChildren()
    result, store = run(tmp_path, hooks)
    r2 = math.sqrt(2)
    want = torch.tensor([5 / 3 + 1 / (4 * r2), 4 / 3 + 6 / (4 * r2)], dtype=torch.float64)
    assert torch.allclose(result.theta.double(), want, atol=1e-6)
    assert torch.equal(store.load("root").theta, result.theta)
    assert result.virtual_s == 3.0
    assert store.load("root").metrics["async/dropped_results"] == 2.0
    first, second = hooks.rounds
    assert (first["time/virtual_s"], second["time/virtual_s"]) == (2.0, 3.0)
    assert (first["async/staleness_max"], second["async/staleness_mean"]) == (0.0, 1.0)
    assert (first["comm/down_models"], second["comm/down_models"]) == (4.0, 2.0)
    # each dispatch sent the model of its moment: theta0 up to dispatch 3, theta1 after flush 1
    sent = {d: (c, theta) for c, d, theta in hooks.started}
    assert sent[3][0] == "a1" and torch.equal(sent[3][1], torch.zeros(2))
    assert [sent[4][0], sent[5][0]] == ["b1", "a1"]
    theta1 = torch.tensor([5 / 3, 4 / 3], dtype=torch.float64)
    assert all(torch.allclose(sent[d][1].double(), theta1) for d in (4, 5))


def test_constant_staleness_weights_every_result_fully(tmp_path):
    # the same arrivals as above with w = 1: theta2 = theta1 + ([1, 0] + 3 [0, 2]) / 4
    params = AsyncParams(concurrency=3, buffer=2, staleness=StalenessParams("constant"))
    result, _ = run(tmp_path, FakeChildren(), params=params)
    want = torch.tensor([5 / 3 + 1 / 4, 4 / 3 + 6 / 4], dtype=torch.float64)
    assert torch.allclose(result.theta.double(), want, atol=1e-6)


def test_the_result_follows_the_virtual_clock_not_real_completion_order(tmp_path):
    reference, _ = run(tmp_path / "a", FakeChildren(), rounds=4, params=AsyncParams(concurrency=2, buffer=1))
    with ThreadPoolExecutor(4) as pool:
        for i in range(3):
            scrambled, _ = run(tmp_path / f"b{i}", FakeChildren(pool), rounds=4, params=AsyncParams(2, 1))
            assert torch.equal(scrambled.theta, reference.theta)
    other_seed, _ = run(tmp_path / "c", FakeChildren(), rounds=4, params=AsyncParams(2, 1), seed=1)
    assert not torch.equal(other_seed.theta, reference.theta)  # another seed, other dispatch draws


def test_pick_idle_and_next_arrival():
    kids = [Node(c, Role.CLIENT, 1, "root", (), settings(), 1.0) for c in ("x", "y", "z")]
    assert pick_idle(kids, {"x", "y", "z"}, 0, "root", 0) is None
    assert pick_idle(kids, {"x", "z"}, 0, "root", 5).id == "y"
    picks = {pick_idle(kids, set(), 0, "root", d).id for d in range(50)}
    assert picks == {"x", "y", "z"}
    flights = [InFlight("x", 3, 0, 0.0, 2.0), InFlight("y", 1, 0, 0.0, 2.0), InFlight("z", 0, 0, 0.0, 5.0)]
    assert next_arrival(flights).child == "y"
    with pytest.raises(ValueError, match="finish time"):
        next_arrival([InFlight("x", 0, 0, 0.0, None)])


def test_synchronous_rounds_take_their_slowest_child_plus_the_own_train_on_the_virtual_clock(tmp_path):
    from bhfl_core.algorithm.engine import execute_node
    from bhfl_core.algorithm.round_tail import VIRTUAL_TIME
    from tests.core.fake_tree import AddVectorHooks, two_edge_tree

    seconds = {"a1": 1.0, "a2": 3.0, "b1": 2.0, "b2": 4.0}

    class Clocked(AddVectorHooks):
        def run_children(self, node, cohort, theta, plans):
            results = super().run_children(node, cohort, theta, plans)
            # clients: their call durations; servers: their execution's virtual time (their result carries it)
            return [replace(r, virtual_s=seconds[r.members[0]]) if r.members[0] in seconds else r for r in results]

        def train(self, node, theta, key, plan):
            theta = super().train(node, theta, key, plan).theta
            return NodeResult(theta, steps=5 if not node.is_leaf else 0)

    tree = two_edge_tree(settings(train=True), root_rounds=2)
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    hooks = Clocked(tree, store)
    result = execute_node(tree, tree.root, None, store, hooks, seed=0)
    # edge A: max(1, 3) = 3; edge B: max(2, 4) = 4; a root round: max(3, 4) + 5 proxy steps = 9
    assert [hooks.metrics[("root", r)][VIRTUAL_TIME] for r in (0, 1)] == [9.0, 18.0]
    assert result.virtual_s == 18.0
    # an edge's clock counts from the start of each of its executions
    assert [hooks.metrics[("A", r)][VIRTUAL_TIME] for r in (0, 1)] == [3.0, 3.0]


class Flaky(FakeChildren):
    """b1's first call fails and is dropped (its result is None); every other call succeeds."""

    def start_child(self, node, child, theta, plan):
        call = super().start_child(node, child, theta, plan)
        first_b1 = child.id == "b1" and [c for c, _, _ in self.started].count("b1") == 1
        return Done(None) if first_b1 else call


def test_a_dropped_child_frees_its_slot_and_is_not_buffered(tmp_path):
    # t=1: a1 arrives (s 0, Delta [1, 0]) and is sent theta0 again (@2); t=2: b1 (earlier dispatch) arrives
    # dropped: nothing buffered, b1 is sent theta0 again (@4); then a1's second result (s 0, Delta [1, 0]):
    # flush 1 = 0 + (1*[1,0] + 1*[1,0]) / 2 = [1, 0]
    hooks = Flaky()
    result, _ = run(tmp_path, hooks, rounds=1)
    assert result.theta.tolist() == [1.0, 0.0]
    assert hooks.rounds[0]["Training/dropped_clients"] == 1.0
    assert [c for c, _, _ in hooks.started].count("b1") == 2  # its slot was refilled


def test_every_child_failing_in_a_row_is_an_error(tmp_path):
    class AllFail(FakeChildren):
        def start_child(self, node, child, theta, plan):
            super().start_child(node, child, theta, plan)
            return Done(None)

    with pytest.raises(RuntimeError, match="in a row were dropped"):
        run(tmp_path, AllFail())


PROXY = {"loss": 0.5, "examples": 2, "steps": 2.5}  # the proxy TRAIN: 2 rows, 2.5 steps = virtual seconds


class WithProxy(FakeChildren):
    """The node's proxy TRAIN adds [0, -1] on 2 rows and takes 2.5 virtual seconds."""

    def __init__(self):
        super().__init__()
        self.proxy_starts: list[tuple[int, torch.Tensor]] = []

    def start_train(self, node, theta, key):
        self.proxy_starts.append((key.round, theta.clone()))
        return Done(NodeResult(theta + torch.tensor([0.0, -1.0]), **PROXY))


def test_asynchronous_proxy_training_is_buffered_like_a_child_result(tmp_path):
    # t=0: the proxy TRAIN starts from theta0 (v0, arrives @2.5), then all three clients (a1 @1, b1 @2, a2 @3).
    # t=1: a1 (p 1, s 0, Delta [1, 0]); a1 sent theta0 again (@2).
    # t=2: b1 (p 2, s 0, Delta [2, 2]) -> flush 1: theta1 = [5/3, 4/3] (the proxy has not arrived yet).
    #   b1 sent theta1 (@4); a1 arrives (s 1, Delta [1, 0]); a1 sent theta1 (@3).
    # t=2.5: the proxy (p 2 = its rows, s 1, Delta [0, -1]) -> flush 2:
    #   theta2 = theta1 + (w [1, 0] + 2 w [0, -1]) / 3, w = 1/sqrt2; no TRAIN after either flush.
    tree = star(2, POLY)
    root = tree.nodes["root"]
    proxy_root = replace(root, settings=replace(root.settings, train=TrainParams(), proxy_async=True))
    tree = Tree(nodes={**tree.nodes, "root": proxy_root}, root_id="root")
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    hooks = WithProxy()
    result = execute_async_node(tree, proxy_root, None, store, hooks, seed=0)
    w = 1 / math.sqrt(2)
    want = torch.tensor([5 / 3 + w / 3, 4 / 3 - 2 * w / 3], dtype=torch.float64)
    assert torch.allclose(result.theta.double(), want, atol=1e-6)
    assert [(v, t.tolist()) for v, t in hooks.proxy_starts] == [(0, [0.0, 0.0])]  # one proxy TRAIN, from theta0
    first, second = hooks.rounds
    assert (first["async/buffered"], second["async/buffered"]) == (2.0, 2.0)
    assert (first["comm/up_models"], second["comm/up_models"]) == (2.0, 1.0)  # the proxy sends nothing up
    assert second["Training/proxy_loss"] == 0.5 and "Training/proxy_loss" not in first
    assert second["time/virtual_s"] == 2.5 and store.load("root").metrics["async/dropped_results"] == 3.0


def test_synchronous_round_merges_an_asynchronous_proxy_training_like_a_child(tmp_path):
    from bhfl_core.algorithm.engine import execute_node
    from bhfl_core.algorithm.round_tail import VIRTUAL_TIME
    from tests.core.fake_tree import AddVectorHooks, two_edge_tree

    started: list[torch.Tensor] = []

    class Hooks(AddVectorHooks):
        def start_train(self, node, theta, key):
            started.append(theta.clone())
            return Done(NodeResult(theta + torch.tensor([0.0, -1.0]), **PROXY))

        def train(self, node, theta, key, plan):
            assert node.is_leaf, "no TRAIN after aggregating at a node whose proxy TRAIN runs alongside"
            return super().train(node, theta, key, plan)

    tree = two_edge_tree(settings(train=True))
    root = tree.nodes["root"]
    root = replace(root, settings=replace(root.settings, proxy_async=True))
    tree = Tree(nodes={**tree.nodes, "root": root}, root_id="root")
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    hooks = Hooks(tree, store)
    result = execute_node(tree, root, None, store, hooks, seed=0)
    # edges: A = [0.25, 1.5] (weight 4), B = [3, 1] (4); the proxy from theta0 = 0: [0, -1] on 2 rows
    # theta1 = (4 [0.25, 1.5] + 4 [3, 1] + 2 [0, -1]) / 10 = [1.3, 0.8]
    assert torch.allclose(result.theta, torch.tensor([1.3, 0.8]))
    assert [t.tolist() for t in started] == [[0.0, 0.0]]
    metrics = hooks.metrics[("root", 0)]
    assert metrics["Training/proxy_loss"] == 0.5 and metrics[VIRTUAL_TIME] == 2.5  # alongside, not after, the children


def test_clients_that_drop_out_are_not_trained_and_hold_their_slot_until_the_call_would_end(tmp_path):
    from bhfl_core.algorithm.virtual_clock import drops_out

    tree = star(3, AsyncParams(concurrency=2, buffer=1))
    nodes = {
        c: replace(n, settings=replace(n.settings, dropout=0.8)) if n.is_leaf else n for c, n in tree.nodes.items()
    }
    tree = Tree(nodes=nodes, root_id="root")
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    hooks = FakeChildren()
    result = execute_async_node(tree, tree.root, None, store, hooks, seed=0)  # no "in a row" error at 80% dropout
    started = {d for _, d, _ in hooks.started}
    assert all(not drops_out(0.8, 0, c, d) for c, d, _ in hooks.started)  # only calls that did not drop out ran
    gaps = set(range(max(started) + 1)) - started
    dropped = sum(r["Training/dropped_clients"] for r in hooks.rounds)
    assert len(gaps) >= 3 and dropped <= len(gaps)  # dispatches that dropped out; some still in flight at the end
    assert sum(r["async/buffered"] for r in hooks.rounds) == 3  # three flushes of one trained result each
    assert result.virtual_s > min(DURATIONS.values())


def test_a_synchronous_round_leaves_out_clients_that_drop_out_and_waits_for_them_on_the_clock(tmp_path):
    from bhfl_core.algorithm.engine import execute_node
    from bhfl_core.algorithm.round_tail import VIRTUAL_TIME
    from bhfl_core.algorithm.virtual_clock import drops_out
    from tests.core.fake_tree import AddVectorHooks, two_edge_tree

    class Hooks(AddVectorHooks):
        def call_duration(self, node, child, plan):
            return 7.0

    # seed 0, p 0.1: in round 0 exactly a2 drops out (its draw is 0.023; the others' 0.38 and more)
    assert [drops_out(0.1, 0, c, 0) for c in ("a1", "a2", "b1", "b2")] == [False, True, False, False]
    tree = two_edge_tree(replace(settings(train=True), dropout=0.1), root_train=False)
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    hooks = Hooks(tree, store)
    result = execute_node(tree, tree.root, None, store, hooks, seed=0)
    assert ("a2", 0) not in hooks.rounds and ("a1", 0) in hooks.rounds  # a2 never trained
    # A = a1's update alone ([1, 0]); B = (2 [2, 2] + 2 [4, 0]) / 4 = [3, 1]; root = (4 A + 4 B) / 8
    assert torch.allclose(result.theta, torch.tensor([2.0, 0.5]))
    edge_a = hooks.metrics[("A", 0)]
    assert edge_a["Training/dropped_clients"] == 1.0 and edge_a["comm/up_models"] == 1.0
    assert edge_a[VIRTUAL_TIME] == 7.0 and hooks.metrics[("B", 0)][VIRTUAL_TIME] == 0.0  # A waited for a2's call


def test_dp_fedbuff_clips_each_buffered_update_takes_one_per_child_and_divides_by_the_buffer(tmp_path):
    """DP-FedBuff at the same star (root async, buffer 2), clip 1.5, no noise: the flushes by hand.

    t=0: a1 @1, b1 @2, a2 @3 (theta0 = 0). t=1: a1 arrives ([1, 0], norm 1: kept); it is in the
    buffer, so it is not sent again before the flush (without DP it would be: test above).
    t=2: b1 arrives ([2, 2], norm 2.83: clipped to 1.5) -> flush 1: theta1 = ([1, 0] + clipped) / 2.
    a1 and b1 are sent theta1 (a1 @3, b1 @4). t=3: a2 (dispatch 2) then a1 (s 0): a2's update is
    w(1) [0, 2] = [0, 1.41] (kept) -> flush 2: theta2 = theta1 + ([0, 2/sqrt2] + [1, 0]) / 2.
    """
    from bhfl_core.algorithm.privacy import clip_update
    from bhfl_core.algorithm.privacy_params import PrivacyParams
    from bhfl_core.algorithm.rule_registry import AggregateParams

    dp = PrivacyParams(clip=1.5, noise_multiplier=0.0, expected=2, population=2, noise_seed=0)
    tree = star(2, POLY)
    root = replace(tree.root, settings=replace(tree.root.settings, aggregate=AggregateParams(wrappers=(dp,))))
    tree = Tree(nodes={**tree.nodes, "root": root}, root_id="root")
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    hooks = FakeChildren()
    result = execute_async_node(tree, tree.root, None, store, hooks, 0)
    clipped = clip_update(torch.tensor([2.0, 2.0]), torch.zeros(2), 1.5)[0].double()
    theta1 = (torch.tensor([1.0, 0.0], dtype=torch.float64) + clipped) / 2
    theta2 = theta1.float().double() + (torch.tensor([1.0, 2 / math.sqrt(2)], dtype=torch.float64)) / 2
    assert torch.allclose(result.theta.double(), theta2, atol=1e-6)
    dispatched = [(child, d) for child, d, _ in hooks.started]
    assert {c for c, _ in dispatched[:3]} == {"a1", "b1", "a2"}
    assert sorted(c for c, d in dispatched[3:]) == ["a1", "b1"]  # a1 was not sent again while it was buffered
    first, second = hooks.rounds
    assert (first["privacy/clipped_fraction"], second["privacy/clipped_fraction"]) == (0.5, 0.0)
    assert first["privacy/noise_std"] == 0.0 and "privacy/epsilon" in second


def test_both_engines_report_the_same_comm_lines(tmp_path):
    """One round tail (round_tail.py): a synchronous round and an asynchronous flush log the same ``comm/*`` keys,
    counted the same way (models sent down, folded up, residual models both ways)."""
    from bhfl_core.algorithm.engine import execute_node
    from tests.core.fake_tree import AddVectorHooks, two_edge_tree

    _, _ = run(tmp_path / "async", hooks := FakeChildren())
    flush = {k: v for k, v in hooks.rounds[0].items() if k.startswith("comm/")}
    tree = two_edge_tree(settings(), root_rounds=1)
    store = StateStore(tmp_path / "sync")
    store.save("root", NodeState(model=torch.zeros(2)))
    sync_hooks = AddVectorHooks(tree, store)
    execute_node(tree, tree.root, None, store, sync_hooks, seed=0)
    synced = {k: v for k, v in sync_hooks.metrics[("root", 0)].items() if k.startswith("comm/")}
    assert (
        flush.keys()
        == synced.keys()
        == {
            "comm/down_models",
            "comm/up_models",
            "comm/res_down_models",
            "comm/res_up_models",
        }
    )
    assert (flush["comm/down_models"], flush["comm/up_models"]) == (4.0, 2.0)  # 4 sent, a flush of 2
    assert (synced["comm/down_models"], synced["comm/up_models"]) == (2.0, 2.0)  # the root's two edges


def test_secure_aggregation_at_an_asynchronous_node_unmasks_each_flush_and_recovers_the_absent_children(tmp_path):
    """Every child of the node is in each flush's mask group; the K that arrived are its survivors, the others
    are recovered like dropouts from their Shamir shares. The same star as above (one update per child and
    flush): flush 1 = a1 (w 1, [1, 0]) and b1 (w 2, [2, 2]); flush 2 = a2 (w 3, s 1: [0, 2/sqrt2]) and a1
    (w 1, s 0, [1, 0]); example-weighted means, to the fixed point's 2**-24."""
    from bhfl_core.algorithm.privacy_params import SecAggParams
    from bhfl_core.algorithm.rule_registry import AggregateParams

    secagg = SecAggParams(threshold=2, mask_seed=7)
    tree = star(2, POLY)
    root = replace(tree.root, settings=replace(tree.root.settings, aggregate=AggregateParams(wrappers=(secagg,))))
    tree = Tree(nodes={**tree.nodes, "root": root}, root_id="root")
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    hooks = FakeChildren()
    result = execute_async_node(tree, tree.root, None, store, hooks, 0)
    theta1 = torch.tensor([5 / 3, 4 / 3], dtype=torch.float64)
    theta2 = theta1 + (3 * torch.tensor([0.0, 2 / math.sqrt(2)], dtype=torch.float64) + torch.tensor([1.0, 0.0])) / 4
    assert torch.allclose(result.theta.double(), theta2, atol=1e-6)
    assert [r["secagg/recovered_clients"] for r in hooks.rounds] == [1.0, 1.0]  # a2, then b1, not in the flush
