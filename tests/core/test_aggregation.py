"""WeightedSum: exact double-double sums whose float32 mean does not depend on order or grouping.

Every exactness test runs through both implementations: torch's chunked passes and the fused
CPU loops (bhfl_core/algorithm/exact_kernels.py), which large sums take.
"""

import random
from fractions import Fraction
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bhfl_core.algorithm import aggregation
from bhfl_core.algorithm.aggregation import WeightedSum


def nearest_float32(q: Fraction) -> float:
    """Round-to-nearest-even to float32 by integer arithmetic (independent of the implementation's method)."""
    if q == 0:
        return 0.0
    sign, q = (-1 if q < 0 else 1), abs(q)
    k = q.numerator.bit_length() - q.denominator.bit_length() - 24
    while q >= Fraction(2) ** (k + 24):
        k += 1
    while q < Fraction(2) ** (k + 23):
        k -= 1
    k = max(k, -149)  # subnormal: the quantum stops at 2**-149
    n, r = divmod(q.numerator * 2 ** max(-k, 0), q.denominator * 2 ** max(k, 0))
    d = q.denominator * 2 ** max(k, 0)
    if 2 * r > d or (2 * r == d and n % 2):
        n += 1
    return sign * n * 2.0**k


def exact_mean(vectors, weights) -> list[float]:
    total = sum(weights)
    return [
        nearest_float32(sum(Fraction(float(v[i])) * w for v, w in zip(vectors, weights)) / total)
        for i in range(len(vectors[0]))
    ]


def path(fused: bool):
    """Sums of any size take the fused loops (``fused``) or torch's passes."""
    return mock.patch.object(aggregation, "_FUSED_MIN", 0 if fused else 1 << 62)


@pytest.fixture(params=["torch", "fused"])
def either_path(request):
    with path(request.param == "fused"):
        yield


def bits(t: torch.Tensor) -> list[int]:
    return t.view(torch.int32).tolist()


def combine(vectors, weights, order, groups, merges) -> torch.Tensor:
    """Add the inputs in ``order`` into ``groups`` partial sums, then merge those pairwise as ``merges`` says."""
    parts = [WeightedSum() for _ in range(max(groups) + 1)]
    for i in order:
        parts[groups[i]].add(vectors[i], weights[i])
    parts = [p for p in parts if not p.empty]
    for pick in merges:
        if len(parts) == 1:
            break
        a = parts.pop(pick % len(parts))
        parts[pick % len(parts)].merge(a)
    while len(parts) > 1:
        parts[0].merge(parts.pop())
    return parts[0].mean()


# float32 values 2**-28 <= |x| < 2**30 (and 0): 58 binades, inside the documented exact range for
# N <= 16 inputs of weight <= 1000 (N * W * max|x|/min|x| < 2**18 * 2**58 < 2**80)
mantissas = st.one_of(st.integers(2**23, 2**24 - 1), st.sampled_from([2**23, 2**23 + 1, 2**24 - 1]))
magnitudes = st.tuples(mantissas, st.integers(-28 - 23, 29 - 23))
weights_ = st.one_of(st.sampled_from([1, 2, 3, 1000]), st.integers(1, 1000))  # equal weights make ties


@st.composite
def weighted_inputs(draw):
    """Vectors mixing values of wide range with near-copies (ties) and negated copies of the same weight.

    The negated copies cancel exactly in the exact sum, so what is left can be far smaller than the
    inputs: a float64 sum loses it in some orders, and a mean near a float32 tie gets rounded by it.
    """
    n, d = draw(st.integers(1, 8)), draw(st.integers(1, 6))
    columns = []
    for _ in range(d):
        pool = draw(st.lists(magnitudes, min_size=1, max_size=3))
        column = []
        for _ in range(n):
            sign = draw(st.sampled_from([1, -1]))
            how = draw(st.sampled_from(["fresh", "near", "zero"]))
            if how == "zero":
                column.append(0.0)
            elif how == "fresh":
                m, e = draw(magnitudes)
                column.append(sign * m * 2.0**e)
            else:  # the same magnitude as another input, or one float32 ulp away, either sign
                m, e = draw(st.sampled_from(pool))
                column.append(sign * (m + draw(st.integers(-1, 1))) * 2.0**e)
        columns.append(column)
    vectors = [torch.tensor([c[i] for c in columns], dtype=torch.float32) for i in range(n)]
    assert all(float(v[k]) == columns[k][i] for i, v in enumerate(vectors) for k in range(d))  # exact float32s
    weights = draw(st.lists(weights_, min_size=n, max_size=n))
    mirrored = draw(st.lists(st.integers(0, n - 1), max_size=n, unique=True))
    return vectors + [-vectors[i] for i in mirrored], weights + [weights[i] for i in mirrored]


