"""The ``dp`` wrapper: DP-FedAvg around a sum (the plain exact sum, or secure aggregation's masked sum).

What it computes is ``privacy.py``'s (McMahan et al. 2018; adaptive clipping, Andrew et al.
2021): each child's update is clipped where it is folded and added, with weight 1, to the
sum the wrapper wraps; at the server the sum gets Gaussian noise and the fixed
denominator. The sum is the wrapped rule's: ``kind: mean`` alone gives the exact
``WeightedSum`` (``PlainSum``), ``secagg`` inside ``dp`` gives the masked sum
(``secagg_rule.py``), so the clip happens before masking and the noise after unmasking,
as TensorFlow Federated's ``DifferentiallyPrivateFactory`` around a secure sum. Any
other rule inside ``dp`` is refused (DP's sensitivity is a sum's).

The rule's state is the clipping norm adaptive clipping moves (``dp/clip``; absent: the
configured one); it goes down to the children in ``FoldPlan`` and the round's metric
lines (``privacy/*``) come out of ``finalize``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from bhfl_core.algorithm.aggregation_rule import MeanRule
from bhfl_core.algorithm.contract import NO_PLAN, FoldPlan, Partial
from bhfl_core.algorithm.node_state import Caller, RoundKey
from bhfl_core.algorithm.privacy_params import PrivacyParams
from bhfl_core.algorithm.rule_registry import NO_STATE, AggregationRule, Finalized, RuleState, register_wrapper

if TYPE_CHECKING:
    import torch

    from bhfl_core.algorithm.aggregation import Allocator, WeightedSum
    from bhfl_core.algorithm.privacy import ClippedSum

CLIP = "dp/clip"
"""The rule state's (and ``FoldPlan``'s) clipping norm: the round's, moved by adaptive clipping."""

CLIPPED = "dp/clipped"

NONFINITE = "privacy/nonfinite"
"""Metric: children whose update had a NaN or infinite value this round: folded as no update (zero)."""


class UpdateSum(Protocol):
    """What ``dp`` wraps: an exact sum of weighted update vectors, folded where the children are."""

    def plan(self, state: RuleState, called: Sequence[str]) -> FoldPlan: ...

    def start_sum(self, round_of: Caller, plan: FoldPlan, allocate: Allocator | None) -> Partial: ...

    def add_update(
        self,
        partial: Partial,
        member: str,
        update: torch.Tensor,
        weight: float,
        counts: Mapping[str, int] | None = None,
    ) -> None:
        """Add ``weight * update`` (and count ``weight``); ``counts``: the member's flags, summed with it where the
        server may not see them one by one (``sees_members`` False)."""
        ...

    def counts(self, partial: Partial) -> dict[str, int]:
        """The flags' totals (empty where the caller counts them itself)."""
        ...

    def merge(self, into: Partial, other: Partial) -> None: ...

    def summed(self, partial: Partial) -> torch.Tensor:
        """The sum (float64), exact."""
        ...

    def sum_metrics(self, partial: Partial) -> dict[str, float]: ...

    def wire(self, partial: Partial) -> tuple[dict[str, torch.Tensor], dict[str, float]]: ...

    def unwire(self, tensors: Mapping[str, torch.Tensor], numbers: Mapping[str, float]) -> Partial: ...


def _total(partial: Partial) -> WeightedSum:
    from bhfl_core.algorithm.aggregation import WeightedSum

    if not isinstance(partial, WeightedSum):
        raise TypeError(f"the plain sum folds WeightedSum partials, got {type(partial).__name__}")
    return partial


class PlainSum:
    """The exact sum ``aggregation.WeightedSum`` keeps (``hi + lo``): what ``dp`` wraps around ``kind: mean``."""

    sees_members = True  # the DP server is trusted with its children's updates (central DP)

    def plan(self, state: RuleState, called: Sequence[str]) -> FoldPlan:
        return NO_PLAN

    def start_sum(self, round_of: Caller, plan: FoldPlan, allocate: Allocator | None) -> WeightedSum:
        from bhfl_core.algorithm.aggregation import WeightedSum

        return WeightedSum(allocate=allocate)

    def add_update(
        self,
        partial: Partial,
        member: str,
        update: torch.Tensor,
        weight: float,
        counts: Mapping[str, int] | None = None,
    ) -> None:
        _total(partial).add(update, weight)

    def counts(self, partial: Partial) -> dict[str, int]:
        return {}

    def merge(self, into: Partial, other: Partial) -> None:
        _total(into).merge(_total(other), consume=True)

    def summed(self, partial: Partial) -> torch.Tensor:
        total = _total(partial)
        if total.hi is None or total.lo is None:
            raise ValueError("cannot finalize an empty DP fold")
        return total.hi + total.lo  # float64; exact sums of float32 updates

    def sum_metrics(self, partial: Partial) -> dict[str, float]:
        return {}

    def wire(self, partial: Partial) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        total = _total(partial)
        return total.parts(), {"weight": total.weight}

    def unwire(self, tensors: Mapping[str, torch.Tensor], numbers: Mapping[str, float]) -> WeightedSum:
        from bhfl_core.algorithm.aggregation import WeightedSum

        return WeightedSum.of(tensors["hi"], tensors["lo"], float(numbers["weight"])) if tensors else WeightedSum()


def _as_sum(inner: AggregationRule) -> UpdateSum:
    if isinstance(inner, MeanRule):
        return PlainSum()
    if hasattr(inner, "start_sum"):  # a sum of its own (secure aggregation)
        return inner  # type: ignore[return-value]
    raise TypeError(f"dp wraps a sum (kind mean, or secagg), not {type(inner).__name__}")


