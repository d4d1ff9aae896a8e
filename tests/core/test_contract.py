"""The parent-child contract: rules registered like NODEOPTs, one fold for every child, plans that carry Tempo.

Hand-computed numbers on the fake tree of test_engine.py (root -> A(a1 w=1, a2 w=3),
B(b1 w=2, b2 w=2); TRAIN adds a known vector).
"""

from dataclasses import replace

import pytest
import torch

from bhfl_core.algorithm import rule_registry
from bhfl_core.algorithm.aggregation_rule import MeanRule, fold_results
from bhfl_core.algorithm.asynchrony import stale_model
from bhfl_core.algorithm.contract import ChildResult, MemberLoss, RoundPlan
from bhfl_core.algorithm.engine import execute_node, proxy_child
from bhfl_core.algorithm.node_state import Caller, NodeResult, NodeState, RoundKey
from bhfl_core.algorithm.privacy_params import PrivacyParams
from bhfl_core.algorithm.residuals import Candidate
from bhfl_core.algorithm.rule_registry import AggregateParams, register_rule
from bhfl_core.algorithm.rules import available_rules, rule_for
from bhfl_core.algorithm.tempo import omega, tempo_epochs
from bhfl_core.algorithm.tree import Tree
from bhfl_core.config.base import ConfigError
from bhfl_core.config.loader import load_config
from bhfl_core.store.node_store import StateStore
from tests.core.fake_tree import AddVectorHooks, settings, two_edge_tree
from tests.small import REPO

KEY = RoundKey("A", 0)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


@pytest.fixture
def halving_rule():
    """A rule registered for one test: the mean, halved (so its use is visible in the models)."""

    @register_rule("halved_mean")
    class Halved(MeanRule):
        def mean_input(self, partial, key):
            self.seen = key
            return super().mean_input(partial, key) / 2

    yield "halved_mean"
    del rule_registry._RULES["halved_mean"], rule_registry._TRAITS["halved_mean"]


def test_rules_are_looked_up_by_name_and_unknown_ones_are_config_errors(halving_rule):
    assert "mean" in available_rules() and halving_rule in available_rules()
    assert isinstance(rule_for(AggregateParams()), MeanRule)
    with pytest.raises(ValueError, match="unknown aggregation rule 'geomedian'"):
        rule_for(AggregateParams("geomedian"))
    with pytest.raises(ValueError, match="already registered"):
        register_rule("mean")(MeanRule)
    cfg = load_config(REPO / "configs" / "embedded.yaml", ["tree.edge.aggregate={kind: halved_mean}"])
    assert cfg.tree.edge.aggregate.kind == halving_rule
    with pytest.raises(ConfigError, match=r"unknown aggregation rule 'geomedian'.*mean"):
        load_config(REPO / "configs" / "embedded.yaml", ["tree.root.aggregate={kind: geomedian}"])


def test_the_engine_folds_children_with_the_nodes_rule(tmp_path, halving_rule):
    # edges aggregate with the halved mean: A = (1*[1,0] + 3*[0,2]) / 4 / 2 = [0.125, 0.75]; B = [1.5, 0.5];
    # the root keeps the mean: ([0.125, 0.75] + [1.5, 0.5]) / 2 = [0.8125, 0.625], then its TRAIN adds [0, -1]
    tree = two_edge_tree(settings(train=True))
    nodes = dict(tree.nodes)
    for edge in ("A", "B"):
        nodes[edge] = replace(
            nodes[edge], settings=replace(nodes[edge].settings, aggregate=AggregateParams("halved_mean"))
        )
    tree = Tree(nodes, "root")
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    execute_node(tree, tree.root, None, store, AddVectorHooks(tree, store), seed=0)
    assert store.load_model("A").tolist() == [0.125, 0.75] and store.load_model("B").tolist() == [1.5, 0.5]
    assert store.load_model("root").tolist() == [0.8125, -0.375]


