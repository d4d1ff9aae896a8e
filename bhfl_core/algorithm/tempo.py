"""Tempo (seeds/001): the root retunes each institution's client epochs after every global round.

Three layers: root -> institutions (edge servers) -> clients, FedAvg at both server
levels. After global (root) round t the root computes, for every institution m,

    omega_m(t) = ||w^(m)(t) - w^(root)(t)||

(the institution's model as sent up in round t against the root's model at the end of
round t) and the local epochs of m's clients in round t+1 by Eq. 9::

    tau_m(t+1) = ceil( (c/2) / (min_i ln w_i - max_j ln w_j)
                       * (3 ln w_m + min_i ln w_i - 4 max_j ln w_j) )

with ``c`` the epochs of the first round (the configured ``train.epochs``). Writing
``s_m = (max_j ln w_j - ln w_m) / (max_j ln w_j - min_i ln w_i)`` (0 for the largest
omega, 1 for the smallest), Eq. 9 is exactly ``ceil(c/2 * (1 + 3 s_m))``: the institution
farthest from the root model trains ``ceil(c/2)`` epochs, the closest ``2c``, linearly in
``ln omega`` in between. ``tempo_epochs`` evaluates this form, which has no cancellation.

Choices where Eq. 9 is undefined or fragile (docs/algorithm.md):

- ``omega = 0`` (an institution whose model equals the root's; ``ln 0 = -inf``): omega is
  clamped to ``OMEGA_FLOOR`` (1e-12) before the logarithm, so it counts as the closest
  institution (``2c`` epochs) and the others stay finite.
- all omegas equal (``min = max``: Eq. 9 divides by zero), or within a relative
  ``EQUAL_LOG_TOL`` of each other in ``ln`` (float noise would pick arbitrary points of
  ``[c/2, 2c]``): every institution keeps ``c`` epochs. A single institution is this case.
- the value inside the ceiling is rounded to 9 decimals first, so an exact integer
  computed with a float error above it (6.000000000000001) does not ceil to the next one.
- the result is clamped to at least 1 epoch.
- a negative or non-finite omega is an error.

The schedule file (``SCHEDULE_FILE`` in the run's ``state/``) maps the 0-based root round
in which epochs are *used* to ``{"epochs": {edge: int}, "omega": {edge: float}}``; round 0
and a missing edge use ``c``. Entry ``t + 1`` depends only on round t, so a resumed run
reads what the first attempt wrote (or recomputes the same numbers).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

OMEGA_FLOOR = 1e-12
EQUAL_LOG_TOL = 1e-9


def omega(edge_theta: torch.Tensor, root_theta: torch.Tensor) -> float:
    """``||w_m - w_root||`` of two flat parameter vectors, computed in float64."""
    diff = edge_theta.to(torch.float64) - root_theta.to(torch.float64)
    return float(torch.linalg.vector_norm(diff))


def _log_omega(value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"Tempo: omega must be finite and >= 0, got {value!r}")
    return math.log(max(value, OMEGA_FLOOR))


def tempo_epochs(omegas: Mapping[str, float], c: int) -> dict[str, int]:
    """Eq. 9 of seeds/001: each institution's client epochs for the next global round.

    ``omegas`` maps institution id -> ``||w_m - w_root||`` of the round just finished;
    ``c`` is the first round's epochs. Returns institution id -> epochs (>= 1), in the
    order of ``omegas``. See the module docstring for the degenerate cases.
    """
    if c < 1:
        raise ValueError(f"Tempo: c (the first round's epochs) must be >= 1, got {c}")
    logs = {m: _log_omega(w) for m, w in omegas.items()}
    if not logs:
        return {}
    lo, hi = min(logs.values()), max(logs.values())
    span = hi - lo
    if span <= EQUAL_LOG_TOL * max(1.0, abs(hi), abs(lo)):
        return dict.fromkeys(logs, c)
    epochs: dict[str, int] = {}
    for m, log_w in logs.items():
        s = min(max((hi - log_w) / span, 0.0), 1.0)
        epochs[m] = max(1, math.ceil(round(c / 2 * (1 + 3 * s), 9)))
    return epochs


def eq9_direct(omegas: Mapping[str, float], c: int) -> dict[str, float]:
    """Eq. 9 exactly as printed (before the ceiling), for checking ``tempo_epochs``; omegas > 0, not all equal."""
    logs = {m: math.log(w) for m, w in omegas.items()}
    lo, hi = min(logs.values()), max(logs.values())
    return {m: (c / 2) / (lo - hi) * (3 * log_w + lo - 4 * hi) for m, log_w in logs.items()}
