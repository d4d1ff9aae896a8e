"""An empirical privacy audit of a DP server: canary clients with random update directions, and the epsilon their
traces in the published models imply (Andrew et al. 2024, "One-shot empirical privacy estimation for federated
learning").

With ``eval.privacy_audit.canaries: k`` every DP server draws ``2k`` random unit directions
``u_i`` in its model's space, from (run seed, server, i). The first ``k`` are *inserted*:
each round, each of them is a child with the same chance as a real one
(``expected / population``) and, when in, adds ``C u_i`` to the clipped sum before the
noise: a canary client whose update is always clipped to exactly ``C``. The other ``k`` are
never inserted. After each round the server adds ``<published update, u_i>`` to canary
``i``'s statistic (its rule state, so a resumed run goes on with it): the statistic is
``<sum of the published updates, u_i>``, which for unit ``u_i`` is the cosine Andrew et al.
measure, up to one factor common to every canary (the norm of that sum).

The estimate: the statistics of the inserted and of the held-out canaries, each taken as a
Gaussian (their mean and standard deviation), and the epsilon at ``delta`` of telling the
two Gaussians apart (the larger of the two directions; computed numerically,
``gaussians_epsilon``). A point estimate from ``k`` samples of each, not a bound: the
analytical epsilon is the bound, and the audit checks that the mechanism does not leak
visibly more. With ``noise_multiplier: 0`` the inserted canaries stand out and the
estimate is large.

Cost: ``2k`` random vectors of the model's size a round (generated, used, dropped: nothing
of model size is kept per canary). The canaries change the run they audit: an audit is a
run of its own (``bhfl run CONFIG --set eval.privacy_audit.canaries=200``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from bhfl_core.algorithm.node_state import RoundKey
from bhfl_core.algorithm.privacy_params import CanaryParams
from bhfl_core.rng import derive_seed, generator

STAT = "canary/"  # rule-state keys: canary/<i>, inserted for i < k, held out from k on


def direction(params: CanaryParams, index: int, numel: int) -> torch.Tensor:
    """Canary ``index``'s unit direction (float64, CPU): a seeded Gaussian vector, normalised."""
    gen = torch.Generator().manual_seed(derive_seed(params.seed, "direction", index))
    u = torch.randn(numel, generator=gen, dtype=torch.float64)
    return u.div_(float(torch.linalg.vector_norm(u)))


def inserted(params: CanaryParams, key: RoundKey, rate: float) -> list[int]:
    """The inserted canaries in round ``key``: each with chance ``rate``, drawn from (seed, round)."""
    chances = generator(params.seed, "member", *key.parts()).random(params.count)
    return [i for i, chance in enumerate(chances.tolist()) if chance < rate]


def insert(summed: torch.Tensor, params: CanaryParams, key: RoundKey, rate: float, clip: float) -> torch.Tensor:
    """``summed`` (the round's exact sum of clipped updates, float64) plus ``clip * u_i`` for each canary in."""
    out = summed.clone()
    for i in inserted(params, key, rate):
        out += clip * direction(params, i, summed.numel()).to(summed.device)
    return out


def observe(update: torch.Tensor, params: CanaryParams, state: Mapping[str, float]) -> dict[str, float]:
    """``state`` with ``<update, u_i>`` added to every canary's statistic (``update``: the round's published change)."""
    flat = update.reshape(-1).to(torch.float64).cpu()
    out = dict(state)
    for i in range(2 * params.count):
        out[f"{STAT}{i}"] = out.get(f"{STAT}{i}", 0.0) + float(flat @ direction(params, i, flat.numel()))
    return out


def statistics(state: Mapping[str, float], count: int) -> tuple[list[float], list[float]]:
    """The inserted and the held-out canaries' statistics from a server's rule state."""
    values = [state.get(f"{STAT}{i}", 0.0) for i in range(2 * count)]
    return values[:count], values[count:]


def empirical_epsilon(inserted_stats: Sequence[float], held_out: Sequence[float], delta: float) -> float:
    """Epsilon at ``delta`` between the two samples, each fitted by a Gaussian (Andrew et al. 2024, section 3)."""
    mu1, s1 = _fit(inserted_stats)
    mu0, s0 = _fit(held_out)
    return max(gaussians_epsilon(mu1, s1, mu0, s0, delta), gaussians_epsilon(mu0, s0, mu1, s1, delta))


def gaussians_epsilon(mu_p: float, s_p: float, mu_q: float, s_q: float, delta: float) -> float:
    """The smallest epsilon with ``sup_S P(S) - e^eps Q(S) <= delta`` for P = N(mu_p, s_p^2), Q = N(mu_q, s_q^2).

    The supremum is over the set where ``p > e^eps q``, integrated on a grid of 200,001
    points over 12 standard deviations around both means (error far below 1e-9 here).
    """
    import numpy as np
    from scipy.stats import norm

    low = min(mu_p - 12 * s_p, mu_q - 12 * s_q)
    high = max(mu_p + 12 * s_p, mu_q + 12 * s_q)
    x = np.linspace(low, high, 200_001)
    step = x[1] - x[0]
    log_p, log_q = norm.logpdf(x, mu_p, s_p), norm.logpdf(x, mu_q, s_q)

    def excess(eps: float) -> float:
        return float(np.sum(np.maximum(np.exp(log_p) - np.exp(eps + log_q), 0.0)) * step)

    if excess(0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while excess(hi) > delta:
        lo, hi = hi, hi * 2
        if hi > 1e4:
            return math.inf
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) > delta else (lo, mid)
    return hi


def _fit(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    if n < 2:
        raise ValueError("the audit needs at least 2 canaries of each kind")
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, max(math.sqrt(var), 1e-300)