def test_fold_results_is_one_order_whatever_the_batching():
    """Two worker batches and a child server, in any order and grouping: the same fold, bit for bit."""
    rule = MeanRule(AggregateParams())
    g = torch.Generator().manual_seed(0)
    models = {m: torch.randn(1000, generator=g) for m in ("c1", "c2", "c3", "s1")}
    weights = {"c1": 3.0, "c2": 5.0, "c3": 7.0, "s1": 11.0}
    losses = {"c1": 0.1, "c2": 0.7, "c3": 0.3}

    def batch(*members: str, dropped: tuple[str, ...] = ()) -> ChildResult:
        partial = rule.start(Caller("A", 0))
        for m in members:
            rule.contribute(partial, m, models[m], weights[m])
        candidates = tuple(Candidate(m, models[m], weights[m], losses[m]) for m in members)
        member_losses = tuple(MemberLoss(m, losses[m], int(weights[m])) for m in members)
        return ChildResult(
            members=members, partial=partial, losses=member_losses, candidates=candidates, dropped=dropped
        )

    server = ChildResult(
        members=("s1",), model=models["s1"], weight=weights["s1"], losses=(MemberLoss("s1", 0.5, 4),), virtual_s=9.0
    )
    own = proxy_child(replace(two_edge_tree(settings()).root, id="A"), NodeResult(torch.ones(1000), 0.9, 6, steps=2))
    order = ["c2", "c3", "c1", "c4", "s1", "A"]  # the children: a float sum in this order differs in the last bit
    layouts = [
        [batch("c1", "c3"), batch("c2", dropped=("c4",)), server],
        [server, batch("c2", dropped=("c4",)), batch("c3", "c1")],
        [batch("c3"), batch("c2", "c1", dropped=("c4",)), server],
    ]
    folds = [fold_results(rule, KEY, results, order) for results in layouts]
    means = [rule.finalize(f.partial, KEY).input for f in folds]
    assert all(torch.equal(means[0], m) for m in means)
    exact = sum(weights[m] * models[m].double() for m in models) / sum(weights.values())
    assert torch.equal(means[0], exact.float())  # a float64 sum of 4 is exact to far below float32's rounding
    for f in folds:
        assert [c.node_id for c in f.candidates] == ["c2", "c3", "c1"] and f.dropped == ["c4"]  # in child order
        assert f.virtual_s == 9.0 and torch.equal(f.models["s1"], models["s1"])
        # the loss mean: per member, summed in id order (c1, c2, c3, s1), as before the contract, not in child order
        assert f.reported() == ((0.1 * 3 + 0.7 * 5 + 0.3 * 7 + 0.5 * 4) / 19, 19)
        assert f.reported()[0] != (0.7 * 5 + 0.3 * 7 + 0.1 * 3 + 0.5 * 4) / 19
    # the node's own proxy TRAIN folds like a child (weight: its rows) but its loss is not its children's
    fresh = [batch("c1", "c3"), batch("c2", dropped=("c4",)), server]  # a fold consumes the partials it merges
    with_own = fold_results(rule, KEY, [*fresh, own], order)
    assert with_own.reported() == folds[0].reported() and with_own.partial.weight == folds[0].partial.weight + 6
    assert own.virtual_s == 2.0 and own.weight == 6.0


def test_a_proxy_train_on_no_rows_cannot_be_a_child():
    with pytest.raises(RuntimeError, match="trained on no rows"):
        proxy_child(two_edge_tree(settings()).root, NodeResult(t(1.0), examples=0))


def test_async_buffers_fold_with_the_same_rule():
    # theta = [1, 1]; results: a (weight 1, staleness 0, y = [3, 1]), b (weight 3, staleness 3, from [0, 0], y = [0, 4])
    # poly a=0.5: w(0) = 1, w(3) = 1/2 -> stale models [3, 1] and [1, 1] + 0.5 ([0, 4] - [0, 0]) = [1, 3]
    # mean input = (1*[3, 1] + 3*[1, 3]) / 4 = [1.5, 2.5], as the by-hand flush of test_asynchrony.py
    theta = t(1.0, 1.0)
    fresh = stale_model(theta, t(3.0, 1.0), theta, 1.0)
    stale = stale_model(theta, t(0.0, 4.0), t(0.0, 0.0), 0.5)
    assert fresh.tolist() == [3.0, 1.0] and stale.tolist() == [1.0, 3.0]
    rule = MeanRule(AggregateParams())
    partial = rule.start(Caller("A", 0))
    rule.contribute(partial, "a", fresh, 1.0)
    rule.contribute(partial, "b", stale, 3.0)
    assert rule.finalize(partial, KEY).input.tolist() == [1.5, 2.5]


