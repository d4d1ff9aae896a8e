"""FedNova (Wang et al. 2020): by hand, against the paper's formula, equal steps = the weighted mean, any batching the
same bits, and the step counts clients report (``tree.local_steps``)."""

import math
from dataclasses import replace

import pytest
import torch

from bhfl_core.algorithm.aggregation_rule import MeanRule, fold_results
from bhfl_core.algorithm.contract import ChildResult
from bhfl_core.algorithm.fednova_rule import FedNovaRule, nova_weight
from bhfl_core.algorithm.node_state import Caller, RoundKey
from bhfl_core.algorithm.rule_registry import AggregateParams
from bhfl_core.algorithm.rules import rule_for
from bhfl_core.algorithm.tree import Node, NodeSettings, Role, TrainParams, local_steps

KEY = RoundKey("edge", 0)
RULE = rule_for(AggregateParams("fednova"))


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def fold(reference, members: dict[str, tuple[torch.Tensor, float, int]], rule=RULE):
    partial = rule.start(Caller("edge", 0), reference=reference)
    for name, (model, weight, steps) in members.items():
        rule.contribute(partial, name, model, weight, steps=steps)
    return partial


def test_fednova_by_hand():
    # x_ref = [1, 1]; c1: w 1, tau 1, x [0, 1]; c2: w 3, tau 2, x [1, -2]
    # d1 = ([1, 1] - [0, 1]) / 1 = [1, 0];  d2 = ([1, 1] - [1, -2]) / 2 = [0, 1.5];  p = (1/4, 3/4)
    # sum p d = [0.25, 1.125];  tau_eff = 1/4 * 1 + 3/4 * 2 = 1.75
    # x_nova = [1, 1] - 1.75 * [0.25, 1.125] = [0.5625, -0.96875]
    assert isinstance(RULE, FedNovaRule)
    partial = fold(t(1, 1), {"c1": (t(0, 1), 1.0, 1), "c2": (t(1, -2), 3.0, 2)})
    assert RULE.finalize(partial, KEY).input.tolist() == [0.5625, -0.96875]
    # FedAvg would be (1 [0, 1] + 3 [1, -2]) / 4 = [0.75, -1.25]: c2's extra step pulls it further
    mean = MeanRule(AggregateParams())
    plain = mean.start(Caller("edge", 0))
    mean.contribute(plain, "c1", t(0, 1), 1.0)
    mean.contribute(plain, "c2", t(1, -2), 3.0)
    assert mean.finalize(plain, KEY).input.tolist() == [0.75, -1.25]
    assert partial.weight == 4.0


def _clients(seed: int, k: int, size: int, steps: list[int] | None = None):
    g = torch.Generator().manual_seed(seed)
    reference = torch.randn(size, generator=g)
    members = {}
    for i in range(k):
        tau = steps[i] if steps else int(torch.randint(1, 40, (1,), generator=g))
        model = reference + 1e-2 * tau * torch.randn(size, generator=g)  # more steps, further away
        members[f"c{i:02d}"] = (model, float(torch.randint(5, 500, (1,), generator=g)), tau)
    return reference, members


def test_fednova_is_the_papers_formula_on_random_clients():
    reference, members = _clients(0, 9, 5000)
    ours = RULE.finalize(fold(reference, members), KEY).input
    x_ref = reference.double()
    total = sum(w for _, w, _ in members.values())
    p = {m: w / total for m, (_, w, _) in members.items()}
    tau_eff = sum(p[m] * tau for m, (_, _, tau) in members.items())
    direction = sum(p[m] * (x_ref - x.double()) / tau for m, (x, _, tau) in members.items())
    paper = x_ref - tau_eff * direction
    torch.testing.assert_close(ours.double(), paper, rtol=1e-6, atol=1e-7)
    mean = sum(w * x.double() for x, w, _ in members.values()) / total
    assert (ours.double() - mean).abs().max() > 1e-3  # unequal steps: not the plain mean


def _mean(members) -> torch.Tensor:
    rule = MeanRule(AggregateParams())
    partial = rule.start(Caller("edge", 0))
    for name, (model, weight, _) in members.items():
        rule.contribute(partial, name, model, weight)
    return rule.finalize(partial, KEY).input


