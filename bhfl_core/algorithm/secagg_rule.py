"""The ``secagg`` wrapper: secure aggregation (``secure_aggregation.py``) around the mean, or inside ``dp``.

Around ``kind: mean`` (``aggregate: {wrap: [{secagg: {...}}]}``, or ``secure_aggregation:``)
each child's example-weighted update is masked where it is folded and only the sum is
unmasked, by the server: the mean input is ``theta + sum / sum_u w_u``. Inside ``dp``
(``wrap: [{dp: ...}, {secagg: ...}]``) it is the sum DP adds its clipped updates to
(``dp_rule.UpdateSum``): clipped before masking, noised after unmasking. Its part of
the children's plans is the round's called cohort (``FoldPlan.peers``: every child masks
with a pairwise mask per peer); it keeps no state. At an asynchronous server a flush is
one masked round whose peers are all the server's children: the buffer's senders are its
survivors, the others are recovered from their shares like dropped clients. Only the mean
can be inside it: a robust rule needs each child's vector, which masking hides.
A child whose update is not finite stops the run (``NonFiniteUpdate``, naming it) unless
``zeroing`` or ``dp`` outside folds it as no update first: in the field a NaN would be
summed as 0 and an infinity as the clamp's bound, unseen.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from bhfl_core.algorithm.aggregation_rule import MeanRule
from bhfl_core.algorithm.compression import NonFiniteUpdate
from bhfl_core.algorithm.contract import NO_PLAN, FoldPlan, Partial
from bhfl_core.algorithm.node_state import Caller, RoundKey
from bhfl_core.algorithm.privacy_params import SecAggParams
from bhfl_core.algorithm.rule_registry import NO_STATE, AggregationRule, Finalized, RuleState, register_wrapper

if TYPE_CHECKING:
    import torch

    from bhfl_core.algorithm.aggregation import Allocator
    from bhfl_core.algorithm.secure_aggregation import MaskedSum


def _nonfinite_message(member: str, update: torch.Tensor, round_of: Caller) -> str:
    import torch

    bad, nan = int((~torch.isfinite(update)).sum()), int(torch.isnan(update).sum())
    return (
        f"{member}: its update to {round_of.node_id!r} (round {round_of.round}) has {bad} non-finite values of "
        f"{update.numel()} ({nan} NaN): its model diverged. Secure aggregation's fixed point cannot carry them (a "
        "NaN would be masked and summed as 0, unseen, an infinity as the clamp's bound), so it is not sent; add "
        "zeroing to that server's aggregate.wrap (before secagg) to fold such an update as no update, or lower "
        "the learning rate"
    )


def _masked(partial: Partial) -> MaskedSum:
    from bhfl_core.algorithm.secure_aggregation import MaskedSum

    if not isinstance(partial, MaskedSum):
        raise TypeError(f"the secure aggregation rule folds MaskedSum partials, got {type(partial).__name__}")
    return partial


@register_wrapper("secagg", SecAggParams)
class SecAggRule:
    """Masked where folded, unmasked only as a sum by the server (module docstring)."""

    distinct_members = True  # a member masks once per fold: its self-mask is removed once
    reports_up = False  # the parent learns the published model, not the children's losses
    sees_members = False  # the server sees masked vectors only: no child's loss either

    def __init__(self, params: SecAggParams, inner: AggregationRule) -> None:
        if not isinstance(inner, MeanRule):
            raise TypeError(f"secagg wraps the mean (a sum of updates), not {type(inner).__name__}")
        self.params = params

    def plan(self, state: RuleState, called: Sequence[str]) -> FoldPlan:
        """The mask group (the called cohort) and, with ``randomness: secure``, the round's root from the OS."""
        return NO_PLAN.with_peers(called, os.urandom(32) if self.params.randomness == "secure" else b"")

    def start(
        self,
        round_of: Caller,
        plan: FoldPlan = NO_PLAN,
        reference: torch.Tensor | None = None,
        allocate: Allocator | None = None,
    ) -> MaskedSum:
        from bhfl_core.algorithm.secure_aggregation import MaskedSum

        return MaskedSum(self.params, round_of, plan.peers, reference, plan.drawn)

    def contribute(
        self, partial: Partial, member: str, model: torch.Tensor, weight: float, steps: float | None = None
    ) -> None:
        import torch

        fold = _masked(partial)
        if fold.reference is None:
            raise ValueError("secure aggregation masks updates against the model the children were sent: none given")
        flat = model.detach().reshape(-1).to("cpu", torch.float64)
        update = flat - fold.reference.to("cpu", torch.float64).reshape(-1)
        if not bool(torch.isfinite(update).all()):
            raise NonFiniteUpdate(_nonfinite_message(member, update, fold.round_of))
        fold.add(member, update, weight)

    def merge(self, into: Partial, other: Partial) -> None:
        _masked(into).merge(_masked(other))

    def close(self, partial: Partial) -> bool:
        return False  # only the server unmasks

    def finalize(self, partial: Partial, key: RoundKey, state: RuleState = NO_STATE) -> Finalized:
        import torch

        fold = _masked(partial)
        assert fold.reference is not None, "the server's fold holds the model it sent"
        reference = fold.reference.to("cpu", torch.float64).reshape(-1)
        mean = (reference + fold.summed() / fold.total_weight).to(torch.float32).view_as(fold.reference)
        return Finalized(mean, state, fold.secagg_metrics())

    def wire(self, partial: Partial) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        return _masked(partial).wire()

    def unwire(self, tensors: Mapping[str, torch.Tensor], numbers: Mapping[str, float]) -> MaskedSum:
        from bhfl_core.algorithm.secure_aggregation import unwire

        return unwire(self.params, Caller(), (), tensors, numbers)

    # ---- the sum ``dp`` wraps (``dp_rule.UpdateSum``)

    def start_sum(self, round_of: Caller, plan: FoldPlan, allocate: Allocator | None) -> MaskedSum:
        return self.start(round_of, plan)

    def add_update(
        self,
        partial: Partial,
        member: str,
        update: torch.Tensor,
        weight: float,
        counts: Mapping[str, int] | None = None,
    ) -> None:
        _masked(partial).add(member, update, weight, counts)

    def counts(self, partial: Partial) -> dict[str, int]:
        return _masked(partial).totals()

    def summed(self, partial: Partial) -> torch.Tensor:
        return _masked(partial).summed()

    def sum_metrics(self, partial: Partial) -> dict[str, float]:
        return _masked(partial).secagg_metrics()
