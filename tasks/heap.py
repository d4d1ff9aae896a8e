"""glibc's malloc told to give freed memory back: a worker's heap stays the size of what it holds.

A worker trains client after client and scores model after model, each call allocating
and freeing tensors of many sizes from several threads (the Dask executor, the commit
thread). glibc keeps freed memory in per-thread arenas and at the top of the heap, and
raises its mmap threshold after large frees, so later large blocks come from the heap
too: at 10,000 clients (10 rounds of 1,000, tiny model, 2 cores) each worker's heap
grew by ~3.5 MB every 100 client trainings that it never returned, and the run peaked
at 2,285 MB of PSS; with two arenas and the heap trimmed above 128 KB it peaked at
1,924 MB, the same trainings at the same speed (benchmarks/scale.py, docs/benchmarks.md "Scale").

The settings are process-wide by nature (``mallopt``): the command applies them to itself
at its start and every local worker at its start (``tasks/worker_warmup.py``). A user's
own ``MALLOC_ARENA_MAX`` / ``MALLOC_TRIM_THRESHOLD_`` wins over its own setting only: the
command puts ``MALLOC_ARENA_MAX`` in the environment its servers and workers inherit
(``flows/cli/shell.py::limit_malloc_arenas``), and a worker that read that as "the user
tuned malloc" kept glibc's trim threshold, the half of the fix above that keeps its heap flat.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from functools import cache

ARENAS = 2
TRIM_THRESHOLD = 128 * 1024  # bytes free at the top of the heap before it is given back
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_ARENA_MAX = -8
USER_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_")


@cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


def give_back_freed_memory() -> tuple[str, ...]:
    """Two arenas, and a heap trimmed above ``TRIM_THRESHOLD``, each unless its variable is in the environment;
    the variables of the settings applied (none: not glibc, or both set)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:  # not glibc (macOS, musl without mallopt)
        return ()
    wanted = (("MALLOC_ARENA_MAX", _M_ARENA_MAX, ARENAS), ("MALLOC_TRIM_THRESHOLD_", _M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return tuple(name for name, param, value in wanted if name not in os.environ and mallopt(param, value))


def release_garbage() -> bool:
    """Collect reference cycles, then hand the heap's free pages back (``malloc_trim``); False: no trim here.

    For the end of big steps whose memory is garbage in a cycle and so outlives them until
    a full collection: data preparation's last step draws the partition's figures, and
    matplotlib lays out their text with pyparsing, which keeps exceptions whose tracebacks
    hold the calling frames, and with them every table the preparation held (~200 MB at
    10,000 clients when it runs inline, until Python's next full collection). ``malloc_trim(0)`` also gives
    back free pages in the middle of the heap, which the trim threshold alone does not.
    Costs a full collection (tens of milliseconds): call it per step or batch, never per client.
    """
    gc.collect()
    return trim_heap()


def trim_heap() -> bool:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim(0)``); False where there is none.

    Milliseconds: cheap enough after each call a worker serves.
    """
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True
