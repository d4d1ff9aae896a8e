"""Deterministic random draws keyed by (seed, node, round, purpose).

Every random decision in an experiment (cohort sampling, data order, model init) is
derived from the experiment seed and *where* it happens, never from a global RNG, so
that a resumed or re-ordered run replays the same draws.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def _stable_int(text: str) -> int:
    """A process-independent 32-bit integer for a string (``hash()`` is salted per process)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")


def derive_seed(seed: int, *keys: str | int) -> int:
    """A 63-bit seed derived from the experiment seed and a path of keys."""
    entropy = [int(seed)] + [k if isinstance(k, int) else _stable_int(k) for k in keys]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> np.uint64(1))


def generator(seed: int, *keys: str | int) -> np.random.Generator:
    """A numpy Generator for one (seed, keys...) position."""
    return np.random.default_rng(derive_seed(seed, *keys))


def sample_cohort(
    children: Sequence[T], size: int | None, seed: int, node_id: str, round_index: int, rate: float | None = None
) -> list[T]:
    """The round's cohort: ``size`` children drawn without replacement (all of them when ``size`` is None), or,
    with ``rate``, each child independently with that chance (Poisson sampling: any number, none included).

    The order of the returned cohort follows the order of ``children`` so that
    aggregation order, and hence floating-point sums, do not depend on the draw.
    """
    if rate is not None:
        chances = generator(seed, "cohort", node_id, round_index).random(len(children))
        return [child for child, chance in zip(children, chances.tolist()) if chance < rate]
    if size is None or size >= len(children):
        return list(children)
    rng = generator(seed, "cohort", node_id, round_index)
    picked = sorted(rng.choice(len(children), size=size, replace=False).tolist())
    return [children[i] for i in picked]
