"""The run's own Dask cluster on 127.0.0.1 (``runtime.executor: local``).

A scheduler and one worker process per slot (per GPU times ``workers_per_device``, or
one per CPU core), each running one call at a time on its own device (``BHFL_DEVICE``).
Workers are forked from a server process that imported torch, transformers and the
worker code once (multiprocessing's forkserver), so N workers
cost one import, not N (CPU workers; GPU workers are spawned, so that no worker
inherits a process that touched the CUDA driver). Every worker warms up (imports, CUDA
context: ``tasks/worker_warmup.py``) before it registers, so the cluster is ready only
with warm workers. Worker processes exit when the process that started the
cluster dies, even by SIGKILL (Dask watches the parent).

This module stays light (no worker code imported here), so the CLI can start the
cluster first and let it boot while the rest of the pipeline is imported.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # this module is imported first thing by `bhfl run`: torch (~1.5 s) only where needed
    import torch

    from bhfl_core.config.schema import RuntimeConfig


def resolve_devices(setting: str) -> list[torch.device]:
    import torch

    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return [torch.device("cpu")]
    if not torch.cuda.is_available():
        raise RuntimeError("runtime.device is 'cuda' but no CUDA device is available (use 'auto' or 'cpu')")
    return [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]


CPU_WORKERS_AUTO_MAX = 8


def local_slots(runtime: RuntimeConfig) -> list[tuple[str, str]]:
    """(worker name, device) of each worker process the local cluster starts.

    GPUs: ``workers_per_device`` workers on each visible GPU (``workers`` caps the total);
    CPU: ``workers`` processes (``auto``: one per core, at most 8), each training with
    ``runtime.torch_threads`` threads (default 1: parallelism comes from processes).
    """
    devices = resolve_devices(runtime.device)
    if devices[0].type == "cuda":
        names = sorted((f"cuda{d.index}-{k}", str(d)) for k in range(runtime.workers_per_device) for d in devices)
        return names if runtime.workers == "auto" else names[: int(runtime.workers)]
    count = min(os.cpu_count() or 1, CPU_WORKERS_AUTO_MAX) if runtime.workers == "auto" else int(runtime.workers)
    return [(f"cpu-{k}", "cpu") for k in range(count)]


def likely_cpu_workers(runtime: RuntimeConfig) -> bool:
    """Whether the local workers will be CPU processes, told without importing torch (a guess for ``auto``).

    Lets the CLI start the forkserver first thing; a wrong guess costs only an idle server.
    """
    if runtime.device == "auto":
        return not Path("/proc/driver/nvidia/gpus").is_dir() or os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    return runtime.device == "cpu"


def start_forkserver() -> None:
    """Start the process local workers fork from, so it imports the worker code while we do other work.

    Idempotent and non-blocking; the first worker that forks waits for the imports.
    """
    import multiprocessing.forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(["tasks.forkserver_preload"])
    if _forkserver_pid() is None:
        atexit.register(_stop_forkserver)
    multiprocessing.forkserver.ensure_running()  # first: it imports while we import dask below

    import dask
    import distributed.utils

    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
    distributed.utils._forkserver_preload_set = True  # keep our preload list (distributed would replace it)


def _forkserver_pid() -> int | None:
    """The running forkserver's pid (None before it starts): a private attribute of the stdlib."""
    import multiprocessing.forkserver

    pid: int | None = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    return pid


def _stop_forkserver() -> None:
    """At exit, stop the forkserver now: left alone it would finish its imports first (seconds of CPU)."""

    pid = _forkserver_pid()
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)


def worker_env() -> dict[str, str]:
    """What the run's local workers take from this process's environment: hub/offline settings, fault plans.

    (Workers fork from a server started once per process, so its environment may be
    older than this run's.)
    """
    from tasks import faults

    keep = ("HF_", "TRANSFORMERS_", "TOKENIZERS_", "CUDA_")
    return {**{k: v for k, v in os.environ.items() if k.startswith(keep)}, **faults.share_with_workers()}


# Dask's statistical profiler reads every thread's stack every 10 ms, for a dashboard these
# clusters do not serve; in a GPU worker whose one CPU thread queues the kernels it cost
# 6-14% of TRAIN (H200, BERT-base, batch 16: 512 -> 480 and 502 -> 434 ms per client).
NO_WORKER_PROFILER = {"distributed.worker.profile.enabled": False}  # a dotted key: Nanny merges its config shallowly


def start_local_cluster(runtime: RuntimeConfig, env: Mapping[str, str]) -> Any:
    """A Dask cluster of a run's worker processes on 127.0.0.1 (a ``SpecCluster``; ``close()`` stops it).

    ``env`` (``worker_env()``) is set in every worker process.
    """
    import dask
    from distributed import Nanny, Scheduler, SpecCluster

    logging.getLogger("distributed").setLevel(logging.ERROR)  # the scheduler runs in this process: no INFO chatter
    slots = local_slots(runtime)
    if all(device == "cpu" for _, device in slots):
        start_forkserver()
    else:  # a process that imported torch may have touched the CUDA driver: GPU workers start fresh (spawn)
        dask.config.set({"distributed.worker.multiprocessing-method": "spawn"})
    workers = {
        name: {
            "cls": Nanny,
            "options": {
                "name": name,
                "host": "127.0.0.1",
                "nthreads": 1,
                "memory_limit": 0,
                "dashboard": False,
                "silence_logs": logging.CRITICAL,  # a failed call surfaces in the orchestrator, once
                "preload": ["tasks.worker_warmup"],  # imports and CUDA context before the worker takes work
                "config": NO_WORKER_PROFILER,
                "env": {"BHFL_DEVICE": device, **env},
            },
        }
        for name, device in slots
    }
    scheduler = {
        "cls": Scheduler,
        "options": {"host": "127.0.0.1", "port": 0, "dashboard": False, "dashboard_address": "127.0.0.1:0"},
    }  # its HTTP endpoint: loopback, any port
    return SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.ERROR, name="bhfl-local")


class ClusterStart:
    """A local cluster starting in the background (while Prefect, MLflow and the data get ready)."""

    def __init__(self, runtime: RuntimeConfig) -> None:
        self._result: Future[Any] = Future()
        env = worker_env()  # now: this process's environment as the run starts
        threading.Thread(target=self._start, args=(runtime, env), name="bhfl-cluster-start", daemon=True).start()

    def _start(self, runtime: RuntimeConfig, env: Mapping[str, str]) -> None:
        try:
            self._result.set_result(start_local_cluster(runtime, env))
        except BaseException as exc:  # handed to whoever waits for the address
            self._result.set_exception(exc)

    def address(self) -> str:
        return str(self._result.result().scheduler_address)

    def close(self) -> None:
        try:
            cluster = self._result.result()
        except Exception:
            return
        cluster.close()
