"""Fused CPU loops for ``WeightedSum``'s exact arithmetic: one pass over memory where torch makes ten.

Why: on a CPU, each torch operation of a TwoSum is its own pass over the data (the
chunked torch path keeps the passes in cache, but still runs ~10 of them, and ``mean``
builds temporaries for its tie test). A compiled loop reads ``x``, ``hi`` and ``lo``
once and writes ``hi`` and ``lo`` once. Measured at 110M parameters on one core
(2-core AMD EPYC): ``add`` 0.26 s -> 0.07 s (a float32 ``add_``, the plain loop's
fold, takes 0.025 s), ``mean`` 0.93 s -> see docs/design.md.

The loops do the same IEEE float64 operations in the same order as the torch path
(numba compiles without fast-math; the one product, ``w * x``, is exact, so even a
fused multiply-add gives the same bits), so the two paths agree bit for bit
(tests/core/test_aggregation.py runs every exactness test through both).

numba is imported on the first fused call only (~1 s, then compiled code from its
cache next to this file): ``aggregation`` takes this path for vectors of at least
``aggregation._FUSED_MIN`` elements on a CPU, where one fold saves more than that
import costs over a run; small models never import it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
import torch

Kernels = dict[str, Callable[..., Any]]

_BLOCK = 4096
"""Elements per block of ``round_mean``'s quotient buffer (its bits are read through an int64 view)."""


@cache
def kernels() -> Kernels:
    """The compiled loops (numba imported and the cache read on first use, once per process)."""
    from numba import njit

    jit = njit(cache=True, nogil=True, boundscheck=False)

    @jit
    def scale_into(hi: np.ndarray, x: np.ndarray, w: float) -> None:
        for i in range(hi.shape[0]):
            hi[i] = np.float64(x[i]) * w  # exact: float32 x integer < 2**29

    @jit
    def add_into(hi: np.ndarray, lo: np.ndarray, x: np.ndarray, w: float) -> None:
        for i in range(hi.shape[0]):
            p = np.float64(x[i]) * w
            a = hi[i]
            s = a + p  # Knuth's TwoSum, as aggregation._two_sum_into
            t = s - a
            lo[i] += (a - (s - t)) + (p - t)
            hi[i] = s

    @jit
    def merge_into(hi: np.ndarray, lo: np.ndarray, other_hi: np.ndarray, other_lo: np.ndarray) -> None:
        for i in range(hi.shape[0]):
            p = other_hi[i]
            a = hi[i]
            s = a + p
            t = s - a
            lo[i] = (lo[i] + ((a - (s - t)) + (p - t))) + other_lo[i]
            hi[i] = s

    @jit
    def round_mean(
        hi: np.ndarray,
        lo: np.ndarray,
        w: float,
        out: np.ndarray,
        start: int,
        near: np.ndarray,
        q_block: np.ndarray,
        below: int,
        tie: int,
        near_tie: int,
        tiny: float,
    ) -> tuple[int, int]:
        # out[i] = float32((hi + lo) / w) from ``start``; the indices whose rounding must be checked
        # exactly go to ``near`` (aggregation.WeightedSum.mean says which); returns (where it stopped,
        # how many it found): it stops early when ``near`` is full. Blocks of slices, three simple
        # loops each and a scan only where a block has a candidate: so that LLVM vectorises them
        # (indexing by ``i + j`` made it 4x slower).
        bits = q_block.view(np.int64)
        edge, width = tie - near_tie, 2 * near_tie  # |low - tie| <= near_tie, as one unsigned comparison
        found = 0
        block = q_block.shape[0]
        for i in range(start, hi.shape[0], block):
            h, low, o = hi[i : i + block], lo[i : i + block], out[i : i + block]
            m = h.shape[0]
            for j in range(m):
                q_block[j] = (h[j] + low[j]) / w
            candidate = False
            for j in range(m):
                candidate |= bool(np.uint64((bits[j] & below) - edge) <= width)
            for j in range(m):
                f = np.float32(q_block[j])
                o[j] = f
                candidate |= (abs(f) < tiny) & (f != 0)
            if not candidate:
                continue
            for j in range(m):
                if np.uint64((bits[j] & below) - edge) <= width or (abs(o[j]) < tiny and o[j] != 0):
                    near[found] = i + j
                    found += 1
                    if found == near.shape[0]:
                        return i + j + 1, found
        return hi.shape[0], found

    return {"scale_into": scale_into, "add_into": add_into, "merge_into": merge_into, "round_mean": round_mean}


def fused(*tensors: torch.Tensor) -> bool:
    """Whether the fused loops can take these tensors: all on the CPU, contiguous, float32 or float64."""
    return all(
        t.device.type == "cpu" and t.is_contiguous() and t.dtype in (torch.float32, torch.float64) for t in tensors
    )


def array(tensor: torch.Tensor) -> np.ndarray:
    """The flat numpy view of a contiguous CPU tensor (its memory, not a copy)."""
    return tensor.detach().reshape(-1).numpy()


def block_buffer() -> np.ndarray:
    """The quotient buffer ``round_mean`` works in."""
    return np.empty(_BLOCK, dtype=np.float64)