def test_with_equal_steps_fednova_is_the_weighted_mean_of_the_models():
    # steps a power of two: a_i = w_i / 4 exactly, x_ref cancels: the mean rule's mean, bit for bit
    reference, members = _clients(1, 7, 20_000, steps=[4] * 7)
    assert torch.equal(RULE.finalize(fold(reference, members), KEY).input, _mean(members))
    # other steps: a_i = w_i / 6 rounded to 29 bits, so the weights are w_i's to 2**-29: equal to float32 rounding
    reference, members = _clients(1, 7, 20_000, steps=[6] * 7)
    nova, mean = RULE.finalize(fold(reference, members), KEY).input, _mean(members)
    spread = max(float((x - reference).abs().max()) for x, _, _ in members.values())
    torch.testing.assert_close(nova, mean, rtol=2.5e-7, atol=2**-27 * spread)  # one ulp; near 0, the weights' error
    assert (nova == mean).float().mean() > 0.99


def test_the_same_bits_whatever_the_batching_and_the_wire():
    reference, members = _clients(2, 8, 3000)
    names = list(members)
    order = [*names, "edge"]

    def batch(*group):
        partial = fold(reference, {n: members[n] for n in group})
        tensors, numbers = RULE.wire(partial)  # a worker's fold: the exact sum, each member's (w, tau) as numbers
        assert set(tensors) == {"hi", "lo"} and numbers[f"steps.{group[0]}"] == members[group[0]][2]
        received = RULE.unwire({k: v.clone() for k, v in tensors.items()}, numbers)
        return ChildResult(members=tuple(group), partial=received)

    layouts = [[batch(*names[:4]), batch(*names[4:])], [batch(*names[5:]), batch(*names[:2]), batch(*names[2:5])]]
    layouts.append([batch(n) for n in reversed(names)])
    finals = [RULE.finalize(fold_results(RULE, KEY, r, order, reference=reference).partial, KEY).input for r in layouts]
    assert all(torch.equal(finals[0], f) for f in finals[1:])
    assert torch.equal(finals[0], RULE.finalize(fold(reference, members), KEY).input)
    assert not RULE.close(fold(reference, members))  # the parent holds x_ref: it finalizes
    with pytest.raises(ValueError, match="contributed twice"):
        fold_results(RULE, KEY, [batch(*names[:2]), batch(names[1])], order, reference=reference)


def test_a_contribution_without_steps_is_refused():
    partial = RULE.start(Caller("edge", 0), reference=t(0))
    with pytest.raises(ValueError, match=r"'west' reported none \(only clients do"):
        RULE.contribute(partial, "west", t(1), 3.0)  # a child server's model
    with pytest.raises(ValueError, match="at least one local step"):
        RULE.contribute(partial, "c", t(1), 3.0, steps=0)


def test_the_weights_have_29_significant_bits_so_their_products_with_float32_models_are_exact():
    for w, tau in ((3.0, 7), (1e6, 3), (17.0, 17), (5.0, 1), (250.0, 33)):
        a = nova_weight(w, tau)
        assert a == pytest.approx(w / tau, rel=2**-29)
        mantissa, _ = math.frexp(a)
        assert (mantissa * 2**29).is_integer()
        x = torch.randn(1000).double()  # float32 values (24 bits): 24 + 29 bits fit float64's 53
        assert torch.equal((x * a) / a, x)


def _client(rows: int, train: TrainParams, rounds: int = 1, holdout: float = 0.0) -> Node:
    settings = NodeSettings(rounds=rounds, train=train, holdout=holdout)
    return Node("c", Role.CLIENT, 2, "edge", (), settings, float(rows))


def test_local_steps_are_the_clients_planned_optimiser_steps():
    train = TrainParams(epochs=2, batch_size=16)
    assert local_steps(_client(50, train)) == 2 * 4  # ceil(50 / 16) = 4 batches, 2 epochs
    assert local_steps(_client(50, train), epochs=5) == 5 * 4  # Tempo's epochs from the plan
    assert local_steps(_client(50, train, rounds=3)) == 3 * 8  # every round's TRAIN
    assert local_steps(_client(50, replace(train, max_steps=5))) == 5
    assert local_steps(_client(50, train, holdout=0.2)) == 2 * 3  # 10 rows held out: ceil(40 / 16) = 3
    assert local_steps(Node("e", Role.EDGE, 1, "root", ("c",), NodeSettings(), 50.0)) == 0
