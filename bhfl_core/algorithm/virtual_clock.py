"""The virtual clock asynchronous execution is simulated on (issue 14; ALGORITHMS.md).

Asynchrony must not be left to thread timing, or no run could be repeated: each client
has a *speed* (optimizer steps per virtual second) drawn once from (seed, client or
group), a call's virtual duration is its steps over that speed (times a straggler
factor, drawn from (seed, client, dispatch)) plus the communication time of the two
models it moves, and results are consumed in the order of their virtual finish times.
Real workers still train many clients at once; only the order in which a node *uses*
their results follows the clock.

Speeds are log-normal with median 1 (``sigma`` 0: every client equally fast);
``per: group`` gives all clients of a language / cluster one speed (an institution's
hardware), ``per: client`` one each.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from bhfl_core.rng import generator

T = TypeVar("T")


@dataclass(frozen=True)
class ClockParams:
    sigma: float = 0.0  # log-normal spread of speeds (0: all 1)
    per: Literal["client", "group"] = "client"
    comm_s: float = 0.0  # virtual seconds per model sent (a call sends two: down and up)
    straggler_p: float = 0.0  # chance that one call runs ``straggler_factor`` times slower
    straggler_factor: float = 10.0


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


@dataclass(order=True)
class _Entry(Generic[T]):
    finish: float
    seq: int
    item: T = field(compare=False)


class ArrivalQueue(Generic[T]):
    """Work in flight, popped in virtual finish order; ties go to the lower dispatch number.

    Dispatch numbers are the caller's (a node's running count of dispatches), so a queue
    rebuilt from a checkpoint pops in the same order as the one that was lost.
    """

    def __init__(self) -> None:
        self._heap: list[_Entry[T]] = []

    def push(self, finish: float, dispatch: int, item: T) -> None:
        heapq.heappush(self._heap, _Entry(finish, dispatch, item))

    def pop(self) -> tuple[float, T]:
        entry = heapq.heappop(self._heap)
        return entry.finish, entry.item

    def __len__(self) -> int:
        return len(self._heap)
