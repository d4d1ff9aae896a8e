"""The aggregation rule registry: what a rule is (``AggregationRule``), what it needs (``RuleTraits``), its name.

A rule is a value with state, like a NODEOPT. Its halves run at different places:

- ``plan(state, called)`` is the rule's part of each child's ``RoundPlan`` (``FoldPlan``:
  a DP server's clipping norm this round, the peers a secure-aggregation round masks
  with); the engine passes it down unread.
- ``contribute`` folds one child's model into a running ``Partial`` wherever it is
  made: in the worker that trained a batch of clients, in the orchestrator for a child
  server's model, in the asynchronous buffer (a stale-weighted model), and for a
  server's proxy TRAIN merged like a child. ``merge`` joins two partials (a worker's
  batch into its node's round), and ``start`` opens an empty one for a round, from the
  plan and the model the children were sent (``reference``).
- ``finalize(partial, key, state)`` turns a round's partial into ``mean_input`` inside the
  pure ``node_up``, with the round's key (a rule that draws noise draws it from (seed,
  node, round)), and returns the rule's next state (``NodeState.rule_state``: saved with
  the round, resumed with it) and the round's metric lines (``Finalized``).

Rules are registered by name like NODEOPTs (``@register_rule``) in their own modules;
configs choose one per level or node with ``aggregate: {kind: ...}``. Wrappers
(``@register_wrapper``: ``zeroing``, ``dp``, ``secagg``) are rules around another rule,
listed under ``aggregate.wrap`` outermost first, as TensorFlow Federated's aggregator
factories wrap each other. Every rule's partial travels between processes as named
tensors plus numbers (``wire`` / ``unwire``), so the transport
(bhfl_core/store/transfer.py) needs to know nothing about the rule. Looking a rule up is
``rules.py``'s: it imports every module that registers one, so this module stays below
them all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from bhfl_core.algorithm.adapter_fold import AdapterFold
from bhfl_core.algorithm.compression import CompressParams
from bhfl_core.algorithm.contract import NO_PLAN, FoldPlan, Partial
from bhfl_core.algorithm.node_state import Caller, RoundKey
from bhfl_core.algorithm.privacy_params import PrivacyParams, SecAggParams, ZeroingParams

if TYPE_CHECKING:  # imported where used: configs validate rule names without loading torch
    import torch

    from bhfl_core.algorithm.aggregation import Allocator

RuleState = Mapping[str, float]
"""A rule's state between rounds (``NodeState.rule_state``): named numbers, each wrapper's under its own prefix."""

WrapperParams = ZeroingParams | PrivacyParams | SecAggParams
"""The parameters of one wrapper in ``AggregateParams.wrappers``; its type names the wrapper."""


@dataclass(frozen=True)
class AggregateParams:
    """A node's aggregation rule (``aggregate:`` in the config): the rule ``kind`` inside its ``wrappers``.

    ``wrappers``: outermost first (``zeroing`` before ``dp`` before ``secagg``; the config
    checks the order). ``compress``: what the node's children send instead of their models
    (``compression.py``); each child compresses its own update and keeps its own error
    feedback, so it is carried to the children as their ``NodeSettings.uplink``, and the
    rule folds what they decode to. ``adapter``: in a LoRA run, how the adapters' A and B
    are folded (``model.adapter.aggregation``); the ``adapter`` wrapper then sits directly
    around ``kind`` (``rules.rule_for``), inside every listed wrapper.
    """

    kind: str = "mean"
    wrappers: tuple[WrapperParams, ...] = ()
    compress: CompressParams | None = None
    trim: float = 0.1  # trimmed_mean: the fraction of the contributions cut from each end, per coordinate
    byzantine: int = 0  # krum: f, the Byzantine children it tolerates
    keep: int = 1  # krum: m, the children Multi-Krum averages (1: Krum)
    adapter: AdapterFold | None = None  # LoRA: the ``adapter`` wrapper, innermost (``adapter_rule.py``)

    def _wrapper(self, kind: type) -> Any:
        return next((w for w in self.wrappers if isinstance(w, kind)), None)

    @property
    def privacy(self) -> PrivacyParams | None:
        """The ``dp`` wrapper's parameters (client-level DP-FedAvg), if the node has one."""
        return self._wrapper(PrivacyParams)  # type: ignore[no-any-return]

    @property
    def secagg(self) -> SecAggParams | None:
        """The ``secagg`` wrapper's parameters (masked sums), if the node has one."""
        return self._wrapper(SecAggParams)  # type: ignore[no-any-return]

    @property
    def zeroing(self) -> ZeroingParams | None:
        """The ``zeroing`` wrapper's parameters, if the node has one."""
        return self._wrapper(ZeroingParams)  # type: ignore[no-any-return]

    def inner(self) -> AggregateParams:
        """These settings without their outermost wrapper (what that wrapper wraps)."""
        return replace(self, wrappers=self.wrappers[1:])


class Finalized(NamedTuple):
    """What ``finalize`` returns: the round's mean input (float32), the rule's next state, its metric lines."""

    input: torch.Tensor
    state: RuleState
    metrics: dict[str, float]


