"""The robust rules (median, trimmed mean, Krum / Multi-Krum): by hand, against Flower's own functions, and the same
bits whatever the batching, arrival order, thread count or place of the computation."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from bhfl_core.algorithm.aggregation_rule import fold_results
from bhfl_core.algorithm.contract import ChildResult
from bhfl_core.algorithm.node_state import Caller, RoundKey
from bhfl_core.algorithm.robust import krum_scores, squared_distances
from bhfl_core.algorithm.robust_rules import KrumRule, MedianRule, TrimmedMeanRule
from bhfl_core.algorithm.rule_registry import AggregateParams
from bhfl_core.algorithm.rules import rule_for
from bhfl_core.algorithm.stacked import BLOCK, StackedModels
from tests.core.flower_reference import aggregate_krum, aggregate_median, aggregate_trimmed_avg

KEY = RoundKey("edge", 3)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def fold(rule, models: dict[str, torch.Tensor], weights: dict[str, float] | None = None):
    partial = rule.start(Caller("edge", 3))
    for name, model in models.items():
        rule.contribute(partial, name, model, (weights or {}).get(name, 1.0))
    return partial


def result(rule, models, weights=None) -> torch.Tensor:
    return rule.finalize(fold(rule, models, weights), KEY).input


def test_the_median_by_hand():
    rule = rule_for(AggregateParams("median"))
    assert isinstance(rule, MedianRule)
    three = {"a": t(1, 5, -2), "b": t(3, -1, 0), "c": t(2, 2, 10)}
    # per coordinate: sorted (1, 2, 3) -> 2; (-1, 2, 5) -> 2; (-2, 0, 10) -> 0
    assert result(rule, three).tolist() == [2, 2, 0]
    # an even count: the mean of the two middle values: (2 + 3)/2; (0 + 2)/2; (0 + 1)/2
    assert result(rule, {**three, "d": t(4, 0, 1)}).tolist() == [2.5, 1, 0.5]
    # weights are ignored (as Flower's): a child with 1000x the examples is one vote
    assert result(rule, three, {"a": 1000.0}).tolist() == [2, 2, 0]


def test_the_trimmed_mean_by_hand():
    rule = rule_for(AggregateParams("trimmed_mean", trim=0.25))
    assert isinstance(rule, TrimmedMeanRule)
    five = {"a": t(1, -50), "b": t(100, 0), "c": t(3, 1), "d": t(2, 2), "e": t(4, 3)}
    # int(0.25 * 5) = 1 cut from each end: (2 + 3 + 4)/3 = 3; (0 + 1 + 2)/3 = 1
    assert result(rule, five).tolist() == [3, 1]
    # trim 0.1 of 5 cuts int(0.5) = 0: the plain unweighted mean (1 + 100 + 3 + 2 + 4)/5 = 22; (-50 + 6)/5 = -8.8
    assert result(rule_for(AggregateParams("trimmed_mean", trim=0.1)), five).tolist() == pytest.approx([22, -8.8])


def test_krum_and_multi_krum_by_hand():
    points = {"c1": t(0, 0), "c2": t(1, 0), "c3": t(0, 1), "c4": t(10, 10)}
    weights = {"c1": 1.0, "c2": 3.0, "c3": 5.0, "c4": 7.0}
    # squared distances: c1-c2 1, c1-c3 1, c2-c3 2, c1-c4 200, c2-c4 181, c3-c4 181
    # f = 0, n = 4: each scored by its n - f - 2 = 2 nearest: c1 1+1 = 2, c2 1+2 = 3, c3 1+2 = 3, c4 181+181 = 362
    stacked = fold(KrumRule(AggregateParams("krum")), points, weights)
    assert krum_scores(stacked.ordered(), 0) == [2.0, 3.0, 3.0, 362.0]
    assert result(KrumRule(AggregateParams("krum")), points, weights).tolist() == [0, 0]  # c1
    # Multi-Krum keep 2: c1, then c2 (tied with c3 at 3: the name first); example-weighted (1*[0,0] + 3*[1,0])/4
    assert result(KrumRule(AggregateParams("krum", keep=2)), points, weights).tolist() == [0.75, 0]
    # keep 3 adds c3: (3*[1, 0] + 5*[0, 1])/9
    assert result(KrumRule(AggregateParams("krum", keep=3)), points, weights).tolist() == pytest.approx([3 / 9, 5 / 9])


def _random_round(seed: int, k: int, size: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    g = torch.Generator().manual_seed(seed)
    models = {f"client-{i:02d}": torch.randn(size, generator=g) for i in range(k)}
    for i, name in enumerate(list(models)[: k // 4]):  # a few outliers, as attackers would send
        models[name] = models[name] * 50 + 10 * (i + 1)
    weights = {name: float(torch.randint(1, 200, (1,), generator=g)) for name in models}
    return models, weights


def _flower(models, weights):
    """Flower's input: the same values as float64 arrays, so its numpy arithmetic is exact to ~1e-16 and the
    comparison measures our rounding, not float32 sums' (with outliers 50x the rest, a float32 mean of 10 values is
    off by ~1e-5: Flower's own error on float32 inputs)."""
    return [([m.double().numpy()], int(weights[name])) for name, m in models.items()]


