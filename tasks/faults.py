"""Fault injection for resume and error-handling tests: ``BHFL_FAULTS=point@n[:action],...``.

A real run survives SIGKILL at any moment; to *test* that at precise moments (in the
middle of a checkpoint write, during evaluation, ...) the pipeline calls ``hit(point)``
at a few named places, and the n-th hit of a listed point carries out the action.

The plan is a value, ``FaultPlan``: parsed from the environment once per run attempt
(``FaultPlan.for_run``) and held by the run's context (``RunContext.faults``); with
nothing planned (the normal case) it is ``NO_FAULTS``, and a hit costs one dict lookup.
Its hits are counted per run attempt across all the attempt's processes, in one file of
the run folder's timeline (``HITS_FILE``): the orchestrator and every worker see it, and
every attempt starts with the timeline cleared (flows/run_attempt.py), so ``client@2``
is the second client trained anywhere in this attempt. ``BHFL_FAULTS_COUNTER`` names
another file instead (a test counting across a sweep's runs or a pipeline's stages).

- ``kill`` (default): SIGKILL the run — the worker process that hit it and the
  orchestrating process (``BHFL_FAULTS_KILL_PID``) — as an out-of-memory killer or a
  lost machine would;
- ``die``: SIGKILL only the process that hit it (a worker lost mid-batch: the run goes on);
- ``raise``: a RuntimeError (a transient task failure);
- ``oom``: ``torch.OutOfMemoryError`` (what CUDA raises when the GPU is full);
- ``enospc``: ``OSError(ENOSPC)`` (disk full);
- ``pause``: the process that hits it stops itself (SIGSTOP), as at a breakpoint: a test
  acts on the run held at that point (kills its server, sends it a signal, ...), then lets
  it go on with SIGCONT. Where a test would otherwise act at a moment found by polling a
  log (anywhere in the seconds after), it acts at the same point on every run.

Points: ``prepare`` (data preparation, before the manifest is written), ``checkpoint``
(a node state written to its temporary file, not yet renamed), ``round`` (a server
round committed, its metrics not yet logged), ``client`` (a client about to train), ``eval`` (an
evaluation task about to score), ``tracking`` (the MLflow runs created, their ids not yet
in ``run.json``), ``artefacts`` (the parent run's files half logged: the data report, not
the package list), ``report`` (the report's files logged, its summary metrics not).
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bhfl_core.store.run_layout import TIMELINE_DIR

ENV = "BHFL_FAULTS"
COUNTER_ENV = "BHFL_FAULTS_COUNTER"  # a hits file of the test's choosing, instead of the run attempt's
KILL_PID_ENV = "BHFL_FAULTS_KILL_PID"  # the orchestrating process, killed with the worker that hits ``kill``
POINTS = ("prepare", "checkpoint", "round", "client", "eval", "tracking", "artefacts", "report")
ACTIONS = ("kill", "die", "raise", "oom", "enospc", "pause")
# in a folder of the timeline: the timeline's plain files are its marks (tasks/context.py, read_marks)
HITS_FILE = Path(TIMELINE_DIR) / "faults" / "hits.txt"

Planned = Mapping[str, tuple[tuple[int, str], ...]]  # point -> (n, action) of each planned hit


@dataclass(frozen=True)
class FaultPlan:
    """What ``BHFL_FAULTS`` plans for one run attempt, and the file its hits are counted in.

    Immutable: the counts are in ``counter``, which every process of the attempt appends
    to under a lock, so a plan holds nothing that outlives the attempt in a process.
    """

    planned: Planned = field(default_factory=dict)
    counter: Path | None = None  # None only with nothing planned
    kill_pid: int = 0  # the orchestrating process, for ``kill`` in a worker (0: this process alone)

    @classmethod
    def for_run(cls, run_path: Path) -> FaultPlan:
        """The plan in this process's environment for the current attempt of the run in ``run_path``."""
        planned = _parse(os.environ.get(ENV, ""))
        if not planned:
            return NO_FAULTS
        counter = Path(os.environ.get(COUNTER_ENV) or run_path / HITS_FILE)
        return cls(planned, counter, int(os.environ.get(KILL_PID_ENV) or 0))

    def hit(self, point: str, what: str = "") -> None:
        """Count one pass through ``point``; carry out the action planned for this pass, if any."""
        actions = self.planned.get(point)
        if actions and self.counter is not None:
            _carry_out(actions, point, _count_in(self.counter, point), what, self.kill_pid)

    def checkpoint_hook(self) -> Callable[[Path], None] | None:
        """The state store's between-write-and-rename hook when ``checkpoint`` faults are planned, else None."""
        if "checkpoint" not in self.planned:
            return None
        return lambda tmp: self.hit("checkpoint", tmp.name)


NO_FAULTS = FaultPlan()


def _parse(spec: str) -> Planned:
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
    return {point: tuple(actions) for point, actions in plan.items()}


def _count_in(counter: Path, point: str) -> int:
    """This hit's number at ``point``, appended to ``counter`` (an exclusive lock: processes and threads alike)."""
    counter.parent.mkdir(parents=True, exist_ok=True)
    with open(counter, "a+", encoding="utf-8") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # per open file: two threads of one process exclude each other too
        fh.seek(0)
        counts = Counter(fh.read().split())
        fh.write(f"{point}\n")
        return counts[point] + 1


def _carry_out(actions: tuple[tuple[int, str], ...], point: str, n: int, what: str, kill_pid: int) -> None:
    """The action planned for hit ``n`` of ``point``, if one is."""
    for nth, action in actions:
        if nth == n:
            detail = f"injected fault at {point} #{n}" + (f" ({what})" if what else "")
            if action == "kill" and kill_pid and kill_pid != os.getpid():
                os.kill(kill_pid, signal.SIGKILL)
            if action in ("kill", "die"):
                os.kill(os.getpid(), signal.SIGKILL)
            if action == "pause":
                os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops here until a SIGCONT
                continue
            if action == "oom":
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB ({detail})")
            if action == "enospc":
                raise OSError(errno.ENOSPC, f"No space left on device ({detail})", what or None)
            raise RuntimeError(detail)


def share_with_workers() -> dict[str, str]:
    """Environment for a run's local worker processes: the same plan and counter file, and this process to kill.

    Workers count in their run's hits file (``FaultPlan.for_run``), as this process does,
    unless a counter file is named. Every key is set, empty where unset here: workers fork
    from a process started earlier, whose environment may still hold an older plan.
    """
    if not os.environ.get(ENV):
        return {ENV: ""}
    return {ENV: os.environ[ENV], COUNTER_ENV: os.environ.get(COUNTER_ENV, ""), KILL_PID_ENV: str(os.getpid())}


def shared_counts(path: str) -> Counter[str]:
    """The hits counted so far in a counter file (tests read what the run's processes did)."""
    return Counter(Path(path).read_text(encoding="utf-8").split()) if Path(path).exists() else Counter()