NO_STATE: RuleState = MappingProxyType({})
"""The state of a rule that keeps none (every rule's before its first round)."""


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
    """What a rule provides; see the module docstring for where each step runs.

    ``distinct_members``: a fold may hold at most one contribution per child (``dp``: its
    sensitivity is one child's clipped update). A synchronous round calls each child once;
    an asynchronous node then sends no child whose result is already in its buffer.
    ``reports_up``: the node may tell its parent its children's training loss and examples
    (not past ``dp`` or ``secagg``: the parent may learn only the noised or masked sum).
    ``sees_members``: the node may see each child's training loss (not under ``secagg``,
    whose server sees only the masked sum).
    """

    distinct_members: bool
    reports_up: bool
    sees_members: bool

    def plan(self, state: RuleState, called: Sequence[str]) -> FoldPlan:
        """The rule's part of this round's child plans, from its state and the children the round called."""
        ...

    def start(
        self,
        round_of: Caller,
        plan: FoldPlan = NO_PLAN,
        reference: torch.Tensor | None = None,
        allocate: Allocator | None = None,
    ) -> Partial:
        """An empty partial for the contributions to one round (``Caller(node, round)``: the children's caller).

        ``plan``: this round's ``FoldPlan`` (from ``plan``); ``reference``: the model the
        children were sent, for rules that fold updates rather than models; ``allocate``
        (optional) gives the storage of its tensors (a worker's shared files).
        """
        ...

    def contribute(
        self, partial: Partial, member: str, model: torch.Tensor, weight: float, steps: float | None = None
    ) -> None:
        """Fold one child's model (float32, any device) with its aggregation weight.

        ``steps``: how many steps' worth of gradient a client's model moved by, FedNova's
        ``||a_i||_1`` (``fednova_norm.local_norm``: its optimiser steps for plain SGD), for rules
        that normalise by them; None where there are none (a child server).
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

    def finalize(self, partial: Partial, key: RoundKey, state: RuleState = NO_STATE) -> Finalized:
        """The round's ``mean_input`` (float32), the rule's state after it and its metric lines; ``key`` seeds any
        draw the rule makes."""
        ...

    def wire(self, partial: Partial) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The partial as named tensors and numbers (what crosses a process boundary)."""
        ...

    def unwire(self, tensors: Mapping[str, torch.Tensor], numbers: Mapping[str, float]) -> Partial:
        """The inverse of ``wire``."""
        ...


class WrapperPartial:
    """A wrapper's fold: the partial of the rule it wraps (``inner``), and the model the children were sent
    (``reference``: what their updates are measured against, copied once per device and fold, so a GPU worker's
    clients share one copy). Nothing of the reference is sent anywhere: the parent has it."""

    needs_reference = "this wrapper measures updates against the model the children were sent: none was given"

    def __init__(self, inner: Partial, reference: torch.Tensor | None) -> None:
        self.inner, self.reference = inner, reference
        self._reference_on: dict[Any, torch.Tensor] = {}

    @property
    def weight(self) -> float:
        return self.inner.weight

    @property
    def empty(self) -> bool:
        return self.inner.empty

    def reference_on(self, device: torch.device) -> torch.Tensor:
        if self.reference is None:
            raise ValueError(self.needs_reference)
        if device not in self._reference_on:
            self._reference_on[device] = self.reference.to(device)
        return self._reference_on[device]


class Stateless:
    """The state half of a rule that keeps none and adds nothing to its children's plans (the mean, the robust
    rules, FedNova): such a rule only writes ``mean_input``."""

    distinct_members = False
    reports_up = True
    sees_members = True

    def plan(self, state: RuleState, called: Sequence[str]) -> FoldPlan:
        return NO_PLAN

    def mean_input(self, partial: Partial, key: RoundKey) -> torch.Tensor:
        raise NotImplementedError

    def finalize(self, partial: Partial, key: RoundKey, state: RuleState = NO_STATE) -> Finalized:
        return Finalized(self.mean_input(partial, key), state, {})


RuleFactory = Callable[[AggregateParams], Any]
WrapperFactory = Callable[[Any, Any], Any]  # (the wrapper's parameters, the rule it wraps) -> the rule

_RULES: dict[str, RuleFactory] = {}
_TRAITS: dict[str, RuleTraits] = {}
_WRAPPERS: dict[type, tuple[str, WrapperFactory]] = {}


def register_rule(name: str, traits: RuleTraits | None = None) -> Callable[[RuleFactory], RuleFactory]:
    """Register a rule factory ``(params) -> rule`` under ``name``; returns the factory unchanged.

    ``traits``: what the rule needs of its node (``RuleTraits``; default: nothing beyond the mean's).
    """
    if not name.isidentifier():
        raise ValueError(f"aggregation rule name must be an identifier, got {name!r}")

    def decorate(factory: RuleFactory) -> RuleFactory:
        if name in _RULES:
            raise ValueError(f"aggregation rule {name!r} is already registered")
        _RULES[name] = factory
        _TRAITS[name] = traits or RuleTraits()
        return factory

    return decorate


def register_wrapper(name: str, params: type) -> Callable[[WrapperFactory], WrapperFactory]:
    """Register a wrapper factory ``(its params, inner rule) -> rule``, chosen by the type of its ``params``."""

    def decorate(factory: WrapperFactory) -> WrapperFactory:
        if params in _WRAPPERS:
            raise ValueError(f"a wrapper for {params.__name__} is already registered ({_WRAPPERS[params][0]!r})")
        _WRAPPERS[params] = (name, factory)
        return factory

    return decorate


def registered_names() -> list[str]:
    """The names registered so far (``rules.available_rules``: all of them)."""
    return sorted(_RULES)


def registered(name: str) -> tuple[RuleFactory, RuleTraits]:
    """The factory and traits registered under ``name`` (a KeyError if none is)."""
    return _RULES[name], _TRAITS[name]


def registered_wrapper(params: WrapperParams | AdapterFold) -> WrapperFactory:
    """The wrapper factory ``params`` belong to (a KeyError if none is registered for their type)."""
    return _WRAPPERS[type(params)][1]
