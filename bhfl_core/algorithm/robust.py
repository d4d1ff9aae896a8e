"""Byzantine-robust aggregation as pure functions over a round's stacked models.

Each function takes the round's members sorted by name (``stacked.StackedModels.ordered``)
and returns one float32 vector, the input the node's NODEOPT_up steps towards:

- ``coordinate_median``: per coordinate, the median of the children's values, unweighted
  (Yin et al. 2018; Flower's ``aggregate_median``: ``np.median(axis=0)``); for an even
  count, the mean of the two middle values.
- ``trimmed_mean``: per coordinate, the ``int(trim * k)`` smallest and largest values cut,
  the rest averaged, unweighted (Yin et al. 2018; Flower's ``aggregate_trimmed_avg``,
  which follows ``scipy.stats.trim_mean(proportiontocut=trim)``).
- ``krum``: every child scored by the sum of its squared L2 distances to its
  ``max(1, k - f - 2)`` nearest others; Krum returns the best-scored model, Multi-Krum
  (``keep = m > 1``) the example-weighted mean of the ``m`` best (Blanchard et al. 2017;
  Flower's ``aggregate_krum(results, num_malicious=f, to_keep=m)``).

The same bits on every device, thread count and worker layout. The members come in one
order (sorted names) and every sum is taken in a fixed order with elementwise float64
operations only (IEEE-exact in torch on CPUs and GPUs alike): a trimmed mean adds a
coordinate's kept values in sorted-value order; a squared distance is summed by a fixed
halving tree over each ``BLOCK`` of coordinates, the blocks then in order; Multi-Krum's
mean is ``WeightedSum``'s exact one. Sorting is exact, and values are made canonical
first (``-0.0`` is ``0.0``; one NaN), so a sorted column is the same bits whichever sort
ran. Ties in Krum's scores go to the member whose name sorts first. So a worker that
holds a whole round may compute the result where it folded it
(``AggregationRule.close``): the parent would get the same.

Choices where the papers and Flower are silent: NaN sorts above every number (torch's
and numpy's order), so a minority of diverged children is cut like any outlier where
Flower's ``np.median`` would return NaN; for Krum a model holding NaN or inf is at
distance ``inf`` from every other, so it is never chosen while a finite one is. The
median and trimmed mean ignore the weights, as Flower's do (a weighted median would let
one large child decide the round). The median of an even count is ``(a + b) / 2``
computed in float64 and rounded once (numpy rounds ``a + b`` to float32 first: they can
differ in the last bit).

Costs, ``k`` children of ``P`` parameters: the median and trimmed mean sort ``k`` values
per coordinate (``O(kP log k)``); Krum computes ``k(k-1)/2`` distances (``O(k^2 P)``
float64 operations). Scratch beyond the rows (``stacked.py``): a few ``[k, BLOCK]``
blocks. Measured at P = 10M on one thread of a shared 2-core VM (the mean: 0.06 s):
k = 10, median 1.7 s, trimmed mean 2.3 s, Krum 1.1 s, Multi-Krum (m = 3) 1.8 s; k = 20,
median 2.2 s, Krum 7.5 s. Sorting canonical values with numpy's quicksort instead of
torch's stable sort on dim 0 took the median's sorts from 5.7 s to 1.2 s (k = 10).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from bhfl_core.algorithm.aggregation import WeightedSum
from bhfl_core.algorithm.stacked import BLOCK, Member, column_blocks


def coordinate_median(members: list[Member]) -> torch.Tensor:
    """The coordinate-wise median of the members' models (unweighted)."""
    return _per_block(members, _median_of)


def trimmed_mean(members: list[Member], trim: float) -> torch.Tensor:
    """The coordinate-wise mean of what is left after cutting ``int(trim * k)`` values from each end (unweighted)."""
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim is the fraction cut from each end: it must lie in [0, 0.5), got {trim}")
    cut = int(trim * len(members))
    return _per_block(members, lambda block: _mean_between(block, cut, block.shape[0] - cut))


