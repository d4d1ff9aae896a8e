"""What crosses a DP server, pinned through the engine (issue 46, item 7): which children are clipped, and how the
rounds of a DP server compose over its executions; and which training losses reach a secure-aggregation server.

The tree is ``fake_tree``'s (root -> A(a1, a2), B(b1, b2); TRAIN adds a known vector), so every model is known by
hand; the other information-flow classes are pinned where they are made (docs/privacy.md, "What the tests pin").
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from bhfl_core.algorithm.contract import MemberLoss
from bhfl_core.algorithm.engine import execute_node
from bhfl_core.algorithm.node_state import NodeResult, NodeState
from bhfl_core.algorithm.privacy import SHRINK
from bhfl_core.algorithm.privacy_accounting import epsilon
from bhfl_core.algorithm.privacy_params import AdaptiveClip, PrivacyParams
from bhfl_core.algorithm.rule_registry import AggregateParams
from bhfl_core.algorithm.rules import rule_for
from bhfl_core.algorithm.tree import Tree
from bhfl_core.rng import derive_seed
from bhfl_core.store.node_store import StateStore
from tests.core.fake_tree import AddVectorHooks, settings, two_edge_tree


def _with_dp(tree: Tree, node_id: str, dp: PrivacyParams) -> Tree:
    node = tree[node_id]
    node = replace(node, settings=replace(node.settings, aggregate=AggregateParams(wrappers=(dp,))))
    return Tree(nodes={**tree.nodes, node_id: node}, root_id=tree.root_id)


class LossHooks(AddVectorHooks):
    """``AddVectorHooks`` whose TRAIN reports a loss (the step's first value) on its rows, and whose children's
    results carry them up, as the real hooks do (``MemberLoss``)."""

    def train(self, node, theta, key, plan):
        step = super().train(node, theta, key, plan)
        return NodeResult(step.theta, loss=float(step.theta[0]), examples=int(node.weight))

    def run_children(self, node, cohort, theta, plans):
        results = super().run_children(node, cohort, theta, plans)
        out = []
        for child, result in zip(cohort, results, strict=True):
            state = self.store.load_header(child.id)
            losses = (MemberLoss(child.id, state.loss, state.examples),) if state.examples else ()
            out.append(replace(result, losses=losses))
        return out


def _run(tree: Tree, tmp_path, hooks_type: type[AddVectorHooks] = AddVectorHooks) -> tuple[StateStore, AddVectorHooks]:
    store = StateStore(tmp_path)
    store.save("root", NodeState(model=torch.zeros(2)))
    hooks = hooks_type(tree, store)
    execute_node(tree, tree.root, None, store, hooks, seed=0)
    return store, hooks


def _clipped(update: list[float], clip: float) -> list[float]:
    norm = math.hypot(*update)
    return [v * (clip / norm * SHRINK if norm > clip else 1.0) for v in update]


def test_a_child_servers_model_is_clipped_where_the_dp_parent_folds_it(tmp_path):
    """DP at the root over the edges A and B, whose models come up whole (the orchestrator's fold, not a worker's):
    each edge's update from the root's model (0) is clipped to 0.5 before the sum, and the mean divides by the
    cohort (2). No noise (z = 0), so the root's model is known by hand; its proxy TRAIN then adds [0, -1].

    A = (1 [1, 0] + 3 [0, 2]) / 4 = [0.25, 1.5] (norm 1.52), B = [3, 1] (norm 3.16): both clipped.
    """
    dp = PrivacyParams(clip=0.5, noise_multiplier=0.0, expected=2, population=2, noise_seed=0)
    store, hooks = _run(_with_dp(two_edge_tree(settings(train=True)), "root", dp), tmp_path)
    edge_a, edge_b = _clipped([0.25, 1.5], 0.5), _clipped([3.0, 1.0], 0.5)
    want = [(edge_a[0] + edge_b[0]) / 2, (edge_a[1] + edge_b[1]) / 2 - 1.0]
    assert store.load_model("root").tolist() == torch.tensor(want).tolist()  # float32, as the fold rounds
    assert store.load_model("A").tolist() == [0.25, 1.5]  # below the DP server: its children are exact
    assert hooks.metrics[("root", 0)]["privacy/clipped_fraction"] == 1.0


def test_a_dp_servers_rounds_compose_over_all_its_executions(tmp_path):
    """DP at edge A (one round an execution), called once in each of the root's two rounds: its second round is its
    second over the run, so its epsilon is two rounds' (not one execution's again), and its noise is that round's."""
    dp = PrivacyParams(clip=1.0, noise_multiplier=2.0, expected=2, population=2, noise_seed=5)
    _, hooks = _run(_with_dp(two_edge_tree(settings(train=True), root_rounds=2), "A", dp), tmp_path)
    first, second = hooks.metrics[("A", 0)], hooks.metrics[("A", 1)]
    assert first["privacy/epsilon"] == epsilon(dp, 1)
    assert second["privacy/epsilon"] == epsilon(dp, 2) > epsilon(dp, 1)
    assert {k for k in hooks.metrics if k[0] == "A"} == {("A", 0), ("A", 1)}


