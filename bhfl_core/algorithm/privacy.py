"""Client-level differential privacy at a server: DP-FedAvg's clipped, noised mean.

A server with the ``dp`` wrapper (``privacy:``) folds its children with ``DpRule`` (``dp_rule.py``) instead of
the exact weighted mean (McMahan et al. 2018, "Learning differentially private recurrent language
models"; adaptive clipping from Andrew et al. 2021, "Differentially private learning
with adaptive clipping"):

- each child's *update* ``d_i = x_i - theta`` (its model minus the model the server sent
  down this round) is clipped to L2 norm ``C``: ``d_i * min(1, C / ||d_i||)``;
- the clipped updates are summed exactly by the sum the wrapper wraps (``WeightedSum``, or
  secure aggregation's masked sum; every child weight 1: example counts would make the
  sum's sensitivity depend on the data);
- Gaussian noise of standard deviation ``z * C`` per coordinate is added to the sum, once,
  at the server (``finalize``), drawn from (seed, node, round);
- the result is divided by the round's *expected* number of contributions ``m`` (the
  cohort size; a fixed denominator, so who dropped out does not change the scale) and
  added to ``theta``: the mean input the node's NODEOPT_up steps towards.

Clipping happens where the child's model is folded (``contribute``: in the worker for
clients, in the orchestrator for child servers), so no unclipped update is summed
anywhere; the noise needs the whole sum, so it is the parent's. A clipped update is
rounded to float32 with its scale shrunk by ``2**-22`` (``clip_update``), so its norm
stays below ``C`` after rounding and the float32 sum stays exact and order-independent.

Adaptive clipping: every child also reports whether its update was within ``C``; the
server adds noise of standard deviation ``sigma_b`` to that count (centred: ``next_clip``) and moves ``C``
geometrically towards the ``quantile`` of the update norms:
``C <- C * exp(-lr * (b - quantile))`` with ``b`` the noised unclipped share. The update
noise then uses ``z_delta = (z**-2 - (2 sigma_b)**-2) ** -1/2`` so that both releases
together cost what noise multiplier ``z`` costs (Andrew et al., Theorem 1). ``C`` is the
rule's state (``NodeState.rule_state["dp/clip"]``) and travels down in each child's ``RoundPlan.fold``.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from bhfl_core.algorithm.contract import Partial
from bhfl_core.algorithm.csprng import secure_normal
from bhfl_core.algorithm.node_state import RoundKey
from bhfl_core.algorithm.privacy_params import PrivacyParams
from bhfl_core.algorithm.rule_registry import WrapperPartial
from bhfl_core.rng import derive_seed

SHRINK = 1.0 - 2.0**-22
"""A clipped update's scale is multiplied by this: two float32 roundings (the norm's input, the result; each
within 2**-24 relative) and the float64 norm's own error cannot lift its norm above C."""


def clip_update(model: torch.Tensor, reference: torch.Tensor, clip: float) -> tuple[torch.Tensor, float]:
    """``(model - reference)`` clipped to L2 norm ``clip`` as float32, and its norm before clipping.

    The difference and its norm are computed in float64 on ``model``'s device. An update
    within the bound is only rounded to float32 (its norm is that of the float32 vector,
    so it stays within); a longer one is scaled by ``clip / norm * SHRINK`` first.
    """
    delta = model.to(torch.float64) - reference.to(model.device, torch.float64)
    rounded = delta.to(torch.float32)
    norm = float(torch.linalg.vector_norm(rounded.to(torch.float64)))
    if norm <= clip:
        return rounded, norm
    return (delta * (clip / norm * SHRINK)).to(torch.float32), norm


def as_clipped(partial: object) -> ClippedSum:
    """``partial`` as the DP rule's fold (a TypeError for another rule's)."""
    if not isinstance(partial, ClippedSum):
        raise TypeError(f"the DP rule folds ClippedSum partials, got {type(partial).__name__}")
    return partial


class ClippedSum(WrapperPartial):
    """A DP server's running fold: the exact sum of clipped updates (``inner``, the sum it wraps), with its counts.

    ``reference`` (the model the children started from) and ``clip`` are what clipping
    needs; they are not sent anywhere (the parent has both). ``inner`` is the wrapped
    sum's partial: a ``WeightedSum`` of the clipped updates (each weight 1), or a
    secure-aggregation ``MaskedSum`` of them (``dp_rule.py``).
    """

    needs_reference = "a DP fold clips updates against the model the children were sent: none was given"

    def __init__(self, reference: torch.Tensor | None, clip: float, inner: Partial, clipped: int = 0) -> None:
        super().__init__(inner, reference)  # weight: the contributions folded (each counts 1)
        self.clip = clip
        self.clipped = clipped  # contributions whose update was longer than clip
        self.nonfinite = 0  # contributions whose update was not finite: folded as zero


