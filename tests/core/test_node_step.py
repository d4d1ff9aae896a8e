"""The pure steps of Algorithm 1 with hand-computed numbers: no store, no files, no hooks."""

from dataclasses import replace

import pytest
import torch

from bhfl_core.algorithm.aggregation import WeightedSum
from bhfl_core.algorithm.aggregation_rule import FoldedRound
from bhfl_core.algorithm.node_opt import NodeOptParams
from bhfl_core.algorithm.node_state import ROOT_CALLER, Caller, NodeState, RoundKey
from bhfl_core.algorithm.node_step import (
    PendingResidual,
    down_posts,
    node_down,
    node_up,
)
from bhfl_core.algorithm.residuals import Candidate, DownLink, UpLink
from bhfl_core.algorithm.tree import NodeSettings


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


KEY = RoundKey("node", 0)


def folded_round() -> FoldedRound:
    """An empty round of children for the default (mean) rule."""
    return FoldedRound(WeightedSum(), [], {}, [])


def pending(kind: str, sender: str, round_index: int, *models: tuple[list[float], float]) -> PendingResidual:
    acc = WeightedSum()
    for values, weight in models:
        acc.add(t(*values), weight)
    return PendingResidual(acc, {f"{kind}/{sender}": round_index})


def test_node_down_first_execution_adopts_phi_and_folds_its_down_residuals():
    # phi = [0, 0]; R_down holds [2, 4] (weight 1): the residual's NODEOPT (FedAvg, eta 0.5)
    # steps from phi to [1, 2]; that step is added to the adopted phi: [1, 2].
    settings = NodeSettings(res_in=(("down0", NodeOptParams(eta=0.5)),))
    inbox = {"down0": pending("down0", "root", 3, ([2.0, 4.0], 1.0))}
    state, metrics = node_down(NodeState(rounds_done=2), t(0, 0), inbox, settings, Caller("edge", 5))
    assert state.theta.tolist() == [1.0, 2.0] and metrics == {}  # metric lines only under LoRA's exact
    assert state.res_seen == {"down0/root": 3}
    assert int(state.opt_res["down0"]["step"]) == 1
    assert (state.exec_caller, state.exec_start, state.rounds_done) == ("edge:5", 2, 2)


def test_node_down_steps_the_persistent_model_towards_phi_with_its_own_optimiser():
    # W = [1, 1], phi = [3, -1], FedAvgM (eta 1, beta1 0.9) with m = [1, 0]:
    # Delta = [2, -2]; m = 0.9 * [1, 0] + [2, -2] = [2.9, -2]; theta_0 = W + m = [3.9, -1].
    settings = NodeSettings(opt_down=NodeOptParams(kind="fedavgm", eta=1.0, beta1=0.9))
    stored = NodeState(model=t(1, 1), opt_down={"m": t(1, 0), "step": torch.tensor(4)})
    state, _ = node_down(stored, t(3, -1), {}, settings, ROOT_CALLER)
    assert state.theta.tolist() == pytest.approx([3.9, -1.0])
    assert state.opt_down["m"].tolist() == pytest.approx([2.9, -2.0])
    assert int(state.opt_down["step"]) == 5
    assert stored.model.tolist() == [1.0, 1.0] and stored.opt_down["m"].tolist() == [1.0, 0.0]  # inputs untouched


def test_node_down_of_a_non_persistent_node_starts_from_phi_with_fresh_states():
    settings = NodeSettings(persistent=False, opt_down=NodeOptParams(kind="fedavgm", eta=1.0))
    stored = NodeState(model=t(9, 9), opt_down={"m": t(5, 5)}, rounds_done=7, res_seen={"down0/root": 1})
    state, _ = node_down(stored, t(2, 3), {}, settings, Caller("edge", 0))
    assert state.theta.tolist() == [2.0, 3.0]
    assert state.opt_down == {} and state.rounds_done == 7 and state.res_seen == {"down0/root": 1}


def test_node_down_without_phi_keeps_the_own_model_and_ignores_the_inbox():
    settings = NodeSettings(res_in=(("down0", NodeOptParams()),))
    inbox = {"down0": pending("down0", "x", 0, ([5.0, 5.0], 1.0))}
    state, _ = node_down(NodeState(model=t(1, 2)), None, inbox, settings, ROOT_CALLER)
    assert state.theta.tolist() == [1.0, 2.0] and state.res_seen == {}
    with pytest.raises(ValueError, match="no model of its own"):
        node_down(NodeState(), None, {}, settings, ROOT_CALLER)


