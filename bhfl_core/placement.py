"""Placement of a round's clients onto worker slots (Pollen, seeds/004 appendix).

A slot is one worker process (a Dask worker: one device, one training at a time);
several slots may share a GPU (``runtime.workers_per_device``). Each slot gets a list
of jobs it runs back to back in one call (push-based placement: one round trip per
slot and round instead of one per client). Policies:

- ``lpt``: longest processing time first — jobs by optimizer steps, largest first,
  each to the slot with the least work so far (Pollen's BU: balances homogeneous
  slots without any measurement);
- ``round_robin``: jobs in input order dealt to the slots in turn (Pollen's RR);
- ``learned``: each job's time predicted per slot by a ``TimeModel`` fitted on what
  the workers measured (seconds = a + b x steps, per device kind), jobs largest
  first, each to the slot where it would *finish* earliest — so a fast GPU takes
  more work than a slow one. After Pollen's LB, which differs in its time model, in
  dealing the first round round-robin, and in giving each client to the least-loaded
  worker (docs/runtime.md, Placement). Before anything was measured it is ``lpt``.

Placement never changes results: workers return weighted sums whose mean does not
depend on the grouping (bhfl_core/algorithm/aggregation.py). It is deterministic for the same
inputs, so a resumed run places the same way.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields

POLICIES = ("lpt", "round_robin", "learned")


@dataclass(frozen=True)
class Slot:
    """One worker process of the executor."""

    name: str  # the executor's worker name (unique)
    device: str  # "cpu", "cuda:0", ...
    kind: str  # device kind the time model is keyed by: "cpu" or the GPU's name


@dataclass(frozen=True)
class Job:
    """One unit of placement: a client to train (or a model to score)."""

    id: str  # client (or model) id
    batches: int  # optimizer steps it will take (or inference batches), >= 0


@dataclass(frozen=True)
class Assignment:
    """The jobs one slot runs back to back in one call."""

    slot: Slot
    jobs: tuple[str, ...]  # job ids, in the input order
    predicted_s: float  # predicted busy time (NaN when the policy has no time model)


Line = tuple[float, float]
"""(a, b) of a time model line: seconds = a + b * batches, a >= 0 and b >= 0."""


@dataclass
class _Fit:
    """Centred sufficient statistics of (batches, seconds) points, for a least-squares line.

    Five numbers whatever the number of points, so the model persisted in the run
    folder stays small; centred (Welford / Chan et al.) so that a long run with many
    similar job sizes loses no precision to cancellation.
    """

    n: float = 0.0
    mean_x: float = 0.0
    mean_y: float = 0.0
    sxx: float = 0.0  # sum (x - mean_x)^2
    sxy: float = 0.0  # sum (x - mean_x)(y - mean_y)

    def merge(self, other: _Fit) -> None:
        n = self.n + other.n
        if other.n == 0 or n == 0:
            return
        dx, dy = other.mean_x - self.mean_x, other.mean_y - self.mean_y
        share = other.n / n
        self.sxx += other.sxx + dx * dx * self.n * share
        self.sxy += other.sxy + dx * dy * self.n * share
        self.mean_x += dx * share
        self.mean_y += dy * share
        self.n = n

    def line(self) -> Line | None:
        """The least-squares line with a >= 0 and b >= 0; None without data.

        The constraints keep predictions sensible on noisy data (Pollen observes
        small clients whose times scatter enough to give a plain fit a negative
        slope): a job never takes negative time, nor less time for more batches.
        When the plain fit breaks one, the better of the two boundary fits is taken:
        through the origin (``a = 0``; also the fit for a single point or for points
        of one size) or constant (``b = 0``).
        """
        if self.n == 0:
            return None
        raw_xx = self.sxx + self.n * self.mean_x * self.mean_x
        raw_xy = self.sxy + self.n * self.mean_x * self.mean_y
        if self.n >= 2 and self.sxx > 1e-12 * raw_xx:
            b = self.sxy / self.sxx
            a = self.mean_y - b * self.mean_x
            if a >= 0 and b >= 0:
                return a, b
        constant_gain = self.n * self.mean_y * self.mean_y  # sum of squares explained by each candidate
        if raw_xx > 0 and raw_xy * raw_xy / raw_xx >= constant_gain:
            return 0.0, raw_xy / raw_xx
        return self.mean_y, 0.0


@dataclass
class TimeModel:
    """Seconds per job = a + b x batches, fitted per device kind from measurements (JSON-able).

    A kind without measurements of its own is predicted from all kinds pooled (a
    worker on a new GPU type still gets work sized by what the others measured).
    """

    fits: dict[str, _Fit] = field(default_factory=dict)

    def observe(self, kind: str, batches: int, seconds: float) -> None:
        """Add one measurement; failed or meaningless timings (<= 0, NaN, inf) are ignored."""
        if not (math.isfinite(seconds) and seconds > 0 and batches >= 0):
            return
        self.fits.setdefault(kind, _Fit()).merge(_Fit(1.0, float(batches), float(seconds)))

    def merge(self, other: TimeModel) -> None:
        """Add another model's measurements (e.g. from a concurrent node execution)."""
        for kind, fit in other.fits.items():
            self.fits.setdefault(kind, _Fit()).merge(fit)

    def line(self, kind: str) -> Line | None:
        """(a, b) for ``kind``: its own fit, else the pooled fit; None when nothing was measured."""
        own = self.fits.get(kind)
        if own is not None and own.n > 0:
            return own.line()
        pooled = _Fit()
        for name in sorted(self.fits):  # sorted: the pooled float sums do not depend on insertion order
            pooled.merge(self.fits[name])
        return pooled.line()

    def predict(self, kind: str, batches: int) -> float:
        """Predicted seconds (NaN when nothing was measured yet)."""
        line = self.line(kind)
        return math.nan if line is None else line[0] + line[1] * batches

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {kind: {f.name: getattr(fit, f.name) for f in fields(fit)} for kind, fit in sorted(self.fits.items())}

    @classmethod
    def from_dict(cls, data: Mapping[str, Mapping[str, float]]) -> TimeModel:
        return cls({kind: _Fit(**{k: float(v) for k, v in fit.items()}) for kind, fit in data.items()})