def noise(params: PrivacyParams, key: RoundKey, numel: int, std: float, purpose: str) -> torch.Tensor:
    """``numel`` Gaussian draws of std ``std`` (float64, CPU) from (node's noise seed, round, purpose), or, with
    ``randomness: secure``, from a CSPRNG keyed by the OS (``csprng.secure_normal``: not reproducible)."""
    if params.randomness == "secure":
        return secure_normal(numel) * std
    gen = torch.Generator().manual_seed(derive_seed(params.noise_seed, purpose, *key.parts()))
    return torch.randn(numel, generator=gen, dtype=torch.float64) * std


def noised_mean(
    params: PrivacyParams, reference: torch.Tensor, summed: torch.Tensor, clip: float, key: RoundKey
) -> torch.Tensor:
    """``theta + (sum of clipped updates + N(0, (z_delta C)^2)) / m`` as float32: the round's mean input.

    ``summed``: the exact sum of the clipped updates (float64), from the sum DP wraps.
    """
    std = 0.0 if params.distributed else params.update_noise_multiplier * clip  # distributed: the children's
    if std:
        summed = summed + noise(params, key, summed.numel(), std, "update").view_as(summed)
    base = reference.to(summed.device, torch.float64).reshape(summed.shape)
    return (base + summed / params.expected).to(torch.float32).view_as(reference)


def next_clip(params: PrivacyParams, partial: ClippedSum, key: RoundKey) -> float:
    """The clipping norm of the next round: unchanged, or Andrew et al.'s geometric step on the noised count.

    The count is released centred, ``sum_i (b_i - 1/2) + N(0, sigma_b^2)``, then divided by ``m`` and shifted
    back by ``1/2`` (TensorFlow Privacy's ``QuantileEstimatorQuery`` does the same): adding or removing one
    child moves it by ``1/2``, the sensitivity Theorem 1's split ``z_delta`` assumes. The raw count
    ``sum_i b_i`` moves by 1 when a child is added (Poisson cohorts), which would make both releases
    together cost noise multiplier ``(z^-2 + 3 / (4 sigma_b^2))^-1/2``, not ``z``. Under replace-one
    (fixed cohorts) either moves by 1, and the split holds with the accountant's ``z / 2``. With the whole
    cohort folded (``weight == m``) both give the same share.
    """
    adaptive = params.adaptive
    if adaptive is None:
        return partial.clip
    unclipped = partial.weight - partial.clipped
    count_noise = float(noise(params, key, 1, adaptive.count_noise, "count")[0]) if params.noise_multiplier else 0.0
    # (sum_i (b_i - 1/2) + noise) / m + 1/2, written so that a whole cohort (weight == m) adds an exact 0
    share = (unclipped + count_noise + (params.expected - partial.weight) / 2) / params.expected
    return partial.clip * math.exp(-adaptive.lr * (share - adaptive.quantile))


class PrivacyBudgetSpent(RuntimeError):
    """A DP server's next round would spend more than its ``max_epsilon``: the round is not published."""


def check_budget(params: PrivacyParams, key: RoundKey) -> None:
    """Refuse the round ``key`` if its epsilon would pass the server's ``max_epsilon`` (``config/privacy_plan.py``
    refuses such a plan before the run starts; this holds whatever the plan counted)."""
    from bhfl_core.algorithm.privacy_accounting import epsilon

    budget = params.budget
    if budget is None or budget.max_epsilon is None:
        return
    spent = epsilon(params, key.round + 1)
    if spent > budget.max_epsilon:
        raise PrivacyBudgetSpent(
            f"{key.node_id!r} round {key.round + 1}: publishing it would spend epsilon {spent:.4g}, over "
            f"{budget.key}.max_epsilon ({budget.max_epsilon:g}); the run stops before it"
        )


class Clipped(Protocol):
    """What a DP fold reports: the clip it used, how many updates it clipped, how many it holds."""

    clip: float
    clipped: int

    @property
    def weight(self) -> float: ...


def privacy_metrics(params: PrivacyParams, partial: Clipped, rounds: int) -> dict[str, float]:
    """What a DP server logs per round: the clip used, the share clipped, the noise on the mean, epsilon so far.

    ``privacy/clipped_fraction`` is the raw share (a diagnostic for the experimenter: the
    noised share adaptive clipping uses is what a server would publish).
    """
    from bhfl_core.algorithm.privacy_accounting import epsilon

    return {
        "privacy/clip": partial.clip,
        "privacy/clipped_fraction": partial.clipped / partial.weight if partial.weight else 0.0,
        "privacy/noise_std": params.update_noise_multiplier * partial.clip / params.expected,
        "privacy/epsilon": epsilon(params, rounds),
    }
