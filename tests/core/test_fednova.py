"""FedNova (Wang et al. 2020): by hand, against the paper's formula, equal steps = the weighted mean, any batching the
same bits, and the normalisers clients report (``fednova_norm.local_norm``: steps, or FedProx's ``||a_i||_1``)."""

import math
from dataclasses import replace

import pytest
import torch

from bhfl_core.algorithm.aggregation_rule import MeanRule, fold_results
from bhfl_core.algorithm.contract import ChildResult
from bhfl_core.algorithm.fednova_norm import local_norm, proximal_norm
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


def _clients(seed: int, k: int, size: int, steps: list[float] | None = None):
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
    # FedProx's normalisers are not integers: the same, from the products rounded member by member
    reference, members = _clients(1, 7, 20_000, steps=[proximal_norm(0.03, 6)] * 7)
    nova, mean = RULE.finalize(fold(reference, members), KEY).input, _mean(members)
    torch.testing.assert_close(nova, mean, rtol=2.5e-7, atol=2**-27 * spread)
    assert (nova == mean).float().mean() > 0.99


def test_the_same_bits_whatever_the_batching_and_the_wire():
    reference, members = _clients(2, 8, 3000)
    # FedProx clients' normalisers (not integers) cross the wire as they are
    members |= {n: (x, w, proximal_norm(0.02, int(tau))) for n, (x, w, tau) in list(members.items())[::2]}
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
    assert local_norm(_client(50, train, rounds=3)) == 3 * 8  # AdamW: its steps


def _reference_accumulation(etamu: float, steps: int) -> float:
    """github JYWa/FedNova ``FedNova.step``'s ``local_normalizing_vec`` with ``mu != 0``, momentum 0: per step."""
    local_normalizing_vec = 0.0
    for _ in range(steps):
        local_normalizing_vec *= 1 - etamu
        local_normalizing_vec += 1
    return local_normalizing_vec


def test_the_proximal_normaliser_by_hand_and_as_the_reference_implementation_accumulates_it():
    assert proximal_norm(0.5, 3) == 1 + 0.5 + 0.25  # a = [(1 - 0.5)^2, 1 - 0.5, 1]
    assert proximal_norm(0.25, 2) == 1.75 and proximal_norm(0.3, 1) == 1.0 and proximal_norm(0.3, 0) == 0.0
    for alpha, steps in ((0.1, 8), (1e-3, 37), (3e-6, 1000), (0.9, 13), (0.02, 4096), (1e-9, 250)):
        accumulated = _reference_accumulation(alpha, steps)
        assert proximal_norm(alpha, steps) == pytest.approx(accumulated, rel=1e-12)
        assert proximal_norm(alpha, steps) == pytest.approx((1 - (1 - alpha) ** steps) / alpha, rel=1e-6)
        assert proximal_norm(alpha, steps) < steps  # the pull makes earlier steps count less
    for alpha in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="0 < lr·mu < 1"):
            proximal_norm(alpha, 3)


def test_local_norm_is_fedproxs_normaliser_for_sgd_clients():
    sgd = TrainParams(lr=0.1, epochs=2, batch_size=16, optimizer="sgd", mu=0.5)  # alpha = 0.05
    one_call = (1 - 0.95**8) / 0.05  # ceil(50 / 16) = 4 batches, 2 epochs: 8 steps, re-anchored each call
    assert local_norm(_client(50, sgd)) == pytest.approx(one_call, rel=1e-13)
    assert local_norm(_client(50, sgd, rounds=3)) == pytest.approx(3 * one_call, rel=1e-13)  # each round's TRAIN
    assert local_norm(_client(50, sgd), epochs=1) == pytest.approx((1 - 0.95**4) / 0.05, rel=1e-13)  # Tempo
    assert local_norm(_client(50, sgd, holdout=0.2)) == pytest.approx((1 - 0.95**6) / 0.05, rel=1e-13)
    assert local_norm(_client(50, replace(sgd, max_steps=5))) == pytest.approx((1 - 0.95**5) / 0.05, rel=1e-13)
    assert local_norm(_client(50, replace(sgd, mu=0.0))) == 8.0  # plain SGD: a_i is all ones
    assert local_norm(_client(50, replace(sgd, optimizer="adamw"))) == 8.0  # no adaptive normaliser: the steps
    assert local_norm(Node("e", Role.EDGE, 1, "root", ("c",), NodeSettings(), 50.0)) == 0.0


def test_fednova_with_fedprox_sgd_clients_is_the_papers_update_on_a_quadratic():
    # F_i(x) = 1/2 (x - c_i)' H_i (x - c_i); TRAIN is full-batch SGD with the proximal pull and weight decay,
    # run by hand: x <- x - lr (H_i (x - c_i) + wd x + mu (x - x_start)), re-anchored at each round's start
    lr, mu, wd = 0.1, 0.8, 0.01
    x_ref = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    clients = {}  # name -> (node, trained model, ||a_i||_1 summed from the paper's a_i)
    for name, rows, epochs, rounds in (("c1", 1, 1, 1), ("c2", 2, 3, 1), ("c3", 1, 4, 2)):
        h, c = 0.5 + torch.rand(3, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)
        train = TrainParams(lr=lr, epochs=epochs, batch_size=1, optimizer="sgd", weight_decay=wd, mu=mu)
        node = _client(rows, train, rounds=rounds)
        x, a, grads = x_ref.clone(), [], []
        for _ in range(rounds):
            start, steps = x.clone(), rows * epochs
            for k in range(steps):
                grads.append(h * (x - c) + wd * x)
                a.append((1 - lr * mu) ** (steps - 1 - k))  # the paper's a_i for proximal SGD, one round
                x = x - lr * (grads[-1] + mu * (x - start))
        # the update is lr * G_i a_i: what the normaliser's a_i says it is
        torch.testing.assert_close(x_ref - x, lr * sum(ak * gk for ak, gk in zip(a, grads)), rtol=1e-12, atol=1e-14)
        clients[name] = (node, x.float(), sum(a))
    weights = {"c1": 1.0, "c2": 2.0, "c3": 1.0}
    total = sum(weights.values())
    tau_eff = sum(weights[n] / total * norm for n, (_, _, norm) in clients.items())
    direction = sum(weights[n] / total * (x_ref - x.double()) / norm for n, (_, x, norm) in clients.items())
    paper = x_ref - tau_eff * direction

    def nova(normaliser):
        members = {n: (x, weights[n], normaliser(node)) for n, (node, x, _) in clients.items()}
        return RULE.finalize(fold(x_ref.float(), members), KEY).input.double()

    torch.testing.assert_close(nova(local_norm), paper, rtol=1e-6, atol=1e-6)
    assert (nova(local_steps) - paper).abs().max() > 1e-2  # the steps as the normaliser: another point
