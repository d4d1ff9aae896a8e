"""Epsilon spent by a DP server's clients, from Google's ``dp-accounting`` (its RDP accountant).

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

from bhfl_core.algorithm.privacy_params import PrivacyParams


def epsilon(params: PrivacyParams, rounds: int) -> float:
    """Epsilon at ``params.delta`` after ``rounds`` rounds of the node (inf without noise, 0 before any round)."""
    return _epsilon(params.population, params.expected, params.noise_multiplier, rounds, params.delta)


@functools.lru_cache(maxsize=4096)  # pure function of its arguments; every node asks once per round
def _epsilon(population: int, expected: int, noise_multiplier: float, rounds: int, delta: float) -> float:
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    logging.getLogger("absl").setLevel(logging.ERROR)  # per-order convergence notes, not errors
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier / 2)  # replace-one: sensitivity 2C
    step: dp_accounting.DpEvent = (
        gaussian
        if expected >= population
        else dp_accounting.SampledWithoutReplacementDpEvent(population, expected, gaussian)
    )
    accountant = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_accounting.SelfComposedDpEvent(step, rounds))
    return float(accountant.get_epsilon(delta))
