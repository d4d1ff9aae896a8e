"""Epsilon spent by a DP server's clients, and by a DP-SGD client's examples, from Google's ``dp-accounting``.

Both use its RDP accountant; RDP adds up over steps, so one step's curve is computed once
per setting and scaled by the number of steps (``_epsilon``), which is exactly what the
accountant's own composition does.

Each round of a DP server is one sampled Gaussian mechanism on its children's clipped
updates: a cohort of ``m`` drawn *without replacement* from its ``n`` children
(``rng.sample_cohort``), so the neighbouring relation is *replace one* (one child's data
swapped for another's, the relation fixed-size sampling supports). Replacing one update
moves the clipped sum by up to ``2C``, so the Gaussian event's noise multiplier (noise
std over sensitivity) is ``z / 2``. Rounds compose: after ``T`` rounds of the node the
accountant composes ``T`` such events. ``m == n`` (no sampling) is the plain Gaussian
mechanism, composed the same way.

Literature that samples with Poisson and counts add/remove-one neighbours reports a
smaller epsilon for the same ``z`` (sensitivity ``C``); ours is the one that holds for the
sampling this pipeline does. With adaptive clipping, ``z`` is the total noise multiplier
(Andrew et al. 2021, Theorem 1): the count's noise is part of it.
"""

from __future__ import annotations

import functools
import logging
import math

import numpy as np

from bhfl_core.algorithm.privacy_params import DpSgdParams, PrivacyParams


def epsilon(params: PrivacyParams, rounds: int) -> float:
    """Epsilon at ``params.delta`` after ``rounds`` rounds of the node (inf without noise, 0 before any round)."""
    if rounds <= 0:
        return 0.0
    if params.noise_multiplier <= 0:
        return math.inf
    orders, step = _server_step(params.population, params.expected, params.noise_multiplier)
    return _epsilon(orders, step, rounds, params.delta)


def sample_epsilon(params: DpSgdParams, examples: int, batch_size: int, steps: int) -> float:
    """A client's epsilon at ``params.delta`` after ``steps`` DP-SGD steps over its ``examples`` rows.

    Its TRAIN calls take batches of ``batch_size`` of its rows, shuffled; each step counts
    as a Poisson-sampled Gaussian with rate ``batch_size / examples`` under add/remove-one
    neighbours (one example more or less): the approximation DP-SGD's papers (Abadi et
    al. 2016) and Opacus report for shuffled batches.
    """
    if steps <= 0:
        return 0.0
    if params.noise_multiplier <= 0:
        return math.inf
    orders, step = _sample_step(min(1.0, batch_size / max(examples, 1)), params.noise_multiplier)
    return _epsilon(orders, step, steps, params.delta)


def _epsilon(orders: tuple[float, ...], step: tuple[float, ...], count: int, delta: float) -> float:
    """Epsilon of ``count`` compositions of one step's RDP curve: RDP adds up, so ``count * step`` per order."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    return float(compute_epsilon(orders, count * np.asarray(step), delta)[0])


@functools.lru_cache(maxsize=256)  # one step's RDP curve: the costly part (~0.7 s for a small population)
def _server_step(
    population: int, expected: int, noise_multiplier: float
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    logging.getLogger("absl").setLevel(logging.ERROR)  # per-order convergence notes, not errors
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier / 2)  # replace-one: sensitivity 2C
    event: dp_accounting.DpEvent = (
        gaussian
        if expected >= population
        else dp_accounting.SampledWithoutReplacementDpEvent(population, expected, gaussian)
    )
    accountant = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(event)
    return tuple(accountant.orders), tuple(accountant.rdp)


@functools.lru_cache(maxsize=256)
def _sample_step(rate: float, noise_multiplier: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    logging.getLogger("absl").setLevel(logging.ERROR)
    accountant = RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(noise_multiplier)))
    return tuple(accountant.orders), tuple(accountant.rdp)
