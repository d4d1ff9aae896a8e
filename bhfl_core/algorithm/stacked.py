"""A partial that keeps every child's model by name: what rules that look at each vector fold into.

The mean's partial is a running sum (``aggregation.WeightedSum``): children never meet in
memory. A coordinate-wise median, a trimmed mean or Krum must see all of a round's
vectors at once, so their partial (``StackedModels``) keeps them, one row per member,
keyed by the member's name:

- ``add`` stores a child's model (a float32 copy in storage ``allocate`` gives, e.g. a
  worker's shared-memory transfer file, as ``WeightedSum`` does; without it, the tensor
  itself, on its device);
- ``merge`` is the union of two partials' members (a member in both is an error: it
  would count twice), taking the other's tensors over without copying;
- ``wire`` / ``unwire`` carry the rows as named tensors (``row0``, ``row1``, ... the
  names they were allocated under, so a worker's rows travel without a copy) and, as
  numbers, each member's row index (``member.<name>``) and weight (``weight.<name>``).

Nothing here depends on the order of ``add`` and ``merge`` calls: the rules read the
rows sorted by member name (``ordered``), so what they compute is the same however the
children were spread over workers or in which order they arrived.

Memory: ``k`` children of ``P`` parameters hold ``4kP`` bytes (float32 rows) where they
are folded (a worker's batch: its own clients' rows, in shared-memory files on a CPU
worker, on the GPU on a GPU worker) and ``4kP`` bytes at the parent once the round's
batches are merged (mapped files: the parent's process reads the workers' pages). At
110M parameters that is 440 MB per child: a cohort of 100 holds 44 GB, where the mean
holds 1.8 GB whatever the cohort. The rules' own work runs over column blocks of
``BLOCK`` parameters, so it adds only ``O(k * BLOCK)`` scratch to that.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from bhfl_core.algorithm.aggregation import CLOSED, Allocator
from bhfl_core.algorithm.node_state import Caller

ROW = "row"
"""Tensor names of the rows on the wire: ``row0``, ``row1``, ..."""
MEMBER = "member."
"""Wire numbers: ``member.<name>`` is the index of the member's row."""
WEIGHT = "weight."
"""Wire numbers: ``weight.<name>`` is the member's aggregation weight (its training examples)."""
BLOCK = 1 << 16
"""Parameters per column block of a rule's work: 64K x k rows of scratch. Fixed, not device-dependent: Krum's
distances are summed block by block, so the block is part of what makes them the same bits everywhere."""


@dataclass(frozen=True)
class Member:
    """One stacked contribution, as the rules read it: name, model (flat float32) and aggregation weight."""

    name: str
    row: torch.Tensor
    weight: float


