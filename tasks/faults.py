"""Fault injection for resume and error-handling tests: ``BHFL_FAULTS=point@n[:action],...``.

A real run survives SIGKILL at any moment; to *test* that at precise moments (in the
middle of a checkpoint write, during evaluation, ...) the pipeline calls ``hit(point)``
at a few named places, and the n-th hit of a listed point in this process carries out
the action:

- ``kill`` (default): SIGKILL this process, as an out-of-memory killer or a lost node would;
- ``raise``: a RuntimeError (a transient task failure);
- ``oom``: ``torch.OutOfMemoryError`` (what CUDA raises when the GPU is full);
- ``enospc``: ``OSError(ENOSPC)`` (disk full).

Points: ``prepare`` (data preparation, before the manifest is written), ``checkpoint``
(a node state written to its temporary file, not yet renamed), ``round`` (a server
round finished and saved), ``client`` (a client about to train), ``eval`` (an
evaluation task about to score). Unset (the normal case), ``hit`` costs one dict lookup.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
from collections import Counter
from collections.abc import Callable

from pathlib import Path

import torch

ENV = "BHFL_FAULTS"
POINTS = ("prepare", "checkpoint", "round", "client", "eval")
ACTIONS = ("kill", "raise", "oom", "enospc")

_counts: Counter[str] = Counter()
_lock = threading.Lock()


def _plan() -> dict[str, list[tuple[int, str]]]:
    spec = os.environ.get(ENV, "").strip()
    plan: dict[str, list[tuple[int, str]]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        where, _, action = item.partition(":")
        point, _, nth = where.partition("@")
        action = action or "kill"
        if point not in POINTS or action not in ACTIONS or not nth.isdigit():
            raise ValueError(f"{ENV}: bad entry {item!r}; expected point@n[:action], point in {POINTS}, action in {ACTIONS}")
        plan.setdefault(point, []).append((int(nth), action))
    return plan


def hit(point: str, what: str = "") -> None:
    """Count one pass through ``point``; carry out the action planned for this pass, if any."""
    plan = _plan() if ENV in os.environ else None
    if not plan or point not in plan:
        return
    with _lock:
        _counts[point] += 1
        n = _counts[point]
    for nth, action in plan[point]:
        if nth == n:
            detail = f"injected fault at {point} #{n}" + (f" ({what})" if what else "")
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if action == "oom":
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB ({detail})")
            if action == "enospc":
                raise OSError(errno.ENOSPC, f"No space left on device ({detail})", what or None)
            raise RuntimeError(detail)


def checkpoint_hook() -> Callable[[Path], None] | None:
    """The state store's between-write-and-rename hook when ``checkpoint`` faults are planned, else None."""
    if "checkpoint" not in _plan():
        return None
    return lambda tmp: hit("checkpoint", tmp.name)
