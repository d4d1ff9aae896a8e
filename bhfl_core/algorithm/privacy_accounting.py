"""Epsilon spent by a DP server's children, and by a DP-SGD client's examples, from Google's ``dp-accounting``.

Two accountants, chosen per server (``privacy.accountant``) and per DP-SGD client
(``train.dp_sgd.accountant``):

- ``pld``: privacy loss distributions (Meiser & Mohammad 2018; Koskela et al. 2020), a
  pessimistic discretisation, so the figure is an upper bound within ~1e-4 of the tight one.
- ``rdp``: Renyi DP (Mironov 2017), the looser figure most papers before 2021 report.

Each round of a DP server is one Gaussian mechanism on its children's clipped updates,
with one of two samplings (docs/privacy.md, "Accounting"):

- **fixed-size cohorts** (the default): ``m`` of the ``n`` children drawn *without
  replacement* (``rng.sample_cohort``), so neighbouring datasets differ by one child's
  data *replaced*, which moves the clipped sum by up to ``2C``. Without sampling
  (``m == n``, or an asynchronous server's flush) the ``T``-fold composition is exactly
  the Gaussian mechanism with noise multiplier ``z / (2 sqrt(T))``: ``pld`` computes it in
  closed form (Balle & Wang 2018; what dp-accounting's PLD accountant gives for
  ``GaussianDpEvent(z)`` under ``REPLACE_ONE``, to 1e-9: tests/core/test_privacy.py). With
  ``m < n`` dp-accounting's PLD has no event for sampling without replacement, so ``pld``
  reports the smaller of two valid bounds: the unsampled exact figure and RDP's
  without-replacement bound (Wang, Balle & Kasiviswanathan 2019). ``rdp`` reports the
  latter alone.
- **Poisson cohorts** (``sampling: poisson``): each child in a round independently with
  probability ``q``; neighbours differ by one child *added or removed* (sensitivity ``C``:
  the mean's denominator ``q n`` is fixed), the setting of McMahan et al. 2018, accounted
  as ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` by either accountant.

With adaptive clipping ``z`` is the total noise multiplier (Andrew et al. 2021, Theorem 1).
``calibrate`` finds the smallest ``z`` whose epsilon after the planned rounds is within a
target (``privacy.target_epsilon``).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Literal

from bhfl_core.algorithm.privacy_params import DpSgdParams, PrivacyParams

Accountant = Literal["pld", "rdp"]


def epsilon(params: PrivacyParams, rounds: int) -> float:
    """Epsilon at ``params.delta`` after ``rounds`` rounds of the node (inf without noise, 0 before any round)."""
    if params.distributed:
        return distributed_epsilon(params.noise_multiplier, rounds, params.delta)
    return server_epsilon(
        params.noise_multiplier,
        rounds,
        params.expected,
        params.population,
        params.poisson,
        params.delta,
        params.accountant,
    )


def distributed_epsilon(noise_multiplier: float, rounds: int, delta: float) -> float:
    """Distributed DP's epsilon (``discrete_gaussian.py``): ``rounds`` rounds of ``rho = 2 / z^2``-zCDP.

    The plan sets each of the at least ``t`` contributing children's discrete Gaussian std to
    ``z C 2^f / sqrt(t)`` (integer units, ``f`` the fixed point's fraction bits) and bounds
    each child's integer vector to L2 ``C 2^f``, so replacing one moves the sum by ``2 C 2^f``:
    ``rho = (2 C 2^f)^2 / (2 t (z C 2^f)^2 / t) = 2 / z^2``. No amplification by sampling.
    """
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    from bhfl_core.algorithm.discrete_gaussian import epsilon as zcdp_epsilon

    return zcdp_epsilon(2 / noise_multiplier**2, rounds, delta)


@functools.lru_cache(maxsize=4096)  # a server logs it every round; a calibration asks it ~30 times
def server_epsilon(
    noise_multiplier: float,
    rounds: int,
    expected: float,
    population: int,
    poisson: bool,
    delta: float,
    accountant: Accountant,
) -> float:
    """A DP server's epsilon: ``rounds`` Gaussian mechanisms at ``noise_multiplier`` on cohorts of ``expected`` of
    ``population`` children (Poisson: ``expected / population`` is each child's chance)."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    if poisson:
        return _poisson_epsilon(expected / population, noise_multiplier, rounds, delta, accountant)
    if expected >= population:
        return _unsampled_epsilon(noise_multiplier / 2, rounds, delta, accountant)
    sampled = _rdp_epsilon(_without_replacement(population, int(expected), noise_multiplier), rounds, delta)
    if accountant == "rdp":
        return sampled
    return min(sampled, _unsampled_epsilon(noise_multiplier / 2, rounds, delta, "pld"))


def sample_epsilon(params: DpSgdParams, examples: int, batch_size: int, steps: int) -> float:
    """A DP-SGD client's epsilon at ``params.delta`` after ``steps`` steps over the ``examples`` rows it trains on.

    Each step is a Poisson-sampled batch (each row with probability ``batch_size /
    examples``, ``learning/local_train.py``), so the Poisson subsampled Gaussian under
    add/remove-one neighbours (one example more or less) is exactly what happened.
    """
    if steps <= 0:
        return 0.0
    if params.noise_multiplier <= 0:
        return math.inf
    rate = min(1.0, batch_size / max(examples, 1))
    return _poisson_epsilon(rate, params.noise_multiplier, steps, params.delta, params.accountant)


def calibrate(target: float, spent: Callable[[float], float], guess: float = 1.0, step: float = 2.0) -> float:
    """The smallest noise multiplier ``z`` (to a relative 1e-3, rounded up) with ``spent(z) <= target``.

    ``spent`` must decrease in ``z``. From ``guess`` the bracket widens by factors of
    ``step`` until it holds the answer, then bisection on ``log z``. A PLD call costs ~0.3 s
    near the answer (much more at a tiny ``z``), so a good ``guess`` with a small ``step``
    (RDP's answer: ``calibrate_server``) saves most of the time. The result is always on
    the safe side: ``spent(z) <= target``.
    """
    if not target > 0:
        raise ValueError(f"a target epsilon must be positive, got {target}")
    low = high = guess
    while spent(high) > target:
        low, high = high, high * step
        if high > 1e6:
            raise ValueError(f"no noise multiplier up to 1e6 reaches epsilon {target}")
    while low == high or spent(low) <= target:
        if low < 1e-3:
            return low  # so little noise already suffices (a huge target)
        low, high = low / step, low
    while high / low > 1 + 1e-3:
        mid = math.sqrt(low * high)
        low, high = (low, mid) if spent(mid) <= target else (mid, high)
    return high


def calibrate_server(
    target: float, rounds: int, expected: float, population: int, poisson: bool, delta: float, accountant: Accountant
) -> float:
    """A DP server's noise multiplier for epsilon ``target`` after ``rounds`` rounds (``server_epsilon``'s terms).

    PLD's answer is searched from RDP's (cheap, and never below PLD's need: RDP's epsilon
    is the larger), so the PLD accountant is called only near the answer.
    """

    def spent(which: Accountant) -> Callable[[float], float]:
        return lambda z: server_epsilon(z, rounds, expected, population, poisson, delta, which)

    rdp = calibrate(target, spent("rdp"))
    return rdp if accountant == "rdp" else calibrate(target, spent("pld"), guess=rdp, step=1.25)


def _unsampled_epsilon(noise_multiplier: float, count: int, delta: float, accountant: Accountant) -> float:
    """``count`` Gaussian mechanisms of noise multiplier ``noise_multiplier`` (over the sensitivity), composed."""
    if accountant == "pld":  # exact: the composition of Gaussians is the Gaussian of std sigma / sqrt(count)
        from dp_accounting.gaussian_mechanism import get_epsilon_gaussian

        return float(get_epsilon_gaussian(noise_multiplier / math.sqrt(count), delta))
    import dp_accounting

    return _rdp_epsilon(_rdp_curve(dp_accounting.GaussianDpEvent(noise_multiplier)), count, delta)


def _poisson_epsilon(rate: float, noise_multiplier: float, count: int, delta: float, accountant: Accountant) -> float:
    import dp_accounting

    if rate >= 1:
        return _unsampled_epsilon(noise_multiplier, count, delta, accountant)
    event = dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(noise_multiplier))
    if accountant == "rdp":
        return _rdp_epsilon(_rdp_curve(event), count, delta)
    from dp_accounting.pld import PLDAccountant

    pld = PLDAccountant()  # add/remove-one; value discretisation 1e-4, pessimistic
    pld.compose(event, count)
    return float(pld.get_epsilon(delta))


def _without_replacement(
    population: int, expected: int, noise_multiplier: float
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """One round's RDP curve for a fixed-size cohort: sampled without replacement, replace-one (``2C``)."""
    import dp_accounting

    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier / 2)
    return _rdp_curve(dp_accounting.SampledWithoutReplacementDpEvent(population, expected, gaussian), replace=True)


def _rdp_epsilon(curve: tuple[tuple[float, ...], tuple[float, ...]], count: int, delta: float) -> float:
    """Epsilon of ``count`` compositions of one step's RDP curve: RDP adds up, so ``count * step`` per order."""
    import numpy as np
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    orders, step = curve
    return float(compute_epsilon(orders, count * np.asarray(step), delta)[0])


@functools.lru_cache(maxsize=256)  # one step's RDP curve: the costly part (~0.7 s for a small population)
def _rdp_curve(event: object, replace: bool = False) -> tuple[tuple[float, ...], tuple[float, ...]]:
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    logging.getLogger("absl").setLevel(logging.ERROR)  # per-order convergence notes, not errors
    relation = dp_accounting.NeighboringRelation
    accountant = RdpAccountant(neighboring_relation=relation.REPLACE_ONE if replace else relation.ADD_OR_REMOVE_ONE)
    assert isinstance(event, dp_accounting.DpEvent)
    accountant.compose(event)
    return tuple(accountant.orders), tuple(accountant.rdp)
