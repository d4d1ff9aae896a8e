"""Warm a local worker process before it takes work: its imports and, on a GPU, its CUDA context.

A GPU worker is spawned fresh (no inherited CUDA state), so on its own it would import
torch, transformers and the worker code and create its CUDA context and cuBLAS handle
on its first call: in the middle of round 1, while the other workers and the
orchestrator wait (~14 s on an H100 with 4 workers per GPU, measured). As a Dask worker
preload (``dask_setup`` runs before the worker registers with the scheduler), it happens
while the cluster starts, which the CLI overlaps with Prefect's and MLflow's start-up;
a run's first round starts with every worker ready. CPU workers fork from a server
that imported all this already (``local_cluster.start_forkserver``): for them it is a
no-op.

It also makes a local worker ignore SIGINT. Ctrl-C in a terminal signals the whole
foreground process group, and the workers are in the command's: each then died on its
own with a ``KeyboardInterrupt`` traceback printed under the command's one line
(``interrupted.``), while the command was stopping them anyway as it unwound
(docs/runtime.md, "Faults"). A worker of the user's own cluster keeps Dask's behaviour.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from typing import Any


def dask_setup(worker: Any) -> None:
    """Import what every call needs (frozen out of the cyclic collector: tasks/collector.py); on a GPU, create
    the context and cuBLAS handle with the run's settings. Freed memory goes back to the system
    (``tasks/heap.py``); SIGINT is ignored (the module's docstring)."""
    from tasks.collector import imports_frozen

    forked = "tasks.worker" in sys.modules  # a CPU worker: its forkserver imported all this, frozen
    with contextlib.nullcontext() if forked else imports_frozen():  # a spawned GPU worker (tasks/collector.py)
        import datasets  # noqa: F401  (the clients' shards: data_prep.prepare.load_shard)
        import torch
        import transformers.models.bert.modeling_bert  # noqa: F401  (transformers imports model classes lazily)

        from tasks.heap import give_back_freed_memory
        from tasks.worker import worker_device

    give_back_freed_memory()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the command stops its workers: Ctrl-C is for it alone

    device = worker_device()  # deterministic kernels
    if device.type == "cuda":
        square = torch.ones(8, 8, device=device)
        float((square @ square).sum())  # waits for the device: the context and the handle exist
