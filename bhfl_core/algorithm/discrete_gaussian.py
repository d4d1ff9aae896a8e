"""Distributed DP's noise and its accounting: discrete Gaussians added by each child under secure aggregation
(Kairouz, Liu & Steinke 2021, "The distributed discrete Gaussian mechanism for federated learning with secure
aggregation"), so no server ever sees an un-noised sum.

Sampling: Canonne, Kamath & Steinke 2020 ("The discrete Gaussian for differential
privacy"), Algorithm 3, vectorised: a discrete Laplace proposal of scale ``t = floor(sigma)
+ 1`` (the difference of two geometric draws), accepted with probability ``exp(-(|y| -
sigma^2/t)^2 / (2 sigma^2))``, the rejected ones drawn again. In float64 arithmetic, as TFF's
sampler, not the exact rational arithmetic of the paper's reference code.

Accounting (their Theorem 14): the sum of ``n`` independent ``N_Z(0, sigma^2)`` for a
vector of L2 sensitivity ``Delta`` is ``eps^2 / 2``-concentrated DP with
``eps = min(sqrt(Delta^2 / (n sigma^2) + 2 tau d), Delta / sqrt(n sigma^2) + tau sqrt(d))``,
``tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1))``, ``d`` the dimension. For
``sigma >= 10`` (required: ``MIN_SIGMA``) ``tau`` underflows to exactly 0 in float64, so the
figure does not depend on ``d``: ``rho = Delta^2 / (2 n sigma^2)`` a round, composed over
rounds by adding up, and converted to ``(epsilon, delta)`` by dp-accounting's RDP
accountant (``ZCDpEvent``). No amplification by sampling is claimed.
"""

from __future__ import annotations

import math

import numpy as np

MIN_SIGMA = 10.0
"""A child's noise std in integer units must reach this: ``tau`` is then below 1e-300, so dimension-free."""


def sample(sigma: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` draws of the discrete Gaussian ``N_Z(0, sigma^2)`` (int64)."""
    if sigma <= 0:
        return np.zeros(size, dtype=np.int64)
    t = math.floor(sigma) + 1
    out = np.empty(size, dtype=np.int64)
    todo = np.arange(size)
    p = -math.expm1(-1.0 / t)  # the geometric's success chance: 1 - exp(-1/t)
    while todo.size:
        n = todo.size
        y = rng.geometric(p, n) - rng.geometric(p, n)  # discrete Laplace of scale t
        accept = rng.random(n) < np.exp(-((np.abs(y) - sigma**2 / t) ** 2) / (2 * sigma**2))
        out[todo[accept]] = y[accept]
        todo = todo[~accept]
    return out


def tau(sigma: float, contributors: int) -> float:
    """Kairouz et al.'s ``tau`` for ``contributors`` children each adding ``N_Z(0, sigma^2)``."""
    return 10 * sum(math.exp(-2 * math.pi**2 * sigma**2 * k / (k + 1)) for k in range(1, contributors))


def round_rho(sensitivity: float, sigma: float, contributors: int) -> float:
    """One round's concentrated-DP ``rho``: ``contributors`` children each adding ``N_Z(0, sigma^2)`` to a sum of
    L2 ``sensitivity`` (integer units); ``sigma >= MIN_SIGMA``, so ``tau d`` is 0 for any dimension."""
    if sigma < MIN_SIGMA:
        raise ValueError(f"a child's discrete Gaussian std {sigma:.3g} is below {MIN_SIGMA}: tau would depend on d")
    spread = math.sqrt(contributors) * sigma
    assert tau(sigma, contributors) == 0.0
    return (sensitivity / spread) ** 2 / 2


def epsilon(rho: float, rounds: int, delta: float) -> float:
    """Epsilon at ``delta`` of ``rounds`` rounds of ``rho``-zCDP (dp-accounting's RDP accountant)."""
    if rounds <= 0:
        return 0.0
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    accountant = RdpAccountant()
    accountant.compose(dp_accounting.ZCDpEvent(rho), rounds)
    return float(accountant.get_epsilon(delta))