def test_a_dp_server_reports_no_training_loss_or_example_total_up(tmp_path):
    """DP at edge A: A logs its children's loss (it is trusted with them) but reports none up, so the root's
    training loss is B's children's alone; B (no DP) reports its children's: b1 and b2, two rows each."""
    dp = PrivacyParams(clip=1.0, noise_multiplier=1.0, expected=2, population=2, noise_seed=5)
    store, hooks = _run(_with_dp(two_edge_tree(settings(train=True)), "A", dp), tmp_path, LossHooks)
    edge_a, edge_b, root = (store.load_header(n) for n in ("A", "B", "root"))
    assert (edge_a.loss, edge_a.examples) == (None, 0)
    assert (edge_b.loss, edge_b.examples) == ((2.0 * 2 + 4.0 * 2) / 4, 4)  # b1 = [2, 2], b2 = [4, 0]
    assert (root.loss, root.examples) == (edge_b.loss, 4)  # A's subtree is not in it
    assert hooks.metrics[("A", 0)]["Training/loss"] == (1.0 * 1 + 0.0 * 3) / 4  # a1 = [1, 0], a2 = [0, 2]


def test_with_adaptive_clipping_the_update_noise_is_z_delta_times_the_rounds_clip():
    """Andrew et al.'s Theorem 1 splits z between the count and the update: the sum's noise has std z_delta C, with
    z_delta = (0.5^-2 - (2 * 1.5)^-2)^-1/2 = 0.5071 (not z = 0.5), at the round's clip (2, from the state)."""
    from tests.core.test_privacy import KEY, MODELS, REFERENCE, by_hand_clipped, fold, params

    p = params(z=0.5, clip=1.0, expected=4, adaptive=AdaptiveClip(quantile=0.5, lr=0.2, count_noise=1.5))
    rule, folded = fold(p, [["c0", "c1"], ["c2", "c3"]], clip=2.0)
    got = rule.finalize(folded.partial, KEY)
    z_delta = (0.5**-2 - 3.0**-2) ** -0.5
    summed = sum(by_hand_clipped(m - REFERENCE, 2.0).double() for m in MODELS.values())
    gen = torch.Generator().manual_seed(derive_seed(77, "update", *KEY.parts()))
    noise = torch.randn(4, generator=gen, dtype=torch.float64) * (z_delta * 2.0)
    assert torch.equal(got.input, (REFERENCE.double() + (summed + noise) / 4).to(torch.float32))
    assert math.isclose(got.metrics["privacy/noise_std"], z_delta * 2.0 / 4)


def test_a_proxy_train_folded_like_a_child_is_clipped_like_one():
    """A server's own proxy TRAIN folded among its children (member ``order[-1]``; refused with DP by the config,
    ``proxy_train: async``, and clipped here all the same): the fold clips it against the model sent, as a child."""
    from bhfl_core.algorithm.aggregation_rule import fold_results
    from bhfl_core.algorithm.contract import ChildResult
    from tests.core.test_privacy import KEY, MODELS, REFERENCE, by_hand_clipped, params

    p = params(z=0.0, clip=1.0, expected=2)
    rule = rule_for(AggregateParams(wrappers=(p,)))
    results = [ChildResult(members=(m,), model=MODELS[m], weight=1.0) for m in ("c0", "c2")]  # c2 as the proxy
    folded = fold_results(rule, KEY, results, ["c0", "c2"], REFERENCE, rule.plan({}, ()))
    summed = by_hand_clipped(MODELS["c0"] - REFERENCE, 1.0).double() + by_hand_clipped(MODELS["c2"] - REFERENCE, 1.0)
    assert torch.equal(rule.finalize(folded.partial, KEY).input, (REFERENCE.double() + summed / 2).to(torch.float32))


def test_a_secure_aggregation_server_is_not_told_its_child_servers_training_losses(tmp_path):
    """Secure aggregation at the root over the edges A and B (child servers, whose results come up whole through
    the orchestrator, not a worker's batch): the root may learn only the masked sum, so it logs no ``Training/loss``
    or ``Training/examples`` of A's or B's subtrees (each edge's own loss, as A and B log it, would be a per-child
    value in the clear), and reports none up. A and B still log their clients'."""
    from bhfl_core.algorithm.privacy_params import SecAggParams

    secagg = SecAggParams(threshold=2, mask_seed=3)
    tree = two_edge_tree(settings(train=True))
    root = replace(tree.root, settings=replace(tree.root.settings, aggregate=AggregateParams(wrappers=(secagg,))))
    store, hooks = _run(Tree(nodes={**tree.nodes, "root": root}, root_id="root"), tmp_path, LossHooks)
    assert hooks.metrics[("A", 0)]["Training/loss"] == (1.0 * 1 + 0.0 * 3) / 4  # below the root: told as before
    assert "Training/loss" not in hooks.metrics[("root", 0)]
    assert "Training/examples" not in hooks.metrics[("root", 0)]
    assert (store.load_header("root").loss, store.load_header("root").examples) == (None, 0)
