"""FedBuff's buffered, staleness-weighted step and the virtual clock (pure parts of issue 14).

A buffer is folded here as the asynchronous engine folds it (``async_engine._buffer``):
each arrival becomes ``stale_model(theta, y, base, staleness_weight(s))`` and is
contributed to the node's rule with its example weight; the rule's ``finalize`` is the
flush's ``mean_input``.
"""

import math

import pytest
import torch

from bhfl_core.algorithm.aggregation_rule import MeanRule
from bhfl_core.algorithm.asynchrony import StalenessParams, stale_model, staleness_weight
from bhfl_core.algorithm.node_opt import NodeOptParams, node_opt_step
from bhfl_core.algorithm.node_state import Caller, RoundKey
from bhfl_core.algorithm.rule_registry import AggregateParams
from bhfl_core.algorithm.virtual_clock import ClockParams, call_duration, client_speed, drops_out


@pytest.mark.parametrize(
    "params, weights",
    [
        (StalenessParams("constant"), [1.0, 1.0, 1.0, 1.0]),
        (StalenessParams("poly", a=0.5), [1.0, 1 / math.sqrt(2), 1 / math.sqrt(3), 0.5]),  # 1/sqrt(1+s)
        (StalenessParams("poly", a=1.0), [1.0, 0.5, 1 / 3, 0.25]),
        # hinge a=2, b=1: s <= 1 -> 1; s = 2 -> 1/(2*1+1); s = 3 -> 1/(2*2+1)
        (StalenessParams("hinge", a=2.0, b=1.0), [1.0, 1.0, 1 / 3, 0.2]),
    ],
)
def test_staleness_functions_by_hand(params, weights):
    assert [staleness_weight(s, params) for s in range(4)] == pytest.approx(weights, rel=1e-15)


def test_staleness_rejects_negative_and_unknown():
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        staleness_weight(-1, StalenessParams())
    with pytest.raises(ValueError, match="unknown staleness function 'linear'"):
        staleness_weight(0, StalenessParams("linear"))


def flush(
    theta: torch.Tensor, arrivals: list[tuple[torch.Tensor, torch.Tensor, float, int]], params: StalenessParams
) -> torch.Tensor:
    """``mean_input`` of a buffer of ``(y, base, p, s)`` arrivals, folded as the engine folds them."""
    rule = MeanRule(AggregateParams())
    partial = rule.start(Caller("A", 0))
    for i, (model, base, weight, staleness) in enumerate(arrivals):
        rule.contribute(partial, str(i), stale_model(theta, model, base, staleness_weight(staleness, params)), weight)
    return rule.finalize(partial, RoundKey("A", 0)).input


def test_a_buffer_flushes_by_hand():
    # theta = [1, 1]; results: a (weight 1, staleness 0, from theta, y = [3, 1]: delta [2, 0]),
    # b (weight 3, staleness 3, from [0, 0], y = [0, 4]: delta [0, 4])
    # poly a=0.5: w(0) = 1, w(3) = 1/2 ->  sum p w Delta = 1*1*[2,0] + 3*0.5*[0,4] = [2, 6];  sum p = 4
    # mean_input = [1, 1] + [2, 6]/4 = [1.5, 2.5]
    theta = torch.tensor([1.0, 1.0])
    arrivals = [
        (torch.tensor([3.0, 1.0]), theta, 1.0, 0),
        (torch.tensor([0.0, 4.0]), torch.tensor([0.0, 0.0]), 3.0, 3),
    ]
    mean_input = flush(theta, arrivals, StalenessParams("poly", a=0.5))
    assert mean_input.tolist() == [1.5, 2.5]
    # NODEOPT_up then steps towards it: fedavg eta 0.5 -> theta + 0.5 (mean_input - theta) = [1.25, 1.75]
    _, stepped = node_opt_step({}, theta, mean_input, NodeOptParams("fedavg", eta=0.5))
    assert stepped.tolist() == [1.25, 1.75]
    # constant staleness: b counts fully -> [1, 1] + (1*[2, 0] + 3*[0, 4]) / 4 = [1.5, 4]
    assert flush(theta, arrivals, StalenessParams("constant")).tolist() == [1.5, 4.0]


def test_fresh_buffer_equals_the_synchronous_weighted_mean():
    # every child started from theta (staleness 0): theta + sum p (y - theta) / sum p = sum p y / sum p
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(5, generator=g)
    ys = [torch.randn(5, generator=g) for _ in range(3)]
    ps = [2.0, 5.0, 1.0]
    want = sum(p * y.double() for p, y in zip(ps, ys)) / sum(ps)
    got = flush(theta, [(y, theta, p, 0) for y, p in zip(ys, ps)], StalenessParams("poly"))
    assert torch.allclose(got.double(), want, atol=1e-6)


