"""Placement of a cohort onto workers: each worker trains a list of clients in one task.

Longest-processing-time-first: clients sorted by size (largest first) go to the
least-loaded worker. This balances work like Pollen's load-balancing policy
(seeds/004, appendix) without needing throughput measurements.
"""

from __future__ import annotations

from collections.abc import Sequence


def split_by_load(items: Sequence[str], loads: Sequence[float], workers: int) -> list[list[str]]:
    """Split ``items`` into at most ``workers`` non-empty lists of balanced total load.

    Deterministic: ties are broken by the items' input order. Within a list, items
    keep their input order.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if len(items) != len(loads):
        raise ValueError("items and loads differ in length")
    order = sorted(range(len(items)), key=lambda i: (-loads[i], i))
    bins: list[list[int]] = [[] for _ in range(min(workers, len(items)))]
    totals = [0.0] * len(bins)
    for i in order:
        b = min(range(len(bins)), key=lambda k: (totals[k], k))
        bins[b].append(i)
        totals[b] += loads[i]
    return [[items[i] for i in sorted(b)] for b in bins if b]
