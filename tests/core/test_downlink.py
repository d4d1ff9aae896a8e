"""Compressed broadcasts (``downlink.py``): Double-Squeeze's server recursion, the engine's rebase, bytes, config.

Engine tree (tests/core/fake_tree.py): root -> A(a1 w=1, a2 w=3), B(b1 w=2, b2 w=2); TRAIN
adds a1=[1,0], a2=[0,2], b1=[2,2], b2=[4,0], root=[0,-1]; here the root broadcasts the
top 1 of its 2 values (``topk``, fraction 0.5).
"""

import itertools
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from bhfl_core.algorithm.compression import CompressParams, NonFiniteUpdate, decode, encode
from bhfl_core.algorithm.downlink import broadcast
from bhfl_core.algorithm.engine import execute_node
from bhfl_core.algorithm.node_state import Caller, NodeResult, NodeState, RoundKey
from bhfl_core.algorithm.tree import Tree
from bhfl_core.rng import sample_cohort
from bhfl_core.store.node_store import StateStore
from tests.core.fake_tree import STEPS, AddVectorHooks, settings, two_edge_tree
from tests.small import embedded_tree

TOP1 = CompressParams("topk", fraction=0.5)
KEY = RoundKey("root", 1, Caller())  # the run calls the root


def test_a_broadcast_is_double_squeezes_server_step_written_on_models():
    """Tang et al. 2019, Alg. 1: v_t = C(g_t + delta_{t-1}), delta_t = g_t + delta_{t-1} - v_t, workers add v_t;
    here g_t is the server model's change, and the children's model is x_hat."""
    gen = torch.Generator().manual_seed(0)
    params = CompressParams("topk", fraction=0.2)
    thetas = [torch.randn(50, generator=gen) for _ in range(6)]
    x_hat, delta = thetas[0].clone(), torch.zeros(50)  # the first broadcast is the model itself
    reference = broadcast(thetas[0], None, params, 0, KEY)
    assert torch.equal(reference.model, thetas[0]) and reference.payload_bytes is None and reference.error() == 0
    for before, theta in itertools.pairwise(thetas):
        v = decode(encode(theta - before + delta, params, 0), 50, params)  # the paper's recursion, by hand
        delta, x_hat = theta - before + delta - v, x_hat + v
        reference = broadcast(theta, reference.model, params, 0, KEY)
        assert torch.allclose(reference.model, x_hat, atol=1e-6) and torch.allclose(reference.delta, delta, atol=1e-6)
        assert torch.allclose(reference.model + reference.delta, theta, atol=1e-6)  # nothing left out is lost
        assert reference.payload_bytes == 10 * 8 and 0 < reference.error() < 1


def test_a_diverged_server_model_is_refused_naming_the_server_and_round():
    with pytest.raises(NonFiniteUpdate, match=r"root: its model to broadcast in round 1 .* 1 non-finite values of 3"):
        broadcast(torch.tensor([1.0, float("nan"), 0.0]), torch.zeros(3), TOP1, 0, KEY)


def _tree(root_downlink: CompressParams | None, proxy_async: bool = False, **client) -> Tree:
    tree = two_edge_tree(settings(train=True, **client), root_rounds=3)
    root = replace(tree.root.settings, downlink=root_downlink, proxy_async=proxy_async)
    tree.nodes["root"] = replace(tree.root, settings=root)  # type: ignore[index]
    return tree


def _run(tmp_path: Path, tree: Tree, hooks_class: type[AddVectorHooks] = AddVectorHooks):
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    hooks = hooks_class(tree, store)
    execute_node(tree, tree.root, None, store, hooks, seed=0)
    return store, hooks


class WithProxy(AddVectorHooks):
    """A root whose proxy TRAIN (adding STEPS["root"] on 2 rows) runs alongside its children."""

    def start_train(self, node, theta, key):
        return Done(NodeResult(theta + torch.tensor(STEPS[node.id]), loss=0.5, examples=2, steps=1))


@dataclass
class Done:
    trained: NodeResult

    def result(self) -> NodeResult:
        return self.trained


@pytest.mark.parametrize("proxy_async", [False, True])
def test_the_root_applies_its_childrens_updates_to_its_own_model_not_to_the_compressed_copy(tmp_path, proxy_async):
    """TRAIN adds a fixed step, so every update is the same wherever a child starts: folded against x_hat and
    rebased by delta, the root's model is the uncompressed run's, while the edges' (trained from x_hat) are not."""
    compressed, hooks = _run(tmp_path / "c", _tree(TOP1, proxy_async), WithProxy)
    plain, _ = _run(tmp_path / "p", _tree(None, proxy_async), WithProxy)
    assert torch.equal(compressed.load_model("root"), plain.load_model("root"))
    assert hooks.metrics[("root", 0)]["comm/down_error"] == 0.0 and hooks.metrics[("root", 1)]["comm/down_error"] > 0
    if proxy_async:
        return
    # by hand: each round moves the root by [1.625, 0.25]; round 0 sends [0, 0] whole; round 1 the top 1 of
    # [1.625, 0.25] (x_hat [1.625, 0], delta [0, 0.25]); round 2 the top 1 of [3.25, 0.5] - x_hat = [1.625, 0.5]
    root = compressed.load("root")
    assert root.down_ref is not None and root.down_ref.tolist() == [3.25, 0.0]  # delta_2 = [0, 0.5]
    assert (compressed.load_model("A") - plain.load_model("A")).tolist() == [0.0, -0.5]  # trained from x_hat_2