@settings(max_examples=400, deadline=None)
@given(
    data=weighted_inputs(),
    seed=st.integers(0, 2**32 - 1),
    chunk=st.sampled_from([1, 2, 4, 1 << 20]),
    fused=st.booleans(),
)
def test_mean_is_bit_identical_for_any_order_and_grouping_and_correctly_rounded(data, seed, chunk, fused):
    vectors, weights = data
    n = len(vectors)
    rng = random.Random(seed)
    with mock.patch.object(aggregation, "_CHUNK", chunk), path(fused):  # chunk boundaries inside the vectors too
        reference = combine(vectors, weights, range(n), [0] * n, [])
        assert reference.tolist() == exact_mean(vectors, weights)  # correctly rounded: 0 ulp from the exact mean
        for workers in (2, 3, 4):
            order = rng.sample(range(n), n)
            groups = [rng.randrange(workers) for _ in range(n)]
            merges = [rng.randrange(workers) for _ in range(workers)]
            assert bits(combine(vectors, weights, order, groups, merges)) == bits(reference)


@st.composite
def near_tie_inputs(draw):
    """Inputs whose exact mean is a float32 tie m plus or minus a hair (2**-30 .. 2**-70 of m).

    f (weight W - 2), g = 2f + k ulp(2f) (weight 1) and a tiny t (weight 1), W = 4k: the sum is
    W * (f + ulp(f) / 2) + t. Rounding the float64 quotient would settle most of these by
    ties-to-even; only the hair decides, and with a W that is no power of two it is not even
    representable in float64.
    """
    k = draw(st.integers(1, 16))
    mantissa, exponent = draw(st.integers(2**23, 2**24 - 1 - k)), draw(st.integers(-20, 20))
    sign = draw(st.sampled_from([1, -1]))
    f = sign * mantissa * 2.0**exponent
    g = sign * (mantissa + k) * 2.0 ** (exponent + 1)  # 2f + k ulp(2f): still 24 bits
    t = draw(st.sampled_from([1, -1])) * draw(mantissas) * 2.0 ** (exponent - draw(st.integers(30 - 23, 70 - 23)) - 23)
    vectors = [torch.tensor([v], dtype=torch.float32) for v in (f, g, t)]
    assert [float(v) for v in vectors] == [f, g, t]
    return vectors, [4 * k - 2, 1, 1]


@settings(max_examples=300, deadline=None)
@given(data=near_tie_inputs(), seed=st.integers(0, 2**32 - 1), fused=st.booleans())
def test_means_a_hair_from_a_float32_tie_are_correctly_rounded_in_any_order(data, seed, fused):
    vectors, weights = data
    rng = random.Random(seed)
    expected = exact_mean(vectors, weights)
    for workers in (1, 2, 3):
        order = rng.sample(range(3), 3)
        with path(fused):
            mean = combine(vectors, weights, order, [rng.randrange(workers) for _ in order], [1, 0])
        assert mean.tolist() == expected


def test_model_sized_sums_agree_across_1_2_and_4_workers_where_float64_sums_do_not(either_path):
    """Parameters of one element spread over six decades across clients: float64 sums then round, by grouping."""
    gen = torch.Generator().manual_seed(0)
    n = 200_000
    clients = [torch.randn(n, generator=gen) * 10 ** (torch.rand(n, generator=gen) * 6 - 6) for _ in range(24)]
    weights = torch.randint(30, 5000, (24,), generator=gen).tolist()
    means, float64_sums, rounded = [], [], 0
    for workers in (1, 2, 4):
        parts = [WeightedSum() for _ in range(workers)]
        plain = [torch.zeros(n, dtype=torch.float64) for _ in range(workers)]
        for i, (x, w) in enumerate(zip(clients, weights)):
            parts[i % workers].add(x, w)
            plain[i % workers] += x.double() * w
        for p in parts[1:]:
            parts[0].merge(p)
        rounded = max(rounded, int((parts[0].lo != 0).sum()))
        means.append(parts[0].mean())
        float64_sums.append(sum(plain))
    assert rounded > n // 10  # the float64 part alone rounds in many elements ...
    assert not all(torch.equal(t, float64_sums[0]) for t in float64_sums)  # ... differently by grouping,
    assert all(torch.equal(m.view(torch.int32), means[0].view(torch.int32)) for m in means)  # the means do not
    total = sum(weights)
    sample = torch.randperm(n, generator=gen)[:200].tolist()
    assert [means[0][i].item() for i in sample] == [
        nearest_float32(sum(Fraction(x[i].item()) * w for x, w in zip(clients, weights)) / total) for i in sample
    ]


