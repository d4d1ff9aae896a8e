"""Where a CPU worker folds a batch: into files its parent maps, or into memory the worker reuses.

A batch's fold (the parent's aggregation rule's partial, e.g. ``WeightedSum``'s ``hi``
and ``lo``) goes up to the parent. When the parent folds several batches, the fold lives
in transfer files the parent maps, so sending it copies nothing. When the batch is the
whole round (``whole_round``), the mean rule closes it on the worker and only the mean
goes up (``aggregation.CLOSED``, allocated in a file as before): the sum never leaves
the process. It is then folded in memory the worker keeps from call to call, because
fresh pages are what a large fold costs on a CPU: each first touch of a new
shared-memory page is a fault that allocates and zeroes it (measured on 2 CPU cores in a
VM: ~1.1 s for the 880 MB ``lo`` part of a 110M-parameter sum, against 0.07 s for the
fold's arithmetic), while zeroing pages already held takes ~0.03 s. A sum that its rule
does not close after all (DP's, secure aggregation's) is written to a file by
``send_result`` before the call ends, as any tensor that was not folded in place: the
next call may reuse its buffers.

Memory: a worker keeps one sum's buffers (the latest model size; 16 bytes per
parameter for the mean rule) between calls. A rule that keeps every child's model
(``bhfl_core/algorithm/stacked.py``) folds into files even for a whole round: they are
freed when the call ends.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bhfl_core.store.transfer import TensorRef, Transfer

Allocator = Callable[[str, int, torch.dtype], torch.Tensor]
REUSED = ("hi", "lo")
"""The parts kept between calls: a sum's. Anything else goes to a file, e.g. the closed mean, or the rows of a rule
that keeps every child's model (``stacked.py``: k of them kept idle would hold 4kP bytes between calls)."""
OVERWRITTEN = ("hi",)
"""Reused parts the rule writes in full before it reads them (``WeightedSum`` scales its first input into ``hi``),
so they are handed back as they are: zeroing them would be a pass over 8 bytes a parameter for nothing (0.11 s a
round at 110M parameters on one core of the 2-core VM)."""
InFiles = dict[str, tuple[TensorRef, torch.Tensor]]


class FoldStorage:
    """One worker's fold buffers: transfer files for a batch the parent folds, reused memory for a whole round."""

    def __init__(self) -> None:
        self._kept: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def allocator(self, transfer: Transfer, prefix: str, whole_round: bool) -> tuple[Allocator, InFiles]:
        """``(allocate, in_files)`` for one batch: ``allocate(part, numel, dtype)`` is the rule's storage, zeroed
        (but an ``OVERWRITTEN`` part's); ``in_files`` (filled as it allocates) names the parts that lie in transfer
        files."""
        in_files: InFiles = {}

        def to_file(part: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
            in_files[part] = transfer.allocate(f"{prefix}.{part}", numel, dtype)
            return in_files[part][1]

        def whole(part: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
            return self._reused(part, numel, dtype) if part in REUSED else to_file(part, numel, dtype)

        return (whole if whole_round else to_file), in_files

    def _reused(self, part: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        kept = self._kept.get((part, dtype))
        if kept is None or kept.numel() != numel:
            self._kept = {k: t for k, t in self._kept.items() if t.numel() == numel}  # one model size at a time
            kept = self._kept[(part, dtype)] = torch.empty(numel, dtype=dtype)
        return kept if part in OVERWRITTEN else kept.zero_()