@pytest.mark.parametrize("k", [3, 4, 7, 10])
def test_each_rule_matches_flowers_own_function(k):
    """On the same random inputs (with outliers), each rule against flwr 1.42.0's aggregate_* to 1e-6 (relative)."""
    models, weights = _random_round(k, k, 3 * BLOCK + 123)  # several column blocks, the last one partial
    ours = result(MedianRule(AggregateParams("median")), models, weights)
    np.testing.assert_allclose(ours.numpy(), aggregate_median(_flower(models, weights))[0], rtol=1e-6, atol=1e-7)
    for trim in (0.0, 0.1, 0.25, 0.4):
        ours = result(TrimmedMeanRule(AggregateParams("trimmed_mean", trim=trim)), models, weights)
        theirs = aggregate_trimmed_avg(_flower(models, weights), trim)[0]
        np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-6, atol=1e-7)
    for f in range(max(0, (k - 3) // 2) + 1):  # n > 2f + 2
        for keep in range(1, k - f + 1):
            ours = result(KrumRule(AggregateParams("krum", byzantine=f, keep=keep)), models, weights)
            theirs = aggregate_krum(_flower(models, weights), f, keep if keep > 1 else 0)[0]
            np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-6, atol=1e-7)


def test_krum_picks_an_honest_model_where_the_mean_is_dragged_away():
    honest = {f"h{i}": t(1.0 + 0.01 * i, -1.0) for i in range(5)}
    attackers = {"x1": t(1000.0, 1000.0), "x2": t(-1000.0, 500.0)}  # f = 2: n = 7 > 2f + 2 = 6
    chosen = result(KrumRule(AggregateParams("krum", byzantine=2)), {**honest, **attackers})
    assert any(torch.equal(chosen, h) for h in honest.values())
    # first coordinate sorted: -1000, 1.00, 1.01, 1.02, 1.03, 1.04, 1000: the median is honest h2's
    assert torch.equal(result(MedianRule(AggregateParams("median")), {**honest, **attackers}), t(1.02, -1.0))
    # a diverged child (NaN, inf) is infinitely far from the rest: never Krum's choice; the median cuts it as an outlier
    diverged = {**honest, "a-nan": t(float("nan"), 0.0), "b-inf": t(float("inf"), 1.0)}
    chosen = result(KrumRule(AggregateParams("krum", byzantine=2, keep=3)), diverged)
    assert torch.isfinite(chosen).all() and 1.0 <= chosen[0] <= 1.05
    assert torch.equal(result(MedianRule(AggregateParams("median")), diverged), t(1.03, -1.0))  # NaN sorts last


RULES = [
    AggregateParams("median"),
    AggregateParams("trimmed_mean", trim=0.2),
    AggregateParams("krum", byzantine=1, keep=1),
    AggregateParams("krum", byzantine=1, keep=3),
]


@pytest.mark.parametrize("params", RULES, ids=lambda p: f"{p.kind}-{p.keep}")
def test_the_same_bits_whatever_the_batching_the_arrival_order_and_the_wire(params):
    """Members spread over worker batches in any grouping, sent over the wire, folded with a child server's model,
    in any order: one result, bit for bit; a member twice is an error."""
    rule = rule_for(params)
    models, weights = _random_round(11, 7, 2 * BLOCK + 5)
    # 16 columns of zeros, each member's of random sign: equal values of different bits, so only a fixed member
    # order (not the arrival order) gives every layout the same signs
    signs = torch.randint(0, 2, (len(models), 16), generator=torch.Generator().manual_seed(1)).bool()
    zeros = torch.where(signs, -0.0, 0.0)
    models = {n: torch.cat([m, zeros[i]]) for i, (n, m) in enumerate(models.items())}
    names = list(models)
    server = names[-1]

    def batch(*members):
        partial = fold(rule, {m: models[m] for m in members}, weights)
        tensors, numbers = rule.wire(partial)  # what a worker sends: rows by name, members and weights as numbers
        received = rule.unwire({k: v.clone() for k, v in tensors.items()}, numbers)
        return ChildResult(members=tuple(members), partial=received)

    def layout(groups, server_first):
        own = ChildResult(members=(server,), model=models[server], weight=weights[server])
        results = [batch(*g) for g in groups]
        return [own, *results] if server_first else [*results[::-1], own]

    order = [*names, "edge"]
    layouts = [
        layout([names[:3], names[3:6]], True),
        layout([names[5:6], names[:2], names[2:5]], False),
        layout([[n] for n in reversed(names[:6])], False),
    ]
    finals = [rule.finalize(fold_results(rule, KEY, results, order).partial, KEY).input for results in layouts]
    # and folded directly in other orders (as a worker closing a whole round in its placement's order would)
    for permuted in (names[::-1], names[3:] + names[:3]):
        finals.append(rule.finalize(fold(rule, {n: models[n] for n in permuted}, weights), KEY).input)
    assert all(torch.equal(finals[0], f) for f in finals[1:])
    assert all(torch.equal(torch.signbit(finals[0]), torch.signbit(f)) for f in finals[1:])  # -0.0 == 0.0 above
    with pytest.raises(ValueError, match="contributed twice"):
        fold_results(rule, KEY, [batch(names[0], names[1]), batch(names[1])], order)


@pytest.mark.parametrize("params", RULES, ids=lambda p: f"{p.kind}-{p.keep}")
def test_a_whole_round_closed_on_its_worker_gives_the_parents_bits(params):
    rule = rule_for(params)
    models, weights = _random_round(5, 6, BLOCK + 7)
    opened, closed = fold(rule, models, weights), fold(rule, models, weights)
    assert rule.close(closed)
    tensors, numbers = rule.wire(closed)
    assert list(tensors) == ["mean"] and tensors["mean"].numel() == BLOCK + 7  # one vector goes up, not six
    assert numbers == {"weight": sum(weights.values())}
    received = rule.unwire(tensors, numbers)
    folded = fold_results(rule, KEY, [ChildResult(members=tuple(models), partial=received)], [*models, "edge"])
    assert torch.equal(rule.finalize(folded.partial, KEY).input, rule.finalize(opened, KEY).input)
    with pytest.raises(ValueError, match="closed fold"):
        rule.contribute(folded.partial, "late", models["client-00"], 1.0)


def test_krum_refuses_too_small_a_round_naming_the_node_and_does_not_close_it():
    rule = rule_for(AggregateParams("krum", byzantine=1))
    four = fold(rule, {f"c{i}": t(float(i)) for i in range(4)})  # n = 4 is not > 2f + 2 = 4 (a client dropped)
    assert not rule.close(four)  # left to the parent, which says where
    with pytest.raises(ValueError, match=r"krum at 'edge' \(round 4\): .*more than 2f \+ 2 = 4 contributions, got 4"):
        rule.finalize(four, KEY)
    multi = rule_for(AggregateParams("krum", byzantine=1, keep=5))
    with pytest.raises(ValueError, match=r"keep: 5 is more than the n - f = 4"):
        multi.finalize(fold(multi, {f"c{i}": t(float(i)) for i in range(5)}), KEY)


def test_krum_distances_do_not_depend_on_the_thread_count_and_are_float64_accurate():
    models, _ = _random_round(2, 5, 4 * BLOCK + 1)
    stacked = fold(MedianRule(AggregateParams("median")), models)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = squared_distances(stacked.ordered())
        torch.set_num_threads(4)
        four = squared_distances(stacked.ordered())
    finally:
        torch.set_num_threads(threads)
    assert one == four
    rows = [m.row.double().numpy() for m in stacked.ordered()]
    exact = [[float(np.sum((a - b) ** 2)) for b in rows] for a in rows]
    np.testing.assert_allclose(one, exact, rtol=1e-12)


def test_rows_live_in_the_storage_allocate_gives_and_travel_under_its_names():
    storage: dict[str, torch.Tensor] = {}

    def allocate(name, numel, dtype):
        storage[name] = torch.zeros(numel, dtype=dtype)
        return storage[name]

    partial = StackedModels(Caller("edge", 0), allocate)
    partial.add("b", t(1, 2), 3.0)
    partial.add("a", t(3, 4), 5.0)
    assert sorted(storage) == ["row0", "row1"] and storage["row1"].tolist() == [3, 4]
    tensors, numbers = partial.wire()
    assert {k: v.data_ptr() for k, v in tensors.items()} == {k: v.data_ptr() for k, v in storage.items()}  # no copy
    assert numbers == {"member.b": 0.0, "member.a": 1.0, "weight.b": 3.0, "weight.a": 5.0}
    assert [m.name for m in partial.ordered()] == ["a", "b"] and partial.weight == 8.0
    with pytest.raises(ValueError, match="sent 3 parameters"):
        partial.add("c", t(1, 2, 3), 1.0)
    partial.close_with(lambda s: s.ordered()[0].row * 2)
    assert storage["mean"].tolist() == [6, 8] and partial.rows == {} and partial.weight == 8.0


def test_a_stacked_fold_is_what_the_mean_would_be_on_one_child():
    one = {"only": torch.randn(100)}
    for params in RULES[:2]:
        assert torch.equal(result(rule_for(params), one), one["only"])
    with pytest.raises(ValueError, match="more than 2f"):  # Krum needs n > 2f + 2, even with f = 0
        result(rule_for(replace(RULES[2], byzantine=0)), one)