def test_fused_loops_keep_the_bits_of_torch_passes_and_stop_at_a_full_batch_of_near_ties():
    """Both paths, every part of the sum: the same hi, lo and mean; a fused mean with more near ties than
    it collects at once (exact ties: means of neighbouring floats, to even) settles them all."""
    gen = torch.Generator().manual_seed(1)
    n = 50_000
    clients = [torch.randn(n, generator=gen) * 10 ** (torch.rand(n, generator=gen) * 8 - 8) for _ in range(6)]
    weights = [37, 61, 89, 113, 151, 173]
    sums = {}
    for fused in (False, True):
        with path(fused):
            a, b = WeightedSum(), WeightedSum()
            for i, (x, w) in enumerate(zip(clients, weights)):
                (a if i % 2 else b).add(x, w)
            a.merge(b)
            sums[fused] = (a.hi, a.lo, a.mean())
    assert all(torch.equal(t, f) for t, f in zip(sums[False], sums[True]))
    assert int((sums[True][1] != 0).sum()) > n // 10  # the lo part matters in these sums
    low = torch.tensor([1.0, 3.0, 5.0] * 7, dtype=torch.float32)
    high = torch.nextafter(low, torch.tensor(10.0))
    with path(True), mock.patch.object(aggregation, "_NEAR_CAPACITY", 4):
        ties = WeightedSum()
        ties.add(low, 1)
        ties.add(high, 1)
        mean = ties.mean()
    even = [lo_ if int(np.array(lo_, dtype=np.float32).view(np.int32)) % 2 == 0 else hi_
            for lo_, hi_ in zip(low.tolist(), high.tolist())]  # fmt: skip
    assert mean.tolist() == even


def test_near_ties_are_rounded_exactly(either_path):
    # 3 * (1 + 2**-23) / 4 lies exactly half-way between two float32s; -2**-80 tips it down, which
    # rounding the float64 quotient (a tie, so to even: up) would miss
    a, tiny = torch.tensor([1 + 2**-23, -(1 + 2**-23)]), torch.tensor([-(2.0**-80), 2.0**-80])
    for first, second in [((a, 3), (tiny, 1)), ((tiny, 1), (a, 3))]:
        s = WeightedSum()
        s.add(*first)
        s.add(*second)
        assert s.mean().tolist() == [0.75 + 2**-24, -(0.75 + 2**-24)]
    exact_tie = WeightedSum()  # exactly half-way: ties to even
    exact_tie.add(torch.tensor([1.0, 1 + 2**-23]), 1)
    exact_tie.add(torch.tensor([1 + 2**-23, 1 + 2**-22]), 1)
    assert exact_tie.mean().tolist() == [1.0, 1 + 2**-22]


def test_total_round_trip_errors_and_inputs_left_alone(either_path):
    x64 = torch.tensor([0.5, -3.0], dtype=torch.float64)
    s = WeightedSum()
    s.add(x64, 2)
    s.add(torch.tensor([1.25, 1.0]), 6)
    assert x64.tolist() == [0.5, -3.0]  # the first input is copied, not scaled in place
    assert s.weight == 8.0 and s.total.dtype == torch.float64 and s.total.tolist() == [8.5, 0.0]
    again = WeightedSum(s.total, s.weight)  # how bhfl_core/store/node_store.py reads a stored total back
    assert torch.equal(again.mean(), s.mean()) and again.mean().tolist() == [8.5 / 8, 0.0]
    other = WeightedSum()
    other.merge(again)  # into an empty sum: a copy
    other.merge(WeightedSum())  # an empty one: nothing
    assert torch.equal(other.mean(), s.mean()) and other.weight == 8.0
    assert WeightedSum().empty and WeightedSum().total is None and not s.empty
    with pytest.raises(ValueError, match="empty"):
        WeightedSum().mean()
    for weight in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="must be positive"):
            s.add(torch.ones(2), weight)
    with pytest.raises(ValueError, match="shape"):
        s.add(torch.ones(3), 1)


def test_inputs_and_stored_totals_of_any_memory_layout(either_path):
    x = torch.arange(12.0).reshape(3, 4).t()  # not contiguous: chunks of a flat view must still line up
    for start in (WeightedSum(), WeightedSum(x.double(), 1.0)):
        start.add(x, 2)
        start.add(x[:, :], 3)
        merged = WeightedSum()
        merged.merge(start)
        merged.merge(start)
        assert torch.equal(start.mean(), x) and torch.equal(merged.mean(), x)
