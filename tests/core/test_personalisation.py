"""APFL-style interpolation (NODEOPT ``interp``), held-out rows, and Ditto's personal model."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bhfl_core.algorithm.aggregation import WeightedSum
from bhfl_core.algorithm.aggregation_rule import FoldedRound
from bhfl_core.algorithm.engine import execute_node
from bhfl_core.algorithm.node_opt import NodeOptParams, is_tuned, node_opt_step
from bhfl_core.algorithm.node_state import Caller, NodeState, RoundKey
from bhfl_core.algorithm.node_step import node_down, node_up
from bhfl_core.algorithm.tree import NodeSettings, TrainParams
from bhfl_core.config.base import ConfigError
from bhfl_core.config.loader import load_config
from bhfl_core.config.topology import build_tree, placeholder_clients
from bhfl_core.learning.local_train import held_out_loss, split_holdout, train_model
from bhfl_core.store.node_store import StateStore
from tests.core.fake_tree import STEPS, AddVectorHooks, settings, two_edge_tree
from tests.core.test_fedprox import CPU, Scalar

REPO = Path(__file__).resolve().parents[2]
GRID = (0.0, 0.25, 0.5, 0.75, 1.0)
INTERP = NodeOptParams(kind="interp", alphas=GRID)


def distance_to(target):
    """A scorer: squared distance of each candidate to ``target`` (the held-out optimum)."""
    t = torch.tensor(target)
    return lambda candidates: [float(((c - t) ** 2).sum()) for c in candidates]


# ---------------------------------------------------------------- the interp step


def test_interp_keeps_the_grid_point_with_the_lowest_held_out_loss():
    # own theta [0, 0], input [4, 2]: candidates alpha*own + (1-alpha)*input =
    #   a=0 [4, 2], .25 [3, 1.5], .5 [2, 1], .75 [1, .5], 1 [0, 0]
    # squared distance to [1, 1]: 10, 4.25, 1, 0.25, 2 -> alpha 0.75, theta [1, 0.5]
    state, theta = node_opt_step({}, torch.zeros(2), torch.tensor([4.0, 2.0]), INTERP, distance_to([1.0, 1.0]))
    assert theta.tolist() == [1.0, 0.5]
    assert state["alpha"].item() == 0.75
    state, _ = node_opt_step(state, theta, torch.tensor([4.0, 2.0]), INTERP, distance_to([1.0, 1.0]))
    assert state["step"].item() == 2  # its own step count, like every NODEOPT


def test_interp_is_exact_at_both_ends_of_the_grid():
    own, other = torch.tensor([0.1, 0.7, -3.3]), torch.tensor([1e-3, 2.9, 0.3])
    _, adopt = node_opt_step({}, own, other, INTERP, distance_to(other.tolist()))
    _, keep = node_opt_step({}, own, other, INTERP, distance_to(own.tolist()))
    assert torch.equal(adopt, other)  # alpha 0: the input bit for bit
    assert torch.equal(keep, own)  # alpha 1: the own model bit for bit


def test_interp_ties_and_nan_losses_go_to_the_first_grid_point_and_it_needs_a_scorer():
    own, other = torch.zeros(2), torch.ones(2)
    state, theta = node_opt_step({}, own, other, replace(INTERP, alphas=(0.5, 1.0)), lambda c: [1.0, 1.0])
    assert state["alpha"].item() == 0.5
    assert theta.tolist() == [0.5, 0.5]
    state, _ = node_opt_step({}, own, other, INTERP, lambda c: [float("nan")] * 4 + [3.0])
    assert state["alpha"].item() == 1.0  # NaN ranks last
    with pytest.raises(ValueError, match="held-out data"):
        node_opt_step({}, own, other, INTERP)
    assert is_tuned("interp") and not is_tuned("fedadam")


def test_node_down_and_node_up_pass_the_scorer_to_interp():
    node_settings = NodeSettings(opt_down=INTERP, opt_up=INTERP, holdout=0.2)
    # down: own W = [2, 0], phi = [0, 2]; candidates a=0 [0,2], .25 [.5,1.5], .5 [1,1], .75 [1.5,.5], 1 [2,0]
    # distance to [1.5, 0.5]: 4.5, 2, 0.5, 0, 0.5 -> alpha 0.75
    stored = NodeState(model=torch.tensor([2.0, 0.0]))
    down, _ = node_down(stored, torch.tensor([0.0, 2.0]), {}, node_settings, Caller("p", 0), distance_to([1.5, 0.5]))
    assert down.theta.tolist() == [1.5, 0.5]
    assert down.opt_down["alpha"].item() == 0.75
    # up: theta [1.5, 0.5], children's mean [3.5, 0.5]: a=0 [3.5,.5] .25 [3,.5] .5 [2.5,.5] .75 [2,.5] 1 [1.5,.5]
    # distance to [3, 0.5]: 0.25, 0, 0.25, 1, 2.25 -> alpha 0.25
    report = FoldedRound(WeightedSum(), [], {}, [])
    report.partial.add(torch.tensor([3.5, 0.5]), 2.0)
    up, posts, _ = node_up(down, report, {}, node_settings, RoundKey("p", 0), distance_to([3.0, 0.5]))
    assert up.theta.tolist() == [3.0, 0.5]
    assert up.opt_up["alpha"].item() == 0.25 and posts == []


def test_the_engine_tunes_each_client_every_round_and_logs_alpha(tmp_path):
    client = replace(settings(train=True), opt_down=INTERP, holdout=0.2)
    tree = two_edge_tree(client, root_rounds=2, root_train=False)
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    hooks = AddVectorHooks(tree, store)
    seen: list[tuple[str, list[torch.Tensor]]] = []
    score = hooks.score
    hooks.score = lambda node, candidates: (seen.append((node.id, list(candidates))), score(node, candidates))[1]
    execute_node(tree, tree.root, None, store, hooks, seed=0)
    # round 0: every client adopts phi (no model yet: nothing to tune); round 1: each tunes once
    assert sorted(node for node, _ in seen) == ["a1", "a2", "b1", "b2"]
    for node, candidates in seen:
        metrics = hooks.metrics[(node, 1)]
        alpha = metrics["opt/alpha_down"]
        losses = score(tree[node], candidates)
        assert alpha == GRID[losses.index(min(losses))]  # the grid point with the lowest held-out loss
        assert "opt/alpha_down" not in hooks.metrics[(node, 0)]
        final = store.load(node)
        # the saved model is the chosen candidate, then TRAIN (AddVectorHooks adds STEPS)
        assert torch.equal(final.theta - torch.tensor(STEPS[node]), candidates[GRID.index(alpha)])


# ---------------------------------------------------------------- held-out rows


def test_split_holdout_keeps_a_fixed_disjoint_share_in_order():
    data = {"x": torch.arange(10).float(), "labels": torch.arange(10)}
    kept, held = split_holdout(data, 0.2, seed=7)
    assert len(held["labels"]) == 2 and len(kept["labels"]) == 8
    assert sorted(kept["labels"].tolist() + held["labels"].tolist()) == list(range(10))
    assert kept["labels"].tolist() == sorted(kept["labels"].tolist())  # original order kept
    assert torch.equal(kept["x"], kept["labels"].float())  # rows stay aligned across columns
    _, held_again = split_holdout(data, 0.2, seed=7)
    assert torch.equal(held_again["labels"], held["labels"])  # same rows every round
    assert len(split_holdout(data, 0.01, seed=7)[1]["labels"]) == 1  # at least one row
    assert len(split_holdout(data, 0.0, seed=7)[1]["labels"]) == 0
    one = {"x": torch.ones(1), "labels": torch.zeros(1)}
    assert len(split_holdout(one, 0.5, seed=7)[0]["labels"]) == 1  # a single row is never held out


def test_held_out_loss_is_the_row_weighted_mean_loss():
    # loss = mean((w x - y)^2); w = 2, x = 1, y = [0, 1, 3]: squared errors 4, 1, 1 -> mean 2
    data = {"x": torch.ones(3, 1), "labels": torch.tensor([0.0, 1.0, 3.0])}
    assert held_out_loss(Scalar(2.0), data, batch_size=2, device=CPU, seed=0) == 2.0
    assert torch.isnan(torch.tensor(held_out_loss(Scalar(2.0), {"x": torch.ones(0, 1)}, 2, CPU, 0)))


# ---------------------------------------------------------------- Ditto


def test_ditto_proximal_term_pulls_towards_the_given_anchor():
    # personal model w0 = 2 (and an unused weight u = 3), anchor (the received model) w = 1, u = 5,
    # lr 0.25, lambda 0.5, two SGD steps of one row (x = 1, y = 0): loss gradient 2 w
    # step 1: g = 4 + 0.5 (2 - 1) = 4.5 -> 0.875;  step 2: g = 1.75 + 0.5 (0.875 - 1) = 1.6875 -> 0.453125
    # u: step 1: g = 0.5 (3 - 5) = -1 -> 3.25;  step 2: g = 0.5 (3.25 - 5) = -0.875 -> 3.46875
    model = Scalar(2.0)
    params = TrainParams(lr=0.25, epochs=1, batch_size=1, optimizer="sgd", mu=0.5)
    data = {"x": torch.ones(2, 1), "labels": torch.zeros(2)}
    train_model(model, data, params, seed=0, device=CPU, anchor=torch.tensor([1.0, 5.0]))
    assert model.w.item() == 0.453125
    assert model.unused.item() == 3.46875


class RecordingHooks(AddVectorHooks):
    def __init__(self, tree, store):
        super().__init__(tree, store)
        self.personal_calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def train_personal(self, node, personal, anchor, key):
        self.personal_calls.append((node.id, personal.clone(), anchor.clone()))
        return super().train_personal(node, personal, anchor, key)


def test_ditto_clients_keep_a_personal_model_beside_the_one_they_send_up(tmp_path):
    client = replace(settings(train=True, persistent=False), personal=TrainParams(mu=0.1))
    tree = two_edge_tree(client, root_rounds=2, root_train=False)
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    hooks = RecordingHooks(tree, store)
    plain = StateStore(tmp_path / "plain")
    plain.save("root", NodeState(model=torch.zeros(2)))
    plain_tree = two_edge_tree(settings(train=True, persistent=False), root_rounds=2, root_train=False)
    execute_node(plain_tree, plain_tree.root, None, plain, AddVectorHooks(plain_tree, plain), seed=0)
    execute_node(tree, tree.root, None, store, hooks, seed=0)
    # the federated models do not see the personal ones: same root as plain FedAvg
    assert torch.equal(store.load("root").theta, plain.load("root").theta)
    calls = [c for c in hooks.personal_calls if c[0] == "a1"]
    assert len(calls) == 2
    (_, v0, anchor0), (_, v1, anchor1) = calls
    assert torch.equal(v0, anchor0)  # first round: v starts from the received model
    # the fake TRAIN: v + 0.5 (anchor - v) + STEPS; round 2 continues from round 1's v (non-persistent client!)
    assert torch.equal(v1, v0 + 0.5 * (anchor0 - v0) + torch.tensor(STEPS["a1"]))
    want = v1 + 0.5 * (anchor1 - v1) + torch.tensor(STEPS["a1"])
    assert torch.equal(store.load("a1").personal, want)
    assert torch.equal(store.load_model("a1", personal=True), want)
    assert "personal/loss" in hooks.metrics[("a1", 1)]


def test_ditto_pulls_the_personal_model_towards_the_model_the_client_received(tmp_path):
    """Li et al. 2021: v_k is pulled towards w^t, the model the client received this round, not v_k's own start.

    The expected models are worked out by hand from the tree, not from what the engine hands
    its hooks. fake_tree.py: TRAIN adds STEPS[node]; the Ditto TRAIN is v + 0.5 (anchor - v) + STEPS[node].
    Persistent clients with eta_down 1 adopt what their edge sends; edges and root average (FedAvg).

    root round 0: every client receives [0, 0] and starts v there: v_a1 = [1, 0], v_a2 = [0, 2];
      models sent up: a1 [1, 0] (weight 1), a2 [0, 2] (3), b1 [2, 2] (2), b2 [4, 0] (2)
      edge A = (1 [1, 0] + 3 [0, 2]) / 4 = [0.25, 1.5]; B = [3, 1]; root = ([0.25, 1.5] + [3, 1]) / 2 = [1.625, 1.25]
    root round 1: a1 and a2 receive [1.625, 1.25]:
      v_a1 = [1, 0] + 0.5 ([1.625, 1.25] - [1, 0]) + [1, 0] = [2.3125, 0.625]
      v_a2 = [0, 2] + 0.5 ([1.625, 1.25] - [0, 2]) + [0, 2] = [0.8125, 3.625]
    Anchored to v's own start instead, the pull vanishes: [2, 0] and [0, 4].
    """
    client = replace(settings(train=True), personal=TrainParams(mu=0.1))
    tree = two_edge_tree(client, root_rounds=2, root_train=False)
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    execute_node(tree, tree.root, None, store, AddVectorHooks(tree, store), seed=0)
    assert store.load_model("root").tolist() == [3.25, 2.5]  # each root round adds the mean step [1.625, 1.25]
    assert store.load_model("a1", personal=True).tolist() == [2.3125, 0.625]
    assert store.load_model("a2", personal=True).tolist() == [0.8125, 3.625]


# ---------------------------------------------------------------- config


def _tree(overrides):
    cfg = load_config(REPO / "configs" / "embedded.yaml", overrides)
    return build_tree(cfg, placeholder_clients(cfg))


def test_interp_and_ditto_reach_the_nodes_from_the_config():
    tree = _tree(
        [
            "tree.client.opt_down={kind: interp, alphas: [0.0, 0.5, 1.0]}",
            "tree.client.holdout=0.25",
            "tree.client.personal={mu: 0.3, lr: 0.01}",
            "tree.edge.eta_down=0",
        ]
    )
    client = tree.clients()[0]
    assert client.settings.opt_down.kind == "interp" and client.settings.opt_down.alphas == (0.0, 0.5, 1.0)
    assert client.settings.holdout == 0.25 and client.settings.tunes
    assert client.settings.personal == TrainParams(lr=0.01, mu=0.3)
    edge = tree[client.parent]
    assert edge.settings.opt_down.eta == 0.0 and not edge.settings.tunes
    root = _tree(["tree.root.opt_up={kind: interp}", "tree.root.holdout=0.1"]).root  # the root holds the proxy
    assert root.settings.tunes


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["tree.client.opt_down={kind: interp}"], r"tree\.client\.opt_down: .*set tree\.client\.holdout"),
        (["tree.edge.opt_up={kind: interp}", "tree.edge.holdout=0.2"], r"tree\.edge\.opt_up: .*has none"),
        (["tree.edge.personal={mu: 0.1}"], r"tree\.edge\.personal: only clients"),
        (["tree.client.opt_down={kind: interp, alphas: []}"], r"alphas"),
        (["tree.client.opt_down={kind: interp, alphas: [1.5]}"], r"alphas"),
        (["tree.client.holdout=0.9"], r"tree\.client\.holdout"),
        (  # interp picks alpha itself: an eta beside it would be read by nothing
            ["tree.client.opt_down={kind: interp}", "tree.client.holdout=0.2", "tree.nodes.en-01.eta_down=0.5"],
            r"tree\.nodes\.en-01\.eta_down: 0\.5 would not be read: the opt_down of 'en-01' \(tree\.client\.opt_",
        ),
        (
            [
                "data.proxy.servers=[root, edge]",
                "tree.edge.holdout=0.2",
                "tree.edge.opt_down={kind: interp}",
                "tree.residuals={down: [{from: root, to: edge, eta: 0.3}]}",
            ],
            r"tree\.residuals\.down\[0\]\.eta: 0\.3 would not be read: the residual is folded at 'edge-\w+' by interp",
        ),
    ],
)
def test_bad_interp_and_ditto_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _tree(overrides)
