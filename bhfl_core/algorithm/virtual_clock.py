"""The virtual clock asynchronous execution is simulated on (issue 14; ALGORITHMS.md).

Asynchrony must not be left to thread timing, or no run could be repeated: each client
has a *speed* (optimizer steps per virtual second) drawn once from (seed, client or
group), a call's virtual duration is its steps over that speed (times a straggler
factor, drawn from (seed, client, dispatch)) plus the communication time of the two
models it moves, and results are consumed in the order of their virtual finish times.
A call may also drop out (``dropout_p``, drawn from (seed, client, dispatch)): the client
is not trained and its parent learns of the loss when the call would have finished.
Real workers still train many clients at once; only the order in which a node *uses*
their results follows the clock.

Speeds are log-normal with median 1 (``sigma`` 0: every client equally fast);
``per: group`` gives all clients of a language / cluster one speed (an institution's
hardware), ``per: client`` one each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from bhfl_core.algorithm.tree import Node, planned_steps
from bhfl_core.rng import generator


@dataclass(frozen=True)
class ClockParams:
    sigma: float = 0.0  # log-normal spread of speeds (0: all 1)
    per: Literal["client", "group"] = "client"
    comm_s: float = 0.0  # virtual seconds per model sent (a call sends two: down and up)
    straggler_p: float = 0.0  # chance that one call runs ``straggler_factor`` times slower
    straggler_factor: float = 10.0
    dropout_p: float = 0.0  # chance that a client call drops out: its result never arrives


def client_speed(seed: int, client_id: str, group: str | None, params: ClockParams) -> float:
    """Optimizer steps per virtual second of a client: log-normal, median 1, seeded by who it is."""
    if params.sigma == 0:
        return 1.0
    key = group if params.per == "group" and group is not None else client_id
    return math.exp(params.sigma * float(generator(seed, "speed", key).standard_normal()))


def call_duration(steps: int, speed: float, params: ClockParams, seed: int, client_id: str, dispatch: int) -> float:
    """Virtual seconds of one client call: compute (with a seeded straggler draw) plus two model transfers."""
    compute = steps / speed
    if params.straggler_p > 0 and generator(seed, "straggler", client_id, dispatch).random() < params.straggler_p:
        compute *= params.straggler_factor
    return compute + 2 * params.comm_s


def drops_out(p: float, seed: int, client_id: str, dispatch: int) -> bool:
    """Whether one client call drops out (its result never arrives): probability ``p``, seeded by the call."""
    return p > 0 and bool(generator(seed, "dropout", client_id, dispatch).random() < p)


def client_call_s(seed: int, clock: ClockParams, client: Node, epochs: int | None, dispatch: int) -> float:
    """Virtual seconds of one call of ``client`` (its planned steps, ``epochs`` instead of its own if given).

    ``dispatch``: the call's number at its parent (a synchronous parent: its round).
    A client that does not train takes no time.
    """
    train = client.settings.train
    if train is None:
        return 0.0
    if epochs is not None:
        train = replace(train, epochs=epochs)
    speed = client_speed(seed, client.id, client.group, clock)
    return call_duration(planned_steps(int(client.weight), train), speed, clock, seed, client.id, dispatch)