def test_a_flush_is_flsims_fedbuff_step_with_linear_example_weights():
    """FLSim's FedBuff (``HybridAggregator``, a reducer of type WEIGHTED_SUM, an SGD server step) transcribed:
    ``x -= lr * sum_i e(n_i) w(s_i) (before_i - after_i)`` with FLSim's ``LinearExampleWeight``
    ``e(n) = n / avg_num_examples`` (1) and ``PolynomialStalenessWeight``
    ``w(s) = (1 + s)^-a / (1 + avg_staleness)^-a``. With
    ``lr = (1 + avg_staleness)^-a / sum_i n_i`` it is bhfl's flush followed by fedavg at eta 1 (docs/algorithm.md)."""
    import numpy as np

    rng = np.random.default_rng(3)
    theta = rng.normal(size=6)
    bases = [theta, theta - rng.normal(size=6), theta + rng.normal(size=6)]  # models of versions v, v-1, v-4
    staleness, examples, a, avg = [0, 1, 4], [30, 5, 12], 0.5, 1
    afters = [b + rng.normal(size=6) for b in bases]
    w = [(1 + s) ** -a / (1 + avg) ** -a for s in staleness]
    reduced = sum(n * wi * (before - after) for n, wi, before, after in zip(examples, w, bases, afters))
    flsim = theta - (1 + avg) ** -a / sum(examples) * reduced

    as_torch = [torch.tensor(x, dtype=torch.float32) for x in (theta, *bases, *afters)]
    t, bs, ys = as_torch[0], as_torch[1:4], as_torch[4:]
    arrivals = [(y, t if i == 0 else b, float(n), s) for i, (y, b, n, s) in enumerate(zip(ys, bs, examples, staleness))]
    mean_input = flush(t, arrivals, StalenessParams("poly", a=a))
    _, stepped = node_opt_step({}, t, mean_input, NodeOptParams("fedavg", eta=1.0))
    np.testing.assert_allclose(stepped.double().numpy(), flsim, rtol=1e-5, atol=1e-5)


def test_speeds_are_seeded_by_client_or_group():
    flat = ClockParams()
    assert client_speed(0, "en-00", "en", flat) == 1.0
    spread = ClockParams(sigma=0.8)
    a, b = client_speed(0, "en-00", "en", spread), client_speed(0, "en-01", "en", spread)
    assert a != b and a == client_speed(0, "en-00", "en", spread)  # per client, reproducible
    assert client_speed(1, "en-00", "en", spread) != a  # another seed, another draw
    grouped = ClockParams(sigma=0.8, per="group")
    assert client_speed(0, "en-00", "en", grouped) == client_speed(0, "en-05", "en", grouped)
    speeds = [client_speed(0, f"c{i}", None, spread) for i in range(2000)]
    median = sorted(speeds)[1000]
    assert 0.9 < median < 1.1  # log-normal with median 1
    assert 0.7 < math.log(sorted(speeds)[1682]) < 0.9  # ~84th percentile at exp(sigma)


def test_call_duration_counts_compute_stragglers_and_two_transfers():
    params = ClockParams(comm_s=0.5)
    assert call_duration(12, 4.0, params, 0, "en-00", 3) == 12 / 4.0 + 1.0
    always = ClockParams(comm_s=0.5, straggler_p=1.0, straggler_factor=10.0)
    assert call_duration(12, 4.0, always, 0, "en-00", 3) == 30.0 + 1.0
    sometimes = ClockParams(straggler_p=0.3)
    draws = [call_duration(1, 1.0, sometimes, 0, "en-00", d) for d in range(1000)]
    assert draws == [call_duration(1, 1.0, sometimes, 0, "en-00", d) for d in range(1000)]  # seeded
    assert 0.25 < sum(d > 1 for d in draws) / 1000 < 0.35


def test_dropout_draws_are_seeded_by_the_call_and_follow_the_probability():
    draws = [drops_out(0.3, 0, "en-00", d) for d in range(2000)]
    assert draws == [drops_out(0.3, 0, "en-00", d) for d in range(2000)]
    assert 0.27 < sum(draws) / 2000 < 0.33
    assert draws != [drops_out(0.3, 0, "en-01", d) for d in range(2000)]  # each client its own draws
    assert not any(drops_out(0.0, 0, "en-00", d) for d in range(100))
