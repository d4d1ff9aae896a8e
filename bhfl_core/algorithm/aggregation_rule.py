"""The default rule, the exact weighted mean, and where a round's child results meet their parent.

The default, ``mean``, is the exact weighted mean of ``aggregation.WeightedSum``: its
partials are exact sums, so the mean does not depend on how the children were spread
over workers or in which order they arrived. The wrappers around a rule (DP,
``dp_rule.py``; secure aggregation, ``secagg_rule.py``; ``zeroing_rule.py``) and the other
rules (``robust_rules.py``, ``fednova_rule.py``) live in their own modules.

``fold_results`` is the one place a round's child results meet their parent. What a
rule is and how one is registered: ``rule_registry.py``; looking one up: ``rules.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bhfl_core.algorithm.contract import NO_PLAN, ChildResult, FoldPlan, Partial
from bhfl_core.algorithm.node_state import Caller, RoundKey
from bhfl_core.algorithm.rule_registry import AggregateParams, AggregationRule, Stateless, register_rule

if TYPE_CHECKING:  # imported where used: configs validate rule names without loading torch
    import torch

    from bhfl_core.algorithm.aggregation import Allocator, WeightedSum
    from bhfl_core.algorithm.residuals import Candidate


def _sum(partial: Partial) -> WeightedSum:
    from bhfl_core.algorithm.aggregation import WeightedSum

    if not isinstance(partial, WeightedSum):
        raise TypeError(f"the mean rule folds WeightedSum partials, got {type(partial).__name__}")
    return partial


@register_rule("mean")
class MeanRule(Stateless):
    """The exact example-weighted mean (FedAvg's): ``sum_i p_i x_i / sum_i p_i``, rounded once."""

    def __init__(self, params: AggregateParams) -> None:
        self.params = params

    def start(
        self,
        round_of: Caller,
        plan: FoldPlan = NO_PLAN,
        reference: torch.Tensor | None = None,
        allocate: Allocator | None = None,
    ) -> WeightedSum:
        from bhfl_core.algorithm.aggregation import WeightedSum

        return WeightedSum(allocate=allocate)

    def contribute(
        self, partial: Partial, member: str, model: torch.Tensor, weight: float, steps: float | None = None
    ) -> None:
        _sum(partial).add(model, weight)

    def merge(self, into: Partial, other: Partial) -> None:
        _sum(into).merge(_sum(other), consume=True)

    def close(self, partial: Partial) -> bool:
        _sum(partial).close()  # the correctly rounded mean: the same bits on any device
        return True

    def mean_input(self, partial: Partial, key: RoundKey) -> torch.Tensor:
        return _sum(partial).mean()

    def wire(self, partial: Partial) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        total = _sum(partial)
        return total.parts(), {"weight": total.weight}

    def unwire(self, tensors: Mapping[str, torch.Tensor], numbers: Mapping[str, float]) -> WeightedSum:
        from bhfl_core.algorithm.aggregation import CLOSED, WeightedSum

        if not tensors:
            return WeightedSum()
        if CLOSED in tensors:
            return WeightedSum.closed_of(tensors[CLOSED], float(numbers["weight"]))
        return WeightedSum.of(tensors["hi"], tensors["lo"], float(numbers["weight"]))


@dataclass
class FoldedRound:
    """A round's child results folded for its node: the partial ``node_up`` finalizes, and the rest.

    ``models``: the individual child models that came up unfolded (child servers), for
    what needs them after the fold (Tempo's distances). ``loss``/``examples``: the
    example-weighted mean of the children's last-round training loss.
    """

    partial: Partial
    candidates: list[Candidate]
    models: dict[str, torch.Tensor]
    dropped: list[str]
    virtual_s: float = 0.0
    examples: int | None = None  # None: no child reported a training loss
    loss: float = math.nan
    sent_bytes: int = 0  # the compressed updates folded (``compression.py``); 0 when the children sent models
    shift: torch.Tensor | None = None  # theta_t - x_hat_t: what the children's models are short of (``downlink.py``)

    @property
    def empty(self) -> bool:
        return self.partial.empty

    def reported(self) -> tuple[float | None, int]:
        """The children's training loss and examples, as the node reports them up (None, 0: none)."""
        return (None, 0) if self.examples is None else (self.loss, self.examples)


def fold_results(
    rule: AggregationRule,
    key: RoundKey,
    results: Sequence[ChildResult],
    order: Sequence[str],
    reference: torch.Tensor | None = None,
    plan: FoldPlan = NO_PLAN,
) -> FoldedRound:
    """Fold a round's child results into one partial, in child order (``order``: the node's children, itself last).

    ``reference`` / ``plan``: the model the node sent its children and the rule's part of
    their plans this round (``AggregationRule.start``).

    The order makes everything that is not an exact sum (candidate lists, the loss mean,
    the dropped list) the same however the children were placed or arrived. The node's
    own proxy TRAIN (member ``order[-1]``) is folded like a child, but its loss is its
    own (``Training/proxy_loss``), not one of the children's. A rule that may not see its
    children one by one (``sees_members`` False: secure aggregation) takes no child's loss:
    a worker's clients send none, and a child server's, which comes up with its model, is
    dropped here.
    """
    rank = {member: i for i, member in enumerate(order)}
    own = order[-1] if order else None

    def first(result: ChildResult) -> int:
        return min((rank.get(m, len(rank)) for m in (*result.members, *result.dropped)), default=len(rank))

    folded = FoldedRound(rule.start(key.as_caller(), plan, reference), [], {}, [])
    losses: dict[str, tuple[float, int]] = {}
    for result in sorted(results, key=first):
        if result.model is not None:
            (member,) = result.members
            rule.contribute(folded.partial, member, result.model, result.weight)
            folded.models[member] = result.model
        elif result.partial is not None:
            rule.merge(folded.partial, result.partial)
        folded.candidates.extend(result.candidates)
        folded.dropped.extend(result.dropped)
        folded.virtual_s = max(folded.virtual_s, result.virtual_s)
        folded.sent_bytes += result.sent_bytes
        if rule.sees_members:  # not under secure aggregation: a child server's loss would be one child's, in the clear
            losses.update((m.member, (m.loss, m.examples)) for m in result.losses if m.member != own)
    folded.candidates.sort(key=lambda c: rank.get(c.node_id, len(rank)))
    folded.dropped.sort(key=lambda m: rank.get(m, len(rank)))
    if losses:  # summed in child-id order: the same float sum however children were batched
        ordered = [losses[k] for k in sorted(losses)]
        folded.examples = sum(n for _, n in ordered)
        folded.loss = sum(loss * n for loss, n in ordered) / max(folded.examples, 1)
    return folded