def test_a_fresh_result_is_its_model_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    theta, y = torch.randn(10_000, generator=g), torch.randn(10_000, generator=g) * 1e-3
    assert stale_model(theta, y, theta, 1.0) is y
    assert torch.equal(stale_model(theta, y, theta.clone(), 1.0), y)  # the float64 path is exact too


class PlanRecorder(AddVectorHooks):
    """Records the plan each client's TRAIN ran under."""

    def __init__(self, tree, store):
        super().__init__(tree, store)
        self.plans: dict[tuple[str, int], RoundPlan] = {}

    def train(self, node, theta, key, plan):
        self.plans[(node.id, key.caller.round or 0)] = plan
        return super().train(node, theta, key, plan)


def test_tempo_lives_in_the_roots_state_and_reaches_the_clients_in_their_plans(tmp_path):
    tree = two_edge_tree(settings(train=True), root_rounds=2)
    root = replace(tree.root, settings=replace(tree.root.settings, tempo=4))
    tree = Tree({**tree.nodes, "root": root}, "root")
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    hooks = PlanRecorder(tree, store)
    execute_node(tree, root, None, store, hooks, seed=0)
    # round 0: the edges send up A = [0.25, 1.5], B = [3, 1]; the root averages them and its TRAIN adds [0, -1]:
    # [1.625, 0.25]. omega_A = ||[-1.375, 1.25]|| = 1.858 > omega_B = ||[1.375, 0.75]|| = 1.566
    a, b, theta = t(0.25, 1.5), t(3.0, 1.0), t(1.625, 0.25)
    first = tempo_epochs({"A": omega(a, theta), "B": omega(b, theta)}, 4)
    assert first == {"A": 2, "B": 8}  # the edge farther from the root model trains ceil(c/2), the closer 2c
    assert hooks.plans[("a1", 0)].epochs is None  # round 0: the clients' own epochs (c)
    assert hooks.plans[("a1", 1)] == RoundPlan(Caller("A", 1), 2) and hooks.plans[("b2", 1)].epochs == 8
    assert hooks.metrics[("root", 0)]["tempo/epochs/A"] == 4.0 and hooks.metrics[("root", 1)]["tempo/epochs/A"] == 2.0
    # the schedule of the next round is committed with the root's last round
    saved = store.load("root")
    models = {e: store.load_model(e) for e in ("A", "B")}
    assert saved.child_epochs == tempo_epochs({e: omega(m, saved.theta) for e, m in models.items()}, 4)


def test_a_result_is_reported_up_from_the_saved_state(tmp_path):
    """A finished execution run again hands back what its caller first got: model, loss, examples, clock."""
    tree = two_edge_tree(settings(train=True))
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    hooks = AddVectorHooks(tree, store)
    plan = RoundPlan(Caller("root", 0))
    first = execute_node(tree, tree["A"], t(0.0, 0.0), store, hooks, 0, plan)
    again = execute_node(tree, tree["A"], t(9.0, 9.0), store, hooks, 0, plan)
    assert torch.equal(first.theta, again.theta) and (first.loss, first.examples) == (again.loss, again.examples)
    assert store.load("A").loss is None  # the fake TRAIN reports no loss, so the edge has none to report


def test_a_lazily_loaded_model_is_not_checked_until_read(tmp_path):
    """A client whose aggregation replaces its model maps it without reading it; a damaged byte there is
    found by whoever reads the model (evaluation, or an execution that mixes it in), not by the round loop."""
    from bhfl_core.store.node_store import CheckpointError

    store = StateStore(tmp_path)
    store.save("c", NodeState(model=torch.arange(1000.0), rounds_done=2))
    path = store.node_path("c")
    data = bytearray(path.read_bytes())
    data[-8] ^= 0xFF  # a byte of the model tensor (the file ends with it)
    path.write_bytes(bytes(data))
    assert store.load("c", lazy_model=True).rounds_done == 2
    with pytest.raises(CheckpointError, match="checksum mismatch in tensor 'model'"):
        store.load("c")
    with pytest.raises(CheckpointError):
        store.load_model("c")


