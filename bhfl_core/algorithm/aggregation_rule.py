"""Aggregation rules: how children's models become the one input a NODEOPT steps towards.

A rule has two halves, run at different places:

- ``contribute`` folds one child's model into a running ``Partial`` wherever it is
  made: in the worker that trained a batch of clients, in the orchestrator for a child
  server's model, in the asynchronous buffer (a stale-weighted model), and for a
  server's proxy TRAIN merged like a child. ``merge`` joins two partials (a worker's
  batch into its node's round), and ``start`` opens an empty one for a round.
- ``finalize`` turns a round's partial into ``mean_input`` inside the pure ``node_up``,
  with the round's key, so a rule that draws noise draws it from (seed, node, round).

Rules are registered by name like NODEOPTs (``@register_rule``); configs choose one per
level or node with ``aggregate: {kind: ...}``, validated against the registry. The
default, ``mean``, is the exact weighted mean of ``aggregation.WeightedSum``: its
partials are exact sums, so the mean does not depend on how the children were spread
over workers or in which order they arrived. Every rule's partial travels between
processes as named tensors plus numbers (``wire`` / ``unwire``), so the transport
(bhfl_core/store/transfer.py) needs to know nothing about the rule.

A server with ``privacy:`` folds with ``DpMeanRule`` (the config allows no other
``aggregate.kind`` beside it): DP-FedAvg's clipped, noised mean (``privacy.py``). Its
partial clips against the model the children were sent, so ``start`` takes that
``reference`` and the round's ``clip``.

More rules register at the end of this module: the robust ones (``robust_rules.py``:
coordinate-wise median, trimmed mean, Krum) and FedNova (``fednova.py``). Each declares
its ``RuleTraits`` (the ``aggregate`` keys it reads, what it needs of its node), which
the config checks before any work (``config/aggregation_settings.py``).

``fold_results`` is the one place a round's child results meet their parent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from bhfl_core.algorithm.compression import CompressParams
from bhfl_core.algorithm.contract import ChildResult, Partial
from bhfl_core.algorithm.node_state import Caller, RoundKey
from bhfl_core.algorithm.privacy_params import PrivacyParams, SecAggParams

if TYPE_CHECKING:  # imported where used: configs validate rule names without loading torch
    import torch

    from bhfl_core.algorithm.aggregation import Allocator, WeightedSum
    from bhfl_core.algorithm.privacy import ClippedSum
    from bhfl_core.algorithm.residuals import Candidate
    from bhfl_core.algorithm.secure_aggregation import MaskedSum


@dataclass(frozen=True)
class AggregateParams:
    """A node's aggregation rule (``aggregate:`` in the config); ``privacy``: DP-FedAvg, ``secagg``: masked sums.

    ``compress``: what the node's children send instead of their models (``compression.py``);
    each child compresses its own update and keeps its own error feedback, so it is carried
    to the children as their ``NodeSettings.uplink``, and the rule folds what they decode to.
    """

    kind: str = "mean"
    privacy: PrivacyParams | None = None
    secagg: SecAggParams | None = None
    compress: CompressParams | None = None
    trim: float = 0.1  # trimmed_mean: the fraction of the contributions cut from each end, per coordinate
    byzantine: int = 0  # krum: f, the Byzantine children it tolerates
    keep: int = 1  # krum: m, the children Multi-Krum averages (1: Krum)


@dataclass(frozen=True)
class RuleTraits:
    """What a registered rule needs of the node it folds for: the config checks it before any work.

    ``params``: the ``aggregate`` keys it reads besides ``kind`` (another one set is an
    error: nothing would read it). ``whole_round``: it folds a synchronous round's cohort
    (every child's vector, or every child's step count), so not at an asynchronous server,
    which folds a buffer of K arrivals. ``robust``: it outvotes or discards outlying
    children, so no up-residual may carry children's models past it or into it (they would
    skip it). ``steps``: it reads each child's local optimiser steps, which only clients
    report (``contribute``'s ``steps``): its children must be clients, and no proxy TRAIN
    may be merged like one. ``cohort_error(params, n)``: why ``n`` contributions cannot be
    folded (None: they can); checked on the cohort where the config knows it, and on the
    contributions that came, at round time.
    """

    params: tuple[str, ...] = ()
    whole_round: bool = False
    robust: bool = False
    steps: bool = False
    cohort_error: Callable[[AggregateParams, int], str | None] | None = None


class AggregationRule(Protocol):
    """What a rule provides; see the module docstring for where each step runs."""

    def start(
        self,
        round_of: Caller,
        allocate: Allocator | None = None,
        reference: torch.Tensor | None = None,
        clip: float | None = None,
        peers: Sequence[str] = (),
    ) -> Partial:
        """An empty partial for the contributions to one round (``Caller(node, round)``: the children's caller).

        ``allocate`` (optional) gives the storage of its tensors (a worker's shared files).
        ``reference``: the model the children were sent, and ``clip`` the round's clipping
        norm (``RoundPlan.clip``), for rules that fold updates rather than models;
        ``peers``: the children the round called (``RoundPlan.peers``), for secure aggregation.
        """
        ...

    def contribute(
        self, partial: Partial, member: str, model: torch.Tensor, weight: float, steps: int | None = None
    ) -> None:
        """Fold one child's model (float32, any device) with its aggregation weight.

        ``steps``: the local optimiser steps behind a client's model (``tree.local_steps``),
        for rules that normalise by them (FedNova); None where there are none (a child server).
        """
        ...

    def merge(self, into: Partial, other: Partial) -> None:
        """Fold ``other`` (consumed) into ``into``."""
        ...

    def close(self, partial: Partial) -> bool:
        """Turn a whole round's only partial into what ``finalize`` will return, where it was folded, if the
        rule can (it draws nothing and keeps nothing from the parent); returns whether it did.

        A worker that trained all of a round's children (one batch, no child server, no proxy
        TRAIN alongside) closes its fold on its own device: less to send, nothing left to
        compute at the parent. ``finalize`` must then give the same bits it would have.
        """
        ...

    def finalize(self, partial: Partial, key: RoundKey) -> torch.Tensor:
        """The round's ``mean_input`` (float32); ``key`` seeds any draw the rule makes."""
        ...

    def wire(self, partial: Partial) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The partial as named tensors and numbers (what crosses a process boundary)."""
        ...

    def unwire(self, tensors: Mapping[str, torch.Tensor], numbers: Mapping[str, float]) -> Partial:
        """The inverse of ``wire``."""
        ...


_RULES: dict[str, Callable[[AggregateParams], AggregationRule]] = {}
_TRAITS: dict[str, RuleTraits] = {}


def register_rule(
    name: str, traits: RuleTraits | None = None
) -> Callable[[Callable[[AggregateParams], Any]], Callable[[AggregateParams], Any]]:
    """Register a rule factory ``(params) -> rule`` under ``name``; returns the factory unchanged.

    ``traits``: what the rule needs of its node (``RuleTraits``; default: nothing beyond the mean's).
    """
    if not name.isidentifier():
        raise ValueError(f"aggregation rule name must be an identifier, got {name!r}")

    def decorate(factory: Callable[[AggregateParams], Any]) -> Callable[[AggregateParams], Any]:
        if name in _RULES:
            raise ValueError(f"aggregation rule {name!r} is already registered")
        _RULES[name] = factory
        _TRAITS[name] = traits or RuleTraits()
        return factory

    return decorate


def available_rules() -> list[str]:
    return sorted(_RULES)


def rule_traits(name: str) -> RuleTraits:
    """The traits ``name`` was registered with (a KeyError for an unknown rule)."""
    return _TRAITS[name]


def rule_for(params: AggregateParams) -> AggregationRule:
    """The rule a node's ``aggregate`` settings name (DP-FedAvg's where they carry ``privacy``)."""
    if params.secagg is not None:
        return SecAggRule(params.secagg, params.privacy)
    if params.privacy is not None:
        return DpMeanRule(params.privacy)
    try:
        factory = _RULES[params.kind]
    except KeyError:
        raise ValueError(f"unknown aggregation rule {params.kind!r}; available: {available_rules()}") from None
    return factory(params)


def _sum(partial: Partial) -> WeightedSum:
    from bhfl_core.algorithm.aggregation import WeightedSum

    if not isinstance(partial, WeightedSum):
        raise TypeError(f"the mean rule folds WeightedSum partials, got {type(partial).__name__}")
    return partial


@register_rule("mean")
class MeanRule:
    """The exact example-weighted mean (FedAvg's): ``sum_i p_i x_i / sum_i p_i``, rounded once."""

    def __init__(self, params: AggregateParams) -> None:
        self.params = params

    def start(
        self,
        round_of: Caller,
        allocate: Allocator | None = None,
        reference: torch.Tensor | None = None,
        clip: float | None = None,
        peers: Sequence[str] = (),
    ) -> WeightedSum:
        from bhfl_core.algorithm.aggregation import WeightedSum

        return WeightedSum(allocate=allocate)

    def contribute(
        self, partial: Partial, member: str, model: torch.Tensor, weight: float, steps: int | None = None
    ) -> None:
        _sum(partial).add(model, weight)

    def merge(self, into: Partial, other: Partial) -> None:
        _sum(into).merge(_sum(other), consume=True)

    def close(self, partial: Partial) -> bool:
        _sum(partial).close()  # the correctly rounded mean: the same bits on any device
        return True

    def finalize(self, partial: Partial, key: RoundKey) -> torch.Tensor:
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


def _clipped(partial: Partial) -> ClippedSum:
    from bhfl_core.algorithm.privacy import as_clipped

    return as_clipped(partial)


class DpMeanRule:
    """DP-FedAvg (``privacy.py``): updates clipped where they are folded, noise and the fixed denominator at the end.

    Not in the registry: a server's ``privacy:`` settings choose it (they hold its parameters).
    """

    def __init__(self, params: PrivacyParams) -> None:
        self.params = params

    def start(
        self,
        round_of: Caller,
        allocate: Allocator | None = None,
        reference: torch.Tensor | None = None,
        clip: float | None = None,
        peers: Sequence[str] = (),
    ) -> ClippedSum:
        from bhfl_core.algorithm.privacy import ClippedSum

        return ClippedSum(reference, self.params.clip if clip is None else clip, allocate)

    def contribute(
        self, partial: Partial, member: str, model: torch.Tensor, weight: float, steps: int | None = None
    ) -> None:
        _clipped(partial).add(model)

    def merge(self, into: Partial, other: Partial) -> None:
        mine, theirs = _clipped(into), _clipped(other)
        if theirs.clip != mine.clip:
            raise ValueError(f"a fold clipped at {theirs.clip} cannot join one clipped at {mine.clip}")
        mine.total.merge(theirs.total, consume=True)
        mine.clipped += theirs.clipped

    def close(self, partial: Partial) -> bool:
        return False  # the noise is the server's to add

    def finalize(self, partial: Partial, key: RoundKey) -> torch.Tensor:
        from bhfl_core.algorithm.privacy import noised_mean

        return noised_mean(self.params, _clipped(partial), key)

    def wire(self, partial: Partial) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        from bhfl_core.algorithm.privacy import wire_counts

        clipped = _clipped(partial)
        return clipped.total.parts(), wire_counts(clipped)

    def unwire(self, tensors: Mapping[str, torch.Tensor], numbers: Mapping[str, float]) -> ClippedSum:
        from bhfl_core.algorithm.privacy import unwire

        return unwire(tensors, numbers)


def _masked(partial: Partial) -> MaskedSum:
    from bhfl_core.algorithm.secure_aggregation import MaskedSum

    if not isinstance(partial, MaskedSum):
        raise TypeError(f"the secure aggregation rule folds MaskedSum partials, got {type(partial).__name__}")
    return partial


class SecAggRule:
    """Secure aggregation (``secure_aggregation.py``): masked where folded, unmasked only as a sum by the server.

    With ``privacy`` at the same server, updates are clipped before masking and the server
    adds the noise after unmasking. Chosen by a server's ``secure_aggregation:`` settings.
    """

    def __init__(self, params: SecAggParams, privacy: PrivacyParams | None = None) -> None:
        self.params, self.privacy = params, privacy

    def start(
        self,
        round_of: Caller,
        allocate: Allocator | None = None,
        reference: torch.Tensor | None = None,
        clip: float | None = None,
        peers: Sequence[str] = (),
    ) -> MaskedSum:
        from bhfl_core.algorithm.secure_aggregation import MaskedSum

        return MaskedSum(self.params, round_of, peers, reference, self.privacy, clip)

    def contribute(
        self, partial: Partial, member: str, model: torch.Tensor, weight: float, steps: int | None = None
    ) -> None:
        _masked(partial).add(member, model, weight)

    def merge(self, into: Partial, other: Partial) -> None:
        _masked(into).merge(_masked(other))

    def close(self, partial: Partial) -> bool:
        return False  # only the server unmasks

    def finalize(self, partial: Partial, key: RoundKey) -> torch.Tensor:
        return _masked(partial).finalize(key)

    def wire(self, partial: Partial) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        return _masked(partial).wire()

    def unwire(self, tensors: Mapping[str, torch.Tensor], numbers: Mapping[str, float]) -> MaskedSum:
        from bhfl_core.algorithm.secure_aggregation import unwire

        return unwire(self.params, Caller(), (), tensors, numbers, self.privacy)


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
    clip: float | None = None,
    peers: Sequence[str] = (),
) -> FoldedRound:
    """Fold a round's child results into one partial, in child order (``order``: the node's children, itself last).

    ``reference`` / ``clip`` / ``peers``: the model the node sent its children, its clipping
    norm this round and the children it called, for DP and secure aggregation
    (``AggregationRule.start``).

    The order makes everything that is not an exact sum (candidate lists, the loss mean,
    the dropped list) the same however the children were placed or arrived. The node's
    own proxy TRAIN (member ``order[-1]``) is folded like a child, but its loss is its
    own (``Training/proxy_loss``), not one of the children's.
    """
    rank = {member: i for i, member in enumerate(order)}
    own = order[-1] if order else None

    def first(result: ChildResult) -> int:
        return min((rank.get(m, len(rank)) for m in (*result.members, *result.dropped)), default=len(rank))

    folded = FoldedRound(rule.start(key.as_caller(), reference=reference, clip=clip, peers=peers), [], {}, [])
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
        losses.update((m.member, (m.loss, m.examples)) for m in result.losses if m.member != own)
    folded.candidates.sort(key=lambda c: rank.get(c.node_id, len(rank)))
    folded.dropped.sort(key=lambda m: rank.get(m, len(rank)))
    if losses:  # summed in child-id order: the same float sum however children were batched
        ordered = [losses[k] for k in sorted(losses)]
        folded.examples = sum(n for _, n in ordered)
        folded.loss = sum(loss * n for loss, n in ordered) / max(folded.examples, 1)
    return folded


# the rules of their own modules register themselves on import; at the end, so that they find this module's names
from bhfl_core.algorithm import fednova, robust_rules  # noqa: E402, F401