def place(jobs: Sequence[Job], slots: Sequence[Slot], policy: str, model: TimeModel | None = None) -> list[Assignment]:
    """Assign every job to exactly one slot.

    Returns at most one assignment per slot, none empty, in slot order (so fewer
    assignments than slots when there are fewer jobs). ``model`` is used by
    ``learned`` only; without measurements ``learned`` places like ``lpt``.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown placement policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if not slots:
        raise ValueError("placement needs at least one worker slot, got none")
    if len({s.name for s in slots}) != len(slots):
        raise ValueError(f"placement: worker slot names must be unique, got {[s.name for s in slots]}")
    twice = sorted(id_ for id_, n in Counter(j.id for j in jobs).items() if n > 1)
    if twice:
        raise ValueError(f"placement: job ids must be unique, got {twice} more than once")
    if any(j.batches < 0 for j in jobs):
        raise ValueError(f"placement: negative batches for {[j.id for j in jobs if j.batches < 0]}")

    # once anything was measured every kind has a line (its own or the pooled one)
    lines = {s.kind: model.line(s.kind) for s in slots} if policy == "learned" and model is not None else {}
    if policy == "round_robin":
        bins = [list(range(k, len(jobs), len(slots))) for k in range(len(slots))]
        busy = [math.nan] * len(slots)
    elif lines and all(line is not None for line in lines.values()):
        kind_lines = [line for s in slots if (line := lines[s.kind]) is not None]  # all measured
        bins, busy = _earliest_finish(
            [j.batches for j in jobs], len(slots), lambda i, k: kind_lines[k][0] + kind_lines[k][1] * jobs[i].batches
        )
    else:  # lpt, and learned before anything was measured
        bins, _ = _earliest_finish([j.batches for j in jobs], len(slots), lambda i, k: float(jobs[i].batches))
        busy = [math.nan] * len(slots)
    return [
        Assignment(slot, tuple(jobs[i].id for i in sorted(b)), busy[k])
        for k, (slot, b) in enumerate(zip(slots, bins))
        if b
    ]


def split_by_load(items: Sequence[str], loads: Sequence[float], workers: int) -> list[list[str]]:
    """``lpt`` on bare loads: at most ``workers`` non-empty lists, items in input order.

    The pre-``place`` interface, kept while callers (tests/core/test_pieces.py) still use it.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if len(items) != len(loads):
        raise ValueError("items and loads differ in length")
    bins, _ = _earliest_finish(list(loads), workers, lambda i, k: float(loads[i]))
    return [[items[i] for i in sorted(b)] for b in bins if b]


def _earliest_finish(
    sizes: Sequence[float], slots: int, cost: Callable[[int, int], float]
) -> tuple[list[list[int]], list[float]]:
    """Largest job first, each to the slot where it would finish earliest; ties: input order, then slot order.

    ``cost(i, k)``: time of job ``i`` on slot ``k``. With the same cost on every slot
    this is plain LPT (to the least-loaded slot). Jobs go by ``sizes`` (batches): every
    time-model line is non-decreasing in batches, so this is also predicted-time order.
    """
    bins: list[list[int]] = [[] for _ in range(slots)]
    finish = [0.0] * slots
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        ends = [finish[k] + cost(i, k) for k in range(slots)]
        k = min(range(slots), key=lambda k: (ends[k], k))
        bins[k].append(i)
        finish[k] = ends[k]
    return bins, finish


def utilisation(
    intervals: Mapping[str, Sequence[tuple[float, float]]], slots: int, span: tuple[float, float]
) -> tuple[float, float]:
    """(mean busy share of ``slots`` workers over ``span``, share of ``span`` with every worker busy).

    ``intervals``: each worker's busy (start, end) times; one worker's overlapping
    intervals are merged, everything is clipped to the span, a worker without
    intervals (or missing from the mapping) is idle. The second number is what
    placement is judged by: time during which no worker waits for the others. NaN
    for an empty span.
    """
    if slots < 1:
        raise ValueError(f"utilisation needs at least one worker slot, got {slots}")
    if len(intervals) > slots:
        raise ValueError(f"utilisation: intervals for {len(intervals)} workers, more than the {slots} slots")
    start, end = span
    length = end - start
    if not length > 0:
        return math.nan, math.nan
    merged = [
        _merge([(max(a, start), min(b, end)) for a, b in ivs if min(b, end) > max(a, start)])
        for ivs in intervals.values()
    ]
    busy = sum(b - a for ivs in merged for a, b in ivs)
    if len(merged) < slots:
        return busy / (slots * length), 0.0
    every = merged[0]
    for ivs in merged[1:]:
        every = _intersect(every, ivs)
    return busy / (slots * length), sum(b - a for a, b in every) / length


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of intervals as sorted disjoint intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intersection of two sorted lists of disjoint intervals."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out
