"""The ``zeroing`` wrapper: a child's update that is not finite, or too long, counts as no update (TFF's zeroing).

A server with ``aggregate: {wrap: [{zeroing: {max_norm: B}}, ...]}`` checks every child's
update ``x_i - theta`` (its model against the model it was sent) where the child is
folded: if any value is NaN or infinite, or its L2 norm is above ``B`` (default: no bound,
only non-finite updates), the child contributes ``theta`` itself (a zero update) with its
weight, and the fold counts it (``zeroing/zeroed``, of which ``zeroing/nonfinite``). So a
diverged client cannot turn the server's model into NaN, and one that sends a huge
update moves nothing, as TensorFlow Federated's ``zeroing_factory`` does; the rule it
wraps (the mean, a robust rule, ``dp``) folds what is left. The norm is taken in float64
on the model's device; a contribution within the bound is passed on unchanged, so a
round where nothing is zeroed gives the wrapped rule's bits.

Around secure aggregation (``secagg`` inside, alone or inside ``dp``) the server may see
only the masked sum: a worker batch's count of zeroed updates, sent beside it in the
clear, would tell it which of the batch's clients diverged or sent a long update (one
client a batch: exactly who). There the counts are neither kept nor sent, and the server
logs no ``zeroing/*`` metric (``dp``'s own ``privacy/nonfinite`` travels masked).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from bhfl_core.algorithm.contract import NO_PLAN, FoldPlan, Partial
from bhfl_core.algorithm.node_state import Caller, RoundKey
from bhfl_core.algorithm.privacy_params import ZeroingParams
from bhfl_core.algorithm.rule_registry import (
    NO_STATE,
    AggregationRule,
    Finalized,
    RuleState,
    WrapperPartial,
    register_wrapper,
)

if TYPE_CHECKING:
    import torch

    from bhfl_core.algorithm.aggregation import Allocator

ZEROED = "zeroing/zeroed"
"""Metric: the children whose update was zeroed this round (non-finite or above ``max_norm``)."""

NONFINITE = "zeroing/nonfinite"
"""Metric: of those, the ones with a NaN or infinite value."""


class Zeroed(WrapperPartial):
    """The wrapped rule's partial, with the model the children were sent and what was zeroed."""

    needs_reference = "zeroing checks updates against the model the children were sent: none was given"

    def __init__(self, inner: Partial, reference: torch.Tensor | None, zeroed: int = 0, nonfinite: int = 0) -> None:
        super().__init__(inner, reference)
        self.zeroed, self.nonfinite = zeroed, nonfinite


def _zeroed(partial: Partial) -> Zeroed:
    if not isinstance(partial, Zeroed):
        raise TypeError(f"the zeroing wrapper folds Zeroed partials, got {type(partial).__name__}")
    return partial


@register_wrapper("zeroing", ZeroingParams)
class ZeroingRule:
    """Zeroes non-finite or too-long updates (module docstring), then folds with the rule it wraps."""

    def __init__(self, params: ZeroingParams, inner: AggregationRule) -> None:
        self.params, self.inner = params, inner
        self.distinct_members = inner.distinct_members
        self.reports_up, self.sees_members = inner.reports_up, inner.sees_members
        self.counts = inner.sees_members  # counted in the clear only where the server may see each child

    def plan(self, state: RuleState, called: Sequence[str]) -> FoldPlan:
        return self.inner.plan(state, called)

    def start(
        self,
        round_of: Caller,
        plan: FoldPlan = NO_PLAN,
        reference: torch.Tensor | None = None,
        allocate: Allocator | None = None,
    ) -> Zeroed:
        return Zeroed(self.inner.start(round_of, plan, reference, allocate), reference)

    def contribute(
        self, partial: Partial, member: str, model: torch.Tensor, weight: float, steps: float | None = None
    ) -> None:
        import torch

        fold = _zeroed(partial)
        reference = fold.reference_on(model.device)
        norm = float(torch.linalg.vector_norm(model.to(torch.float64) - reference.to(torch.float64)))
        if not math.isfinite(norm) or norm > self.params.max_norm:
            if self.counts:
                fold.zeroed += 1
                fold.nonfinite += not math.isfinite(norm)
            model = reference.to(model.dtype)
        self.inner.contribute(fold.inner, member, model, weight, steps)

    def merge(self, into: Partial, other: Partial) -> None:
        mine, theirs = _zeroed(into), _zeroed(other)
        self.inner.merge(mine.inner, theirs.inner)
        mine.zeroed += theirs.zeroed
        mine.nonfinite += theirs.nonfinite

    def close(self, partial: Partial) -> bool:
        return self.inner.close(_zeroed(partial).inner)

    def finalize(self, partial: Partial, key: RoundKey, state: RuleState = NO_STATE) -> Finalized:
        fold = _zeroed(partial)
        done = self.inner.finalize(fold.inner, key, state)
        if not self.counts:
            return done
        return Finalized(
            done.input, done.state, {**done.metrics, ZEROED: float(fold.zeroed), NONFINITE: float(fold.nonfinite)}
        )

    def wire(self, partial: Partial) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        fold = _zeroed(partial)
        tensors, numbers = self.inner.wire(fold.inner)
        if not self.counts:  # secure aggregation: nothing of one batch's children beside the masked vector
            return tensors, numbers
        return tensors, {**numbers, ZEROED: float(fold.zeroed), NONFINITE: float(fold.nonfinite)}

    def unwire(self, tensors: Mapping[str, torch.Tensor], numbers: Mapping[str, float]) -> Zeroed:
        rest = {k: v for k, v in numbers.items() if k not in (ZEROED, NONFINITE)}
        return Zeroed(
            self.inner.unwire(tensors, rest), None, int(numbers.get(ZEROED, 0)), int(numbers.get(NONFINITE, 0))
        )