def test_a_client_keeps_state_only_where_something_reads_it_again(tmp_path):
    """Persistent clients whose next round replaces their model, and that nobody evaluates, write nothing."""
    from bhfl_core.algorithm.node_step import keeps_state

    unevaluated = replace(settings(train=True), evaluated=False)
    mixing = replace(unevaluated, opt_down=replace(unevaluated.opt_down, eta=0.5))
    assert keeps_state(settings(train=True), is_leaf=True)  # evaluation scores the saved model
    assert not keeps_state(unevaluated, is_leaf=True) and keeps_state(unevaluated, is_leaf=False)
    assert keeps_state(mixing, is_leaf=True)  # its next execution mixes its own model in
    assert not keeps_state(replace(mixing, persistent=False), is_leaf=True)
    runs = {}
    for name, client in (("replaced", unevaluated), ("mixing", mixing)):
        tree = two_edge_tree(client, root_rounds=2)
        store = StateStore(tmp_path / name)
        store.save("root", NodeState(model=torch.zeros(2)))
        execute_node(tree, tree.root, None, store, AddVectorHooks(tree, store), seed=0)
        runs[name] = store
    assert not runs["replaced"].has("a1") and runs["mixing"].has("a1")
    # replaced every round, the clients' saved models never mattered: the root is FedAvg's
    plain = StateStore(tmp_path / "plain")
    plain.save("root", NodeState(model=torch.zeros(2)))
    tree = two_edge_tree(settings(train=True), root_rounds=2)
    execute_node(tree, tree.root, None, plain, AddVectorHooks(tree, plain), seed=0)
    assert torch.equal(runs["replaced"].load_model("root"), plain.load_model("root"))


def test_a_whole_round_closed_where_it_was_folded_finalizes_to_the_same_bits():
    """One batch that is the whole round: its worker closes the fold (4 bytes per parameter, the mean), the parent
    takes it over; the round's mean_input is bit for bit the one the parent would compute from the open sum."""
    rule = MeanRule(AggregateParams())
    g = torch.Generator().manual_seed(1)
    models = [torch.randn(5000, generator=g) * 10.0 ** torch.randint(-8, 8, (5000,), generator=g) for _ in range(3)]
    weights = [3.0, 5.0, 7.0]

    def batch() -> ChildResult:
        partial = rule.start(Caller("A", 0))
        for i, (m, w) in enumerate(zip(models, weights)):
            rule.contribute(partial, f"c{i}", m, w)
        return ChildResult(members=("c0", "c1", "c2"), partial=partial)

    opened, closed = batch(), batch()
    assert rule.close(closed.partial) and set(rule.wire(closed.partial)[0]) == {"mean"}
    tensors, numbers = rule.wire(closed.partial)
    assert tensors["mean"].dtype == torch.float32 and numbers == {"weight": 15.0}
    received = replace(closed, partial=rule.unwire(tensors, numbers))  # what the parent maps back
    expected = rule.finalize(fold_results(rule, KEY, [opened], ["c0", "c1", "c2", "A"]).partial, KEY).input
    folded = fold_results(rule, KEY, [received], ["c0", "c1", "c2", "A"])
    assert folded.partial.weight == 15.0 and torch.equal(rule.finalize(folded.partial, KEY).input, expected)
    exact = sum(w * m.double() for m, w in zip(models, weights)) / 15.0
    assert (rule.finalize(folded.partial, KEY).input != exact.float()).sum() <= 1  # within float64's own rounding here
    # a closed fold is the whole round: nothing joins it, and it joins nothing
    with pytest.raises(ValueError, match="closed sum"):
        rule.contribute(folded.partial, "c3", models[0], 1.0)
    with pytest.raises(ValueError, match="closed sum"):
        fold_results(rule, KEY, [batch(), replace(closed, partial=rule.unwire(tensors, numbers))], ["c0", "A"])
    # DP finalizes at the server (its noise is the server's): it never closes
    dp = rule_for(
        AggregateParams(
            wrappers=(PrivacyParams(clip=1.0, noise_multiplier=1.0, expected=3, population=3, noise_seed=0),)
        )
    )
    partial = dp.start(Caller("A", 0), dp.plan({}, ()), torch.zeros(3))
    dp.contribute(partial, "c0", torch.ones(3), 1.0)
    assert not dp.close(partial) and "mean" not in dp.wire(partial)[0]
