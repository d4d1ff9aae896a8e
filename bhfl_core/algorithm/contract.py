"""What travels between a parent round and its children: a plan goes down, a result comes up.

Every way a child can be run — a client in a worker's batch, a child server as a
Prefect subflow or a plain call, an asynchronous dispatch, a server's own proxy TRAIN
merged like a child — speaks these two types, so the parent folds every child the same
way (``aggregation_rule.fold_results``) and a rule that changes what a contribution is
(clipping and noise, masking, compression) has one place to do it.

- ``RoundPlan`` goes down with the parent's model: who calls (the caller identity every
  seed of the child's execution derives from) and the round's settings for the child's
  subtree (Tempo's local epochs), and the parent rule's part (``FoldPlan``). It is frozen
  and small: it crosses process boundaries as a task argument.
- ``ChildResult`` comes up: one child's model (a child server, an asynchronous client
  call, a proxy TRAIN), or the rule's fold of several children's models (a worker's
  batch of clients), with what the parent needs of them — aggregation weight, training
  examples and loss, virtual duration, who was dropped, residual candidates, and timings
  for placement. Nothing a parent relies on travels in a metrics dict.

Tensors are ``torch.Tensor`` here; across processes ``bhfl_core/store/transfer.py``
carries them as shared-memory references, not in the pickled result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from bhfl_core.algorithm.node_state import Caller

if TYPE_CHECKING:
    import torch

    from bhfl_core.algorithm.residuals import Candidate


@dataclass(frozen=True)
class FoldPlan:
    """A parent rule's part of its children's ``RoundPlan``: what folding a child's model needs, where it is folded.

    Made by the parent's rule (``AggregationRule.plan``) from its state, read by the same
    rule's ``start`` in the worker or orchestrator that folds the child; the engine passes
    it on unread. ``numbers``: named values, each wrapper's under its own prefix (the
    ``dp`` wrapper's clipping norm this round, ``dp/clip``: adaptive, so it is the rule's
    state); ``peers``: the children the round called (secure aggregation masks with a
    pairwise mask per peer); ``drawn``: random bytes the rule drew for the round where it
    planned it (secure aggregation's root secret with ``randomness: secure``: simulated key
    distribution by the orchestrator).
    """

    numbers: tuple[tuple[str, float], ...] = ()
    peers: tuple[str, ...] = ()
    drawn: bytes = b""

    def number(self, name: str) -> float | None:
        """The value named ``name``, or None if the plan has none."""
        return next((value for key, value in self.numbers if key == name), None)

    def with_number(self, name: str, value: float) -> FoldPlan:
        rest = tuple((k, v) for k, v in self.numbers if k != name)
        return FoldPlan((*rest, (name, value)), self.peers, self.drawn)

    def with_peers(self, peers: Sequence[str], drawn: bytes = b"") -> FoldPlan:
        return FoldPlan(self.numbers, tuple(peers), drawn)


NO_PLAN = FoldPlan()


@dataclass(frozen=True)
class RoundPlan:
    """What a parent round tells one child besides its model.

    ``epochs``: the local epochs of the clients under the child this round, instead of
    their configured ``train.epochs`` (Tempo, seeds/001; None: their own). A server
    passes its plan's ``epochs`` on to its own children. ``fold``: the parent rule's part
    (``FoldPlan``), used where the child's model is folded; it is not passed further down.
    """

    caller: Caller
    epochs: int | None = None
    fold: FoldPlan = NO_PLAN

    def for_child(self, caller: Caller) -> RoundPlan:
        """The plan this node's round gives its children: its own round's epochs, under a new caller."""
        return RoundPlan(caller, self.epochs)


ROOT_PLAN = RoundPlan(Caller())


class Partial(Protocol):
    """A rule's running fold of child contributions (``aggregation_rule.py``).

    It travels as named tensors plus JSON-able numbers (``AggregationRule.wire``), and
    knows the total aggregation weight it holds.
    """

    @property
    def weight(self) -> float: ...

    @property
    def empty(self) -> bool: ...


@dataclass(frozen=True)
class MemberLoss:
    """One child's training loss in its last round and the examples it was measured on."""

    member: str
    loss: float
    examples: int


@dataclass(frozen=True)
class Work:
    """One client training as the worker that ran it saw it (placement's time model learns from these)."""

    node_id: str
    steps: int
    seconds: float
    device_kind: str


@dataclass(frozen=True, kw_only=True)
class ChildResult:
    """What comes up to a parent from one child execution, or from a worker's batch of them.

    Exactly one of ``model`` (one child's theta_T, contributed by the parent with
    ``weight``) and ``partial`` (the contributions of ``members``, folded where they
    were made) is set, unless every member was dropped. ``losses``: each member's
    last-round training loss and the rows behind it (per member, so the parent's mean is
    summed in one order however members were batched). ``virtual_s``: the longest
    member's duration on the virtual clock. ``dropped``: members that failed and were
    left out. ``candidates``: residual candidates (the running top-K a worker keeps).
    ``work``: client trainings done for this result. ``sent_bytes``: the compressed updates the
    members sent (``compression.py``; 0 when they sent their models as they are).

    Built by keyword only: ten fields, several of one type (``members``/``dropped``,
    ``weight``/``virtual_s``), so a positional call could swap two without an error.
    """

    members: tuple[str, ...] = ()
    model: torch.Tensor | None = None
    weight: float = 0.0
    partial: Partial | None = None
    losses: tuple[MemberLoss, ...] = ()
    virtual_s: float = 0.0
    dropped: tuple[str, ...] = ()
    candidates: tuple[Candidate, ...] = ()
    work: tuple[Work, ...] = field(default=())
    sent_bytes: int = 0

    @property
    def folded(self) -> bool:
        """Whether it carries anything to aggregate (False: every member was dropped)."""
        return self.model is not None or (self.partial is not None and not self.partial.empty)