class StackedModels:
    """A round's contributions kept by member name (see the module docstring); ``closed``: the result, once
    ``close`` computed it where the rows were folded."""

    def __init__(self, round_of: Caller | None = None, allocate: Allocator | None = None) -> None:
        self.round_of = round_of or Caller()
        self.rows: dict[str, torch.Tensor] = {}
        self.weights: dict[str, float] = {}
        self.parts: dict[str, str] = {}  # member -> the tensor name its row travels under
        self.closed: torch.Tensor | None = None
        self._closed_weight = 0.0
        self._allocate = allocate
        self._next = 0

    @property
    def weight(self) -> float:
        """The members' total weight (their training examples), summed exactly."""
        return self._closed_weight if self.closed is not None else math.fsum(self.weights.values())

    @property
    def empty(self) -> bool:
        return not self.rows and self.closed is None

    def __len__(self) -> int:
        return len(self.rows)

    def ordered(self) -> list[Member]:
        """The members sorted by name: the one order every rule computes in."""
        return [Member(m, self.rows[m], self.weights[m]) for m in sorted(self.rows)]

    def add(self, member: str, model: torch.Tensor, weight: float) -> None:
        """Keep ``member``'s model (float32, any device) with its weight."""
        self._check_open()
        if not weight > 0:
            raise ValueError(f"aggregation weight must be positive, got {weight} for {member!r}")
        if member in self.rows:
            raise ValueError(f"{member!r} contributed twice to one round of {self.round_of.key!r}")
        flat = model.detach().reshape(-1)
        if self.rows:
            self._check_size(member, flat)
        part = self._part()
        if self._allocate is not None:
            row = self._allocate(part, flat.numel(), torch.float32)
            row.copy_(flat)
        else:  # nothing changes a model tensor in place (transfer.py): keeping it is keeping its value
            row = flat if flat.dtype == torch.float32 else flat.float()
        self.rows[member], self.weights[member], self.parts[member] = row, float(weight), part

    def merge(self, other: StackedModels) -> None:
        """Take ``other``'s members over (consumed; their tensors are not copied)."""
        if other.closed is not None:
            if not self.empty:
                raise ValueError("a closed fold (a whole round's result) cannot join other contributions")
            self.closed, self._closed_weight = other.closed, other._closed_weight
            return
        self._check_open()
        for member in sorted(other.rows):
            if member in self.rows:
                raise ValueError(f"{member!r} contributed twice to one round of {self.round_of.key!r}")
            if self.rows:
                self._check_size(member, other.rows[member])
            self.rows[member], self.weights[member] = other.rows[member], other.weights[member]
            self.parts[member] = self._part()

    def close_with(self, result: Callable[[StackedModels], torch.Tensor]) -> None:
        """Replace the rows by ``result(self)`` (a whole round's, computed where it was folded) and free them."""
        if self.closed is not None or not self.rows:
            return
        out = result(self)
        if self._allocate is not None:
            stored = self._allocate(CLOSED, out.numel(), torch.float32)
            stored.copy_(out.reshape(-1))
            out = stored
        self.closed, self._closed_weight = out, self.weight
        self.rows, self.weights, self.parts = {}, {}, {}

    def wire(self) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The rows under their part names, each member's row index and weight as numbers (a closed fold: its
        result and total weight)."""
        if self.closed is not None:
            return {CLOSED: self.closed}, {"weight": self._closed_weight}
        tensors = {self.parts[m]: row for m, row in self.rows.items()}
        numbers = {f"{MEMBER}{m}": float(self.parts[m][len(ROW) :]) for m in self.rows}
        numbers.update({f"{WEIGHT}{m}": w for m, w in self.weights.items()})
        return tensors, numbers

    def _part(self) -> str:
        part = f"{ROW}{self._next}"
        self._next += 1
        return part

    def _check_open(self) -> None:
        if self.closed is not None:
            raise ValueError("a closed fold (a whole round's result) takes no more contributions")

    def _check_size(self, member: str, row: torch.Tensor) -> None:
        size = next(iter(self.rows.values())).numel()
        if row.numel() != size:
            raise ValueError(f"{member!r} sent {row.numel()} parameters, the round's other children {size}")


def unwire(tensors: Mapping[str, torch.Tensor], numbers: Mapping[str, float]) -> StackedModels:
    """A ``StackedModels`` from the wire (``StackedModels.wire``); its tensors are taken over."""
    out = StackedModels()
    if CLOSED in tensors:
        out.closed, out._closed_weight = tensors[CLOSED], float(numbers["weight"])
        return out
    for key in sorted(k for k in numbers if k.startswith(MEMBER)):
        member = key[len(MEMBER) :]
        out.rows[member] = tensors[f"{ROW}{int(numbers[key])}"].reshape(-1)
        out.weights[member] = float(numbers[f"{WEIGHT}{member}"])
        out.parts[member] = out._part()
    return out


def column_blocks(members: list[Member]) -> Iterator[torch.Tensor]:
    """The members' rows as ``[k, BLOCK]`` blocks of columns (the last one narrower), in member order."""
    size = members[0].row.numel()
    for start in range(0, size, BLOCK):
        yield torch.stack([m.row[start : start + BLOCK] for m in members])


def as_stacked(partial: object) -> StackedModels:
    """``partial`` as a stacked fold (a TypeError for another rule's)."""
    if not isinstance(partial, StackedModels):
        raise TypeError(f"this rule folds StackedModels partials, got {type(partial).__name__}")
    return partial