def _clipped(partial: Partial) -> ClippedSum:
    from bhfl_core.algorithm.privacy import as_clipped

    return as_clipped(partial)


@register_wrapper("dp", PrivacyParams)
class DpRule:
    """DP-FedAvg around the sum it wraps (module docstring)."""

    distinct_members = True  # the noise covers one clipped update per child and fold
    reports_up = False  # above it, only the noised model: not the children's losses or example totals

    def __init__(self, params: PrivacyParams, inner: AggregationRule) -> None:
        self.params, self.sum = params, _as_sum(inner)
        self.sees_members: bool = getattr(self.sum, "sees_members", True)

    def plan(self, state: RuleState, called: Sequence[str]) -> FoldPlan:
        return self.sum.plan(state, called).with_number(CLIP, state.get(CLIP, self.params.clip))

    def start(
        self,
        round_of: Caller,
        plan: FoldPlan = NO_PLAN,
        reference: torch.Tensor | None = None,
        allocate: Allocator | None = None,
    ) -> ClippedSum:
        from bhfl_core.algorithm.privacy import ClippedSum

        clip = plan.number(CLIP)
        inner = self.sum.start_sum(round_of, plan, allocate)
        return ClippedSum(reference, self.params.clip if clip is None else clip, inner)

    def contribute(
        self, partial: Partial, member: str, model: torch.Tensor, weight: float, steps: float | None = None
    ) -> None:
        import torch

        from bhfl_core.algorithm.privacy import clip_update

        fold = _clipped(partial)
        update, norm = clip_update(model.detach(), fold.reference_on(model.device), fold.clip)
        nonfinite = not math.isfinite(norm)
        if nonfinite:  # a diverged child: no update, counted (its NaN would make the mean NaN)
            update, norm = torch.zeros_like(update), 0.0
        flags = {"clipped": int(norm > fold.clip), "nonfinite": int(nonfinite)}
        if self.sees_members:  # a trusted server counts them
            fold.clipped += flags["clipped"]
            fold.nonfinite += flags["nonfinite"]
            self.sum.add_update(fold.inner, member, update, 1.0)
        else:  # secure aggregation: the flags are masked with the update, only their totals are seen
            self.sum.add_update(fold.inner, member, update, 1.0, flags)

    def merge(self, into: Partial, other: Partial) -> None:
        mine, theirs = _clipped(into), _clipped(other)
        if theirs.clip != mine.clip:
            raise ValueError(f"a fold clipped at {theirs.clip} cannot join one clipped at {mine.clip}")
        self.sum.merge(mine.inner, theirs.inner)
        mine.clipped += theirs.clipped
        mine.nonfinite += theirs.nonfinite

    def close(self, partial: Partial) -> bool:
        return False  # the noise is the server's to add

    def finalize(self, partial: Partial, key: RoundKey, state: RuleState = NO_STATE) -> Finalized:
        import torch

        from bhfl_core.algorithm.canaries import insert, observe
        from bhfl_core.algorithm.privacy import check_budget, next_clip, noised_mean, privacy_metrics

        fold = _clipped(partial)
        if fold.reference is None:
            raise ValueError("cannot finalize a DP fold without the model the children were sent")
        check_budget(self.params, key)
        if fold.inner.empty:  # nobody came (a Poisson draw of none, all dropped): the noise alone, so as not to
            summed = torch.zeros(fold.reference.numel(), dtype=torch.float64)  # tell empty rounds from others
        else:
            if not self.sees_members and not self.params.distributed:  # the flags' totals, unmasked with the sum
                totals = self.sum.counts(fold.inner)
                fold.clipped, fold.nonfinite = totals["clipped"], totals["nonfinite"]
            summed = self.sum.summed(fold.inner)
        canaries = self.params.canaries
        if canaries is not None:  # an audit's canary clients, each in with a real child's chance (canaries.py)
            rate = min(1.0, self.params.expected / self.params.population)
            summed = insert(summed, canaries, key, rate, fold.clip)
        mean = noised_mean(self.params, fold.reference, summed, fold.clip, key)
        after = dict(state)
        if canaries is not None:
            after = observe(mean.to(torch.float64) - fold.reference.to(mean.device, torch.float64), canaries, after)
        if self.params.adaptive is not None:  # the next round's norm, from the noised count
            after[CLIP] = next_clip(self.params, fold, key)
        metrics = {**privacy_metrics(self.params, fold, key.round + 1), **self.sum.sum_metrics(fold.inner)}
        metrics[NONFINITE] = float(fold.nonfinite)
        if self.params.distributed:  # no count reaches an untrusted server, so it has none to log
            del metrics[NONFINITE], metrics["privacy/clipped_fraction"]
        return Finalized(mean, after, metrics)

    def wire(self, partial: Partial) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        fold = _clipped(partial)
        tensors, numbers = self.sum.wire(fold.inner)
        if not self.sees_members:  # the flags travel masked, inside the sum
            return tensors, {**numbers, CLIP: fold.clip}
        return tensors, {**numbers, CLIP: fold.clip, CLIPPED: float(fold.clipped), NONFINITE: float(fold.nonfinite)}

    def unwire(self, tensors: Mapping[str, torch.Tensor], numbers: Mapping[str, float]) -> ClippedSum:
        from bhfl_core.algorithm.privacy import ClippedSum

        rest = {k: v for k, v in numbers.items() if k not in (CLIP, CLIPPED, NONFINITE)}
        out = ClippedSum(None, float(numbers[CLIP]), self.sum.unwire(tensors, rest), int(numbers.get(CLIPPED, 0)))
        out.nonfinite = int(numbers.get(NONFINITE, 0))
        return out
