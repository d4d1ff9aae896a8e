"""Python's cyclic garbage collector kept out of the libraries a process imports once and keeps.

Importing torch, transformers, datasets, distributed, Prefect and MLflow creates ~1 million
objects that live as long as the process. The collector runs whenever allocations pass
its threshold, and each full collection walks every tracked object again, so a quarter of
the import time went to it (`import flows.experiment` and the model code: 4.8 s with the
collector, 3.6 s without; 2 cores). In a forked worker each collection also writes to the
headers of the objects it walks, un-sharing the forkserver's pages.

So a process imports with the collector off and then freezes what it holds
(``gc.freeze``: moved to a generation no collection walks) before turning it back on:
the command from its first line until its job's work starts (``pause``, ``resume``:
flows/cli/stopping.py, flows/cli/jobs.py), the local workers' forkserver around its
imports (``imports_frozen``: tasks/forkserver_preload.py) and a spawned GPU worker
around its own (tasks/worker_warmup.py). What is frozen is never collected: the
libraries, and whatever cyclic garbage the imports left (~20,000 objects, a few MB),
once per process. Measured on the throughput workload (benchmarks/throughput.py
--settings 10x5, docs/benchmarks.md): start-up 7.7 -> 6.2 s, CPU per client 0.39 -> 0.32 s.
Runs started later in the same process (a sweep's points, ``bhfl serve``) collect as usual.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def pause() -> bool:
    """Turn the collector off for the imports to come; whether it was on (to give ``restore``)."""
    was_on = gc.isenabled()
    gc.disable()
    return was_on


def resume() -> None:
    """After ``pause``: freeze what the process holds, then turn the collector on. No-op while it is on."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def restore(was_on: bool) -> None:
    """Leave the collector as ``pause`` found it (a command run inside another process: a test)."""
    if was_on:
        gc.enable()


@contextmanager
def imports_frozen() -> Iterator[None]:
    """Import inside the block with the collector off; what the process then holds is frozen, the collector on."""
    was_on = pause()
    try:
        yield
    finally:
        gc.freeze()
        restore(was_on)
