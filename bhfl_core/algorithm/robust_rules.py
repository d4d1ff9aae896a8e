"""Byzantine-robust aggregation rules: coordinate-wise median, trimmed mean, Krum / Multi-Krum.

Configs choose them per level or node like any rule (``aggregation_rule.py``)::

    aggregate: {kind: median}
    aggregate: {kind: trimmed_mean, trim: 0.1}           # the fraction cut from each end, in [0, 0.5)
    aggregate: {kind: krum, byzantine: 1, keep: 1}       # f tolerated; keep m > 1: Multi-Krum

Their maths is in ``robust.py`` (pure functions, the papers and Flower's counterparts
cited there). Each needs every child's model of the round, so the partial they fold into
is ``stacked.StackedModels``: the models kept by member name, in ``allocate``'s storage
where one is given (a CPU worker's shared-memory transfer files), merged as a union,
read in sorted-name order. Memory therefore grows with the cohort: ``k`` children of
``P`` float32 parameters hold ``4kP`` bytes where they are folded and at the parent
(``stacked.py`` says where), against the mean's ``16P`` whatever ``k``.

Where they run: ``contribute`` stores a model where it is made (the worker, the
orchestrator for a child server, a proxy TRAIN merged like a child); ``finalize``
computes the rule at the parent. A worker that holds a whole round closes it there
(``close``: the result is the same bits on any device, ``robust.py``), sending one
vector instead of ``k``. This module imports no torch: configs validate rule names
without loading it.

What they do not combine with (rejected by the config, naming the key;
``RuleTraits``): ``privacy:`` and ``secure_aggregation:`` (the server may see only a
clipped, noised or masked *sum*, never a child's vector), ``mode: async`` (a FedBuff
flush folds K arrivals, not a round's cohort), and up-residuals that would carry
children's models past or into a robust node (they would skip its rule). They do
combine with ``aggregate.compress`` (the rule sees the models the children's payloads
decode to) and with ``proxy_train: async`` (the server's own proxy model is one more
member, named after the server, weighted by its rows). Krum's ``n > 2f + 2`` is checked
on the cohort where the config knows it, and on the contributions that came at round
time (dropped clients shrink it): an error naming the node.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from bhfl_core.algorithm.contract import NO_PLAN, FoldPlan, Partial
from bhfl_core.algorithm.node_state import Caller, RoundKey
from bhfl_core.algorithm.rule_registry import AggregateParams, RuleTraits, Stateless, register_rule

if TYPE_CHECKING:
    import torch

    from bhfl_core.algorithm.aggregation import Allocator
    from bhfl_core.algorithm.stacked import StackedModels


def krum_cohort_error(params: AggregateParams, n: int) -> str | None:
    """Why Krum cannot fold ``n`` contributions (Blanchard et al.: ``n > 2f + 2``; Multi-Krum: ``m <= n - f``)."""
    f, m = params.byzantine, params.keep
    if n <= 2 * f + 2:
        return f"Krum with aggregate.byzantine: {f} needs more than 2f + 2 = {2 * f + 2} contributions, got {n}"
    if m > n - f:
        return f"Multi-Krum's aggregate.keep: {m} is more than the n - f = {n - f} models it can trust (n = {n})"
    return None


def _stacked(partial: Partial) -> StackedModels:
    from bhfl_core.algorithm.stacked import as_stacked

    return as_stacked(partial)


class StackedRule(Stateless):
    """What the three rules share: each child's model kept by name (``StackedModels``); ``aggregate`` differs."""

    name = ""

    def __init__(self, params: AggregateParams) -> None:
        self.params = params

    def aggregate(self, stacked: StackedModels) -> torch.Tensor:
        """The rule over the round's members (sorted by name): one float32 vector."""
        raise NotImplementedError

    def cohort_error(self, n: int) -> str | None:
        return None

    def start(
        self,
        round_of: Caller,
        plan: FoldPlan = NO_PLAN,
        reference: torch.Tensor | None = None,
        allocate: Allocator | None = None,
    ) -> StackedModels:
        from bhfl_core.algorithm.stacked import StackedModels

        return StackedModels(round_of, allocate)

    def contribute(
        self, partial: Partial, member: str, model: torch.Tensor, weight: float, steps: float | None = None
    ) -> None:
        _stacked(partial).add(member, model, weight)

    def merge(self, into: Partial, other: Partial) -> None:
        _stacked(into).merge(_stacked(other))

    def close(self, partial: Partial) -> bool:
        """The whole round's result where it was folded (the same bits the parent would compute), unless the round
        cannot be folded (too few for Krum): then the parent's ``finalize`` says so, naming the node."""
        stacked = _stacked(partial)
        if self.cohort_error(len(stacked)) is not None:
            return False
        stacked.close_with(self.aggregate)
        return True

    def mean_input(self, partial: Partial, key: RoundKey) -> torch.Tensor:
        stacked = _stacked(partial)
        if stacked.closed is not None:
            return stacked.closed
        error = self.cohort_error(len(stacked))
        if error is not None:
            raise ValueError(
                f"aggregate.kind {self.name} at {key.node_id!r} (round {key.round + 1}): {error} "
                "(children dropped this round?)"
            )
        return self.aggregate(stacked)

    def wire(self, partial: Partial) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        return _stacked(partial).wire()

    def unwire(self, tensors: Mapping[str, torch.Tensor], numbers: Mapping[str, float]) -> StackedModels:
        from bhfl_core.algorithm.stacked import unwire

        return unwire(tensors, numbers)


@register_rule("median", RuleTraits(whole_round=True, robust=True))
class MedianRule(StackedRule):
    """The coordinate-wise median of the children's models (unweighted; ``robust.coordinate_median``)."""

    name = "median"

    def aggregate(self, stacked: StackedModels) -> torch.Tensor:
        from bhfl_core.algorithm.robust import coordinate_median

        return coordinate_median(stacked.ordered())


@register_rule("trimmed_mean", RuleTraits(params=("trim",), whole_round=True, robust=True))
class TrimmedMeanRule(StackedRule):
    """The coordinate-wise trimmed mean: ``trim`` of the values cut from each end (``robust.trimmed_mean``)."""

    name = "trimmed_mean"

    def aggregate(self, stacked: StackedModels) -> torch.Tensor:
        from bhfl_core.algorithm.robust import trimmed_mean

        return trimmed_mean(stacked.ordered(), self.params.trim)


@register_rule(
    "krum", RuleTraits(params=("byzantine", "keep"), whole_round=True, robust=True, cohort_error=krum_cohort_error)
)
class KrumRule(StackedRule):
    """Krum (``keep: 1``) or Multi-Krum: the child(ren) closest to their nearest others (``robust.krum``)."""

    name = "krum"

    def cohort_error(self, n: int) -> str | None:
        return krum_cohort_error(self.params, n)

    def aggregate(self, stacked: StackedModels) -> torch.Tensor:
        from bhfl_core.algorithm.robust import krum

        return krum(stacked.ordered(), self.params.byzantine, self.params.keep)
