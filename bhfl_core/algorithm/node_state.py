"""What a node keeps between rounds, and the identities that key its rounds.

``NodeState`` is immutable: the pure steps (``node_step.py``) return a new one and the
round loop (``engine.py``) commits it to the store once per round. ``Caller`` and
``RoundKey`` are typed identities; their one string form (``key`` / ``parts``) is what
is written to checkpoint headers and fed to seeds, and it is never parsed back.

torch appears in annotations only: reading a checkpoint's header (``bhfl runs``) builds
a ``NodeState`` without importing torch (~1.5 s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from bhfl_core.algorithm.node_opt import OptState


@dataclass(frozen=True)
class Caller:
    """Who triggered a node execution.

    A parent round (``Caller(parent_id, round)``), the run itself for the root
    (``ROOT_CALLER``), or a named purpose with no round (``Caller("adapt")``: the
    evaluation's local adaptation). Re-running an execution with the same caller
    resumes it (see ``NodeState.rounds_done_for``), and the caller is part of every seed
    of the execution, so non-persistent nodes (whose round counter never advances)
    still draw fresh numbers for every call.
    """

    node_id: str = ""
    round: int | None = None

    @property
    def key(self) -> str:
        """The stored and seeded form: ``"edge-de:3"``, ``"adapt"``, ``""`` for the root."""
        return self.node_id if self.round is None else f"{self.node_id}:{self.round}"

    def __str__(self) -> str:
        return self.key


ROOT_CALLER = Caller()


@dataclass(frozen=True)
class RoundKey:
    """One round of one node execution; seeds every draw in that round.

    ``round`` is the node's cumulative round index (``NodeState.rounds_done`` when the
    round starts).
    """

    node_id: str
    round: int
    caller: Caller = ROOT_CALLER

    def parts(self) -> tuple[str, int, str]:
        """The parts a seed is derived from (``bhfl_core.rng.derive_seed``)."""
        return (self.node_id, self.round, self.caller.key)

    def as_caller(self) -> Caller:
        """The caller identity this round gives the child executions it triggers."""
        return Caller(self.node_id, self.round)


@dataclass(frozen=True)
class NodeResult:
    """What an execution (or one TRAIN call) produced: theta_T and what its caller is told about it.

    ``loss``/``examples``: the training loss of its last round and the rows behind it (a
    client's or a proxy TRAIN's own; a server's: its children's). ``steps``: optimizer
    steps of a TRAIN call (0 for an execution). ``virtual_s``: seconds it took on the
    virtual clock (``virtual_clock.py``). Under a compressing parent ``theta`` is the model
    the parent receives (``compression.received_model``) and ``sent_bytes`` what it cost.
    """

    theta: torch.Tensor
    loss: float = math.nan
    examples: int = 0
    steps: int = 0
    virtual_s: float = 0.0
    sent_bytes: int = 0  # a compressed update's payload (``compression.py``); 0: the model went up as it is


@dataclass(frozen=True)
class InFlight:
    """A child execution an asynchronous node has sent out and not yet used."""

    child: str
    dispatch: int  # the node's running dispatch number: the child's caller is Caller(node, dispatch)
    version: int  # the node's model version the child was sent
    start: float  # virtual time it was sent (seconds since the node's execution began)
    finish: float | None  # virtual time its result arrives; None until a server child's duration is known


@dataclass(frozen=True)
class AsyncProgress:
    """An asynchronous node's work in flight at its last commit (``async_engine.py``).

    Committed with every flush, so an interrupted execution continues from its last
    flush with the same children in flight. ``dispatched`` counts on across executions:
    every dispatch gives its child a caller no earlier dispatch used. ``versions`` are
    the models in-flight children were sent (the node's older versions they need to
    compute their updates ``y - theta_v``).
    """

    dispatched: int = 0
    now: float = 0.0  # virtual seconds since the execution began
    in_flight: tuple[InFlight, ...] = ()
    versions: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeState:
    """A node's persistent model ``W_q``, its optimiser states and its place in the run.

    ``personal`` is a Ditto client's personal model, trained next to ``W_q`` and
    evaluated, never aggregated.

    ``exec_caller``/``exec_start`` record the execution the state belongs to (its
    caller's key and ``rounds_done`` when it began): the resume rule reads them.
    ``res_seen`` maps ``"<kind>/<sender>"`` to the last sender round consumed from that
    residual accumulator, so a contribution re-posted by a re-run sender is never
    counted twice.

    What the node's caller is told of its last round is state too (``saved_result``
    hands it back after a crash): ``loss``/``examples`` and ``virtual_s``, the virtual
    seconds since its execution began (the root's: since the run began); ``loss`` is None
    where there is none to report. ``child_epochs``:
    the local epochs each child's clients train next round (Tempo's schedule, at the
    root). ``rule_state``: the state of the node's aggregation rule (``rule_registry.py``;
    e.g. a DP server's clipping norm for its next round, which adaptive clipping moves).
    ``dp_steps``: a DP-SGD client's steps over all its
    TRAIN calls (its privacy accounting: ``learning/dp_sgd.py``). ``feedback``/``sent``: a child of a
    parent that compresses its updates (``compression.py``): its error-feedback residual, and the
    payload its finished execution sent (handed back again after a crash). ``down_ref``: a server
    whose broadcasts are compressed (``downlink.py``): the model its children hold. ``metrics`` is only
    the last round's log, for logging a committed round again.
    """

    model: torch.Tensor | None = None
    opt_up: OptState = field(default_factory=dict)
    opt_down: OptState = field(default_factory=dict)
    rounds_done: int = 0
    opt_res: dict[str, OptState] = field(default_factory=dict)  # per residual input kind
    exec_caller: str | None = None
    exec_start: int = 0
    metrics: dict[str, float] = field(default_factory=dict)  # the last round's metrics
    res_seen: dict[str, int] = field(default_factory=dict)
    personal: torch.Tensor | None = None  # Ditto: the client's personal model v_k (never sent anywhere)
    pending: AsyncProgress | None = None  # asynchronous nodes: children in flight and the dispatch counter
    loss: float | None = None  # None: no training loss to report (a node whose children reported none)
    examples: int = 0
    virtual_s: float = 0.0
    child_epochs: dict[str, int] = field(default_factory=dict)
    rule_state: dict[str, float] = field(default_factory=dict)  # the aggregation rule's (``rule_registry.py``)
    dp_steps: int = 0
    feedback: torch.Tensor | None = None  # error feedback: what compressing its updates has left out so far
    sent: dict[str, torch.Tensor] = field(default_factory=dict)  # the compressed update its execution sent up
    down_ref: torch.Tensor | None = None  # compress_down: the model its children hold, x_hat (``downlink.py``)

    @property
    def theta(self) -> torch.Tensor:
        """The current model; every node has one once its execution began (``node_down``)."""
        if self.model is None:
            raise ValueError("this node has no model yet: its execution has not begun")
        return self.model

    def rounds_done_for(self, caller: Caller) -> int:
        """The resume rule: rounds already done of the execution ``caller`` triggered.

        Executed again by the same caller (a re-run after a crash), a node continues after
        its last saved round, or hands back its saved result if all rounds are saved; any
        other caller starts a new execution (0).
        """
        return self.rounds_done - self.exec_start if self.exec_caller == caller.key else 0