def _per_block(members: list[Member], reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``reduce`` (``[k, n]`` block -> ``[n]`` float32) applied to every column block, into one vector."""
    if not members:
        raise ValueError("cannot aggregate an empty round")
    out = torch.empty(members[0].row.numel(), dtype=torch.float32, device=members[0].row.device)
    for i, block in enumerate(column_blocks(members)):
        out[i * BLOCK : i * BLOCK + block.shape[1]] = reduce(block)
    return out


def _median_of(block: torch.Tensor) -> torch.Tensor:
    k = block.shape[0]
    if k % 2:
        return _sorted(block)[k // 2]
    return _mean_between(block, k // 2 - 1, k // 2 + 1)


def _sorted(block: torch.Tensor) -> torch.Tensor:
    """Each column sorted, NaN last. Canonical first (``-0.0`` becomes ``0.0``, every NaN the same NaN), so equal
    values have equal bits and the sorted column is one tensor whatever the algorithm: on a CPU numpy's SIMD
    quicksort along contiguous rows (4-5x torch's sort of ``[k, 65536]`` blocks on dim 0), elsewhere torch's."""
    canonical = torch.where(torch.isnan(block), torch.nan, block + 0.0)  # -0.0 + 0.0 = 0.0
    if canonical.device.type != "cpu":
        return torch.sort(canonical, dim=0).values
    rows = canonical.T.contiguous().numpy()  # [n, k]: one row per coordinate
    rows.sort(axis=1)
    return torch.from_numpy(rows).T


def _mean_between(block: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Per column, the mean of the sorted values ``lo`` to ``hi - 1``: added in that order in float64, rounded once."""
    values = _sorted(block)[lo:hi]
    total = values[0].double()
    for row in values[1:]:
        total += row.double()
    return (total / (hi - lo)).float()


def krum(members: list[Member], byzantine: int, keep: int = 1) -> torch.Tensor:
    """Krum (``keep == 1``: the best-scored member's model) or Multi-Krum (the weighted mean of the ``keep`` best)."""
    if not 1 <= keep <= len(members):
        raise ValueError(f"Multi-Krum keeps 1 to {len(members)} of {len(members)} models, not {keep}")
    chosen = krum_choice(members, byzantine, keep)
    if keep == 1:
        return chosen[0].row.float().clone()
    total = WeightedSum()
    for m in chosen:
        total.add(m.row, m.weight)
    return total.mean()


def krum_choice(members: list[Member], byzantine: int, keep: int = 1) -> list[Member]:
    """The ``keep`` members with the lowest Krum scores, best first (ties: the name that sorts first)."""
    scores = krum_scores(members, byzantine)
    ranked = sorted(range(len(members)), key=lambda i: (scores[i], members[i].name))
    return [members[i] for i in ranked[:keep]]


def krum_scores(members: list[Member], byzantine: int) -> list[float]:
    """Each member's score: the sum of its squared distances to its ``max(1, k - f - 2)`` nearest others."""
    k = len(members)
    nearest = max(1, k - byzantine - 2)
    distances = squared_distances(members)
    scores = []
    for i in range(k):
        others = sorted(distances[i][j] for j in range(k) if j != i)
        scores.append(math.fsum(others[:nearest]))
    return scores


def squared_distances(members: list[Member]) -> list[list[float]]:
    """``||x_i - x_j||^2`` for every pair, in float64, the same bits on any device (module docstring); ``inf`` where
    a model holds NaN or inf (as numpy's argsort puts NaN last in Flower's, so such a model is never chosen)."""
    k = len(members)
    upper = torch.zeros(k, k, dtype=torch.float64)
    for block in column_blocks(members):
        wide = torch.zeros(k, BLOCK, dtype=torch.float64, device=block.device)
        wide[:, : block.shape[1]] = block  # zero-padded to a full block: one summation tree for every block
        for i in range(k - 1):
            diff = wide[i + 1 :] - wide[i]
            upper[i, i + 1 :] += _halving_sum(diff.mul_(diff)).cpu()
    full = upper + upper.T  # exact: one of each pair is zero
    return torch.where(torch.isnan(full), math.inf, full).tolist()  # a diverged model is infinitely far


def _halving_sum(values: torch.Tensor) -> torch.Tensor:
    """Each row's sum by a fixed binary tree (its width a power of two): elementwise adds only, so no kernel's own
    reduction order (threads, SIMD width, GPU) enters the result."""
    width = values.shape[1]
    while width > 1:
        width //= 2
        values = values[:, :width] + values[:, width:]
    return values[:, 0]