def test_node_up_aggregates_selects_residuals_and_folds_its_inbox():
    # theta_t = [0, 0]; children [2, 0] (weight 1) and [0, 4] (weight 3): mean [0.5, 3];
    # FedAvg eta 1 adopts it. Up-residual rule 0 (k=1, l2) picks the larger update [0, 4]
    # and posts it with its weight (total [0, 12], weight 3). The node's own R_up holds
    # [2, 0] (weight 2): its NODEOPT (FedAvg, eta 0.5) steps from theta_t to [1, 0], and
    # that step is added to the regular one: [0.5, 3] + [1, 0] = [1.5, 3].
    settings = NodeSettings(res_up=(UpLink(0, "root", k=1, select="l2"),), res_in=(("up1", NodeOptParams(eta=0.5)),))
    report = folded_round()
    candidates = [Candidate("c1", t(2, 0), 1.0), Candidate("c2", t(0, 4), 3.0)]
    for c in candidates:
        report.partial.add(c.theta, c.weight)
    report.candidates.extend(candidates)
    inbox = {"up1": pending("up1", "c9", 4, ([2.0, 0.0], 2.0))}
    state, posts, _ = node_up(NodeState(model=t(0, 0)), report, inbox, settings, KEY)
    assert state.theta.tolist() == [1.5, 3.0]
    assert state.res_seen == {"up1/c9": 4} and int(state.opt_up["step"]) == 1
    [post] = posts
    assert (post.target, post.kind, post.models) == ("root", "up0", 1)
    assert post.part.mean().tolist() == [0.0, 4.0] and post.part.weight == 3.0


def test_node_up_mean_combine_posts_one_model_and_each_posts_k():
    report = folded_round()
    for values, w in (([1.0, 0.0], 1.0), ([3.0, 0.0], 1.0), ([0.0, 8.0], 2.0)):
        report.partial.add(t(*values), w)
        report.candidates.append(Candidate(f"c{len(report.candidates)}", t(*values), w))
    links = (UpLink(0, "root", k=2, combine="mean"), UpLink(1, "mid", k=2, combine="each"))
    _, posts, _ = node_up(NodeState(model=t(0, 0)), report, {}, NodeSettings(res_up=links), KEY)
    assert [(p.target, p.models) for p in posts] == [("root", 1), ("mid", 2)]
    # the two largest updates are [0, 8] and [3, 0]: "mean" is their plain mean as one model
    assert posts[0].part.mean().tolist() == [1.5, 4.0] and posts[0].part.weight == 1.0
    assert posts[1].part.weight == 3.0 and posts[1].part.mean().tolist() == pytest.approx([1.0, 16 / 3])


def test_node_up_with_no_children_or_all_dropped_changes_nothing():
    settings = NodeSettings(res_up=(UpLink(0, "root"),))
    state = NodeState(model=t(1, 1))
    assert node_up(state, None, {}, settings, KEY) == (state, [], {})
    dropped = replace(folded_round(), dropped=["c1"])
    assert node_up(state, dropped, {"up0": pending("up0", "x", 0, ([1.0, 1.0], 1.0))}, settings, KEY) == (state, [], {})
    # a stateful server optimiser neither steps nor counts the empty round (as a Flower strategy given no results)
    adam = replace(settings, opt_up=NodeOptParams("fedadam", eta=0.1))
    moments = {"m": t(0.5, -0.5), "v": t(0.25, 0.25), "step": torch.tensor(3)}
    stateful = replace(state, opt_up=moments)
    after, posts, _ = node_up(stateful, dropped, {}, adam, KEY)
    assert after is stateful and posts == [] and after.opt_up is moments


def test_down_posts_send_the_round_model_with_weight_one():
    posts = down_posts(t(2, 5), NodeSettings(res_down=(DownLink(0, "c1"), DownLink(3, "c2"))))
    assert [(p.target, p.kind, p.models, p.part.weight) for p in posts] == [
        ("c1", "down0", 1, 1.0),
        ("c2", "down3", 1, 1.0),
    ]
    assert all(p.part.mean().tolist() == [2.0, 5.0] for p in posts)


def test_the_resume_rule_counts_only_the_same_callers_rounds():
    state = NodeState(rounds_done=7, exec_caller=Caller("edge", 2).key, exec_start=5)
    assert state.rounds_done_for(Caller("edge", 2)) == 2
    assert state.rounds_done_for(Caller("edge", 3)) == 0
    assert state.rounds_done_for(ROOT_CALLER) == 0
    assert RoundKey("c1", 4, Caller("edge", 2)).parts() == ("c1", 4, "edge:2")
    assert RoundKey("edge", 2).as_caller() == Caller("edge", 2)
