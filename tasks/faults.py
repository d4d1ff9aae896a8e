"""Fault injection for resume and error-handling tests: ``BHFL_FAULTS=point@n[:action],...``.

A real run survives SIGKILL at any moment; to *test* that at precise moments (in the
middle of a checkpoint write, during evaluation, ...) the pipeline calls ``hit(point)``
at a few named places, and the n-th hit of a listed point carries out the action. Hits
are counted per run attempt across all its processes (the orchestrator and its local
worker processes share a counter file, ``BHFL_FAULTS_COUNTER``), so ``client@2`` is
the second client trained anywhere:

- ``kill`` (default): SIGKILL the run — the worker process that hit it and the
  orchestrating process (``BHFL_FAULTS_KILL_PID``) — as an out-of-memory killer or a
  lost machine would;
- ``die``: SIGKILL only the process that hit it (a worker lost mid-batch: the run goes on);
- ``raise``: a RuntimeError (a transient task failure);
- ``oom``: ``torch.OutOfMemoryError`` (what CUDA raises when the GPU is full);
- ``enospc``: ``OSError(ENOSPC)`` (disk full).

Points: ``prepare`` (data preparation, before the manifest is written), ``checkpoint``
(a node state written to its temporary file, not yet renamed), ``round`` (a server
round committed, its metrics not yet logged), ``client`` (a client about to train), ``eval`` (an
evaluation task about to score), ``tracking`` (the MLflow runs created, their ids not yet
in ``run.json``), ``artefacts`` (the parent run's files half logged: the data report, not
the package list), ``report`` (the report's files logged, its summary metrics not).
Unset (the normal case), ``hit`` costs one dict lookup.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import tempfile
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

ENV = "BHFL_FAULTS"
COUNTER_ENV = "BHFL_FAULTS_COUNTER"  # file shared by the run's processes; unset: counted in this process
KILL_PID_ENV = "BHFL_FAULTS_KILL_PID"  # the orchestrating process, killed with the worker that hits ``kill``
POINTS = ("prepare", "checkpoint", "round", "client", "eval", "tracking", "artefacts", "report")
ACTIONS = ("kill", "die", "raise", "oom", "enospc")

_counts: Counter[str] = Counter()
_lock = threading.Lock()
_run_counter: str | None = None  # the counter file this process shares with its workers (share_with_workers)


def _plan() -> dict[str, list[tuple[int, str]]]:
    spec = os.environ.get(ENV, "").strip()
    plan: dict[str, list[tuple[int, str]]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        where, _, action = item.partition(":")
        point, _, nth = where.partition("@")
        action = action or "kill"
        if point not in POINTS or action not in ACTIONS or not nth.isdigit():
            raise ValueError(
                f"{ENV}: bad entry {item!r}; expected point@n[:action], point in {POINTS}, action in {ACTIONS}"
            )
        plan.setdefault(point, []).append((int(nth), action))
    return plan


def hit(point: str, what: str = "") -> None:
    """Count one pass through ``point``; carry out the action planned for this pass, if any."""
    plan = _plan() if ENV in os.environ else None
    if not plan or point not in plan:
        return
    n = _count(point)
    for nth, action in plan[point]:
        if nth == n:
            detail = f"injected fault at {point} #{n}" + (f" ({what})" if what else "")
            owner = int(os.environ.get(KILL_PID_ENV, "0") or 0)
            if action == "kill" and owner and owner != os.getpid():
                os.kill(owner, signal.SIGKILL)
            if action in ("kill", "die"):
                os.kill(os.getpid(), signal.SIGKILL)
            if action == "oom":
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB ({detail})")
            if action == "enospc":
                raise OSError(errno.ENOSPC, f"No space left on device ({detail})", what or None)
            raise RuntimeError(detail)


def _count(point: str) -> int:
    """This hit's number at ``point``: in the shared counter file when there is one, else in this process."""
    shared = os.environ.get(COUNTER_ENV) or _run_counter
    if not shared:
        with _lock:
            _counts[point] += 1
            return _counts[point]
    with _lock, open(shared, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        counts = Counter(fh.read().split())
        fh.write(f"{point}\n")
        return counts[point] + 1


def share_with_workers(folder: Path) -> dict[str, str]:
    """Environment for a run attempt's worker processes: the same plan, one hit counter, the process to kill.

    Counting starts afresh for every attempt (a new counter file in ``folder``, unless
    ``BHFL_FAULTS_COUNTER`` names one), shared by this process and the workers. With no
    faults planned (the normal case) the plan is set empty: workers fork from a process
    started earlier, whose environment may still hold an older plan.
    """
    global _run_counter  # noqa: PLW0603 (test-only fault plan: one counter file per attempt of this process)
    if not os.environ.get(ENV):
        return {ENV: ""}
    counter = os.environ.get(COUNTER_ENV)
    if not counter:
        folder.mkdir(parents=True, exist_ok=True)
        fd, counter = tempfile.mkstemp(prefix="faults-", suffix=".txt", dir=folder)
        os.close(fd)
        _run_counter = counter
    return {ENV: os.environ[ENV], COUNTER_ENV: counter, KILL_PID_ENV: str(os.getpid())}


def shared_counts(path: str) -> Counter[str]:
    """The hits counted so far in a counter file (tests read what the run's processes did)."""
    return Counter(Path(path).read_text().split()) if Path(path).exists() else Counter()


def checkpoint_hook() -> Callable[[Path], None] | None:
    """The state store's between-write-and-rename hook when ``checkpoint`` faults are planned, else None."""
    if "checkpoint" not in _plan():
        return None
    return lambda tmp: hit("checkpoint", tmp.name)