def test_a_child_holding_the_last_broadcast_gets_the_payload_and_any_other_the_whole_model(tmp_path):
    int8 = CompressParams("int8", block=2)  # a payload: 2 values + 1 scale = 6 bytes; a model: 8
    tree = _tree(int8)
    tree.nodes["root"] = replace(tree.root, settings=replace(tree.root.settings, cohort=1))  # type: ignore[index]
    _, hooks = _run(tmp_path, tree)
    called = [sample_cohort(["A", "B"], 1, 0, "root", r) for r in range(3)]
    assert called == [["A"], ["B"], ["B"]]  # seed 0: B misses round 0's broadcast, then holds round 1's
    assert [hooks.metrics[("root", r)]["comm/down_bytes"] for r in range(3)] == [8.0, 8.0, 6.0]


def test_a_child_that_keeps_no_state_gets_the_whole_model_every_round(tmp_path):
    tree = _tree(CompressParams("int8", block=2))
    edge = replace(tree["A"].settings, downlink=CompressParams("int8", block=2))
    tree.nodes["A"] = replace(tree["A"], settings=edge)  # type: ignore[index]
    for client in ("a1", "a2"):
        tree.nodes[client] = replace(tree[client], settings=replace(tree[client].settings, persistent=False))  # type: ignore[index]
    _, hooks = _run(tmp_path, tree)
    assert [hooks.metrics[("A", r)]["comm/down_bytes"] for r in range(3)] == [16.0] * 3  # 2 clients x 8 bytes
    assert [hooks.metrics[("root", r)]["comm/down_bytes"] for r in range(3)] == [16.0, 12.0, 12.0]  # A and B hold it


def test_a_resumed_server_sends_the_same_broadcast(tmp_path):
    """The reference is node state: a root re-run from its committed rounds continues with it, bit for bit."""
    tree = _tree(CompressParams("int8", block=2))
    whole, _ = _run(tmp_path / "whole", tree)
    short = replace(tree.root, settings=replace(tree.root.settings, rounds=2))
    store = StateStore(tmp_path / "resumed")
    store.save("root", NodeState(model=torch.zeros(2)))
    hooks = AddVectorHooks(tree, store)
    execute_node(Tree({**tree.nodes, "root": short}, "root"), short, None, store, hooks, seed=0)  # stops after 2
    assert store.load("root").down_ref is not None
    execute_node(tree, tree.root, None, store, hooks, seed=0)  # the same caller: continues with round 3
    assert torch.equal(store.load_model("root"), whole.load_model("root"))
    assert torch.equal(store.load("root").down_ref, whole.load("root").down_ref)  # type: ignore[arg-type]


def test_compress_down_reaches_the_servers_it_is_set_at():
    tree = embedded_tree("tree.root.compress_down={kind: int8, block: 64}", "tree.edge.compress_down.kind=topk")
    assert tree.root.settings.downlink == CompressParams("int8", block=64)
    assert tree["edge-en"].settings.downlink == CompressParams("topk", fraction=0.01)
    assert all(tree[s].settings.downlink is None for s in tree.root.children)  # the intermediate servers
    assert all(tree[c].settings.downlink is None for c in tree["edge-en"].children)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["tree.client.compress_down={kind: int8}"], "tree.client.compress_down: compressed broadcasts are set at the"),
        (["tree.edge.compress_down={kind: int8}", "tree.edge.mode=async"], "tree.edge.compress_down: 'edge-"),
        (
            ["tree.root.compress_down={kind: int8}", "model.adapter={r: 4, aggregation: exact}"],
            "tree.root.compress_down: model.adapter.aggregation: exact",
        ),
        (["tree.root.compress_down={kind: int8, error_feedback: false}"], "tree.root.compress_down.error_feedback"),
        (["tree.root.compress_down={kind: topk, fraction: 2}"], "tree.root.compress_down.fraction"),
        (["tree.edge.compress_down={kind: topk, fraction: 0.6}"], "tree.edge.compress_down.fraction: 0.6 keeps"),
    ],
)
def test_bad_compress_down_settings_are_refused_naming_the_key(overrides, message):
    from bhfl_core.config.base import ConfigError

    with pytest.raises(ConfigError) as err:
        embedded_tree(*overrides)
    assert message in str(err.value)


def test_each_server_round_and_caller_draws_its_own_rounding_for_the_same_change():
    from bhfl_core.algorithm.engine import down_broadcast

    tree = _tree(CompressParams("int8", block=64))
    theta, state = torch.linspace(-1, 1, 64), NodeState(model=torch.linspace(-1, 1, 64), down_ref=torch.zeros(64))
    keys = [KEY, replace(KEY, round=2), replace(KEY, node_id="A"), replace(KEY, caller=Caller("adapt"))]
    sent = [down_broadcast(replace(tree.root, id=k.node_id), [tree["A"]], state, k, seed=0) for k in keys]
    models = [s.model for s in sent if s is not None]
    assert len(models) == 4 and torch.allclose(models[0], theta, atol=1 / 127)
    assert all(not torch.equal(a, b) for a, b in itertools.combinations(models, 2))
    again = down_broadcast(tree.root, [tree["A"]], state, KEY, seed=0)
    assert again is not None and torch.equal(again.model, models[0])  # seeded: the same draws again
