"""Executors: where worker calls run — a Dask cluster of worker processes, or this process.

``runtime.executor`` picks one per run:

- ``local``: a Dask cluster started for the run on 127.0.0.1 (tasks/local_cluster.py).
- ``cluster``: the Dask scheduler at ``runtime.cluster`` (workers started by the user:
  ``dask scheduler`` / ``dask worker ADDRESS --nthreads 1``), same code. Every worker
  must see the run folder and the data cache at the same absolute paths.
- ``inprocess``: calls run in the orchestrating process, one at a time (debugging).

The orchestrator places each batch on a named worker (``Slot``) and submits
``tasks.worker.call(method, *args)`` there; Dask only transports calls and results.
An executor is found from the run record's address (``connect``), so any process that
can reach the scheduler can execute any part of the tree.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Protocol

from bhfl_core.config.schema import RuntimeConfig
from bhfl_core.placement import Slot
from tasks.local_cluster import resolve_devices
from tasks.worker import PLUGIN, BhflWorkerPlugin, WorkerRuntime, call, worker_device

INPROCESS = "inprocess"


class PendingCall(Protocol):
    """A submitted worker call: a ``concurrent.futures.Future`` or a Dask ``distributed.Future``."""

    def result(self, timeout: float | None = None) -> Any: ...


class Executor(Protocol):
    def slots(self) -> list[Slot]:
        """The worker slots a round's work is placed on (stable order)."""
        ...

    def submit(self, slot: Slot, method: str, *args: Any) -> PendingCall:
        """Run ``WorkerRuntime.<method>(*args)`` on ``slot``; the future's ``result()`` waits for it."""
        ...


def gather(futures: list[Any]) -> list[Any]:
    """Every future's result, in order; the first error is raised only once all have ended.

    (A retry must not start while a batch of the failed attempt still trains.)
    """
    results, errors = [], []
    for future in futures:
        try:
            results.append(future.result())
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
    return results


def _describe(dask_worker: Any) -> dict[str, str]:
    return dask_worker.plugins[PLUGIN].runtime.describe()


def cluster_workers(address: str, runtime: RuntimeConfig) -> list[dict[str, str]]:
    """Set up every worker of the cluster at ``address`` for bhfl; describe the ones this run uses.

    Registers the worker plugin (each worker picks its device and builds its runtime;
    workers that join later get it too) and asks each worker who it is
    (``WorkerRuntime.describe``). On a shared cluster, ``runtime.workers`` (an int) uses
    the first workers by name.
    """
    from distributed import Client

    with Client(address, set_as_default=False, timeout="60s") as client:
        client.register_plugin(BhflWorkerPlugin())
        workers = sorted(client.run(_describe).values(), key=lambda w: w["name"])
    if not workers:
        raise RuntimeError(
            f"the Dask cluster at {address} has no workers; start some with `dask worker {address} --nthreads 1`"
        )
    if runtime.executor == "cluster" and runtime.workers != "auto":
        workers = workers[: int(runtime.workers)]
    return workers


def slot(worker: dict[str, str]) -> Slot:
    """What placement needs of a worker described by ``WorkerRuntime.describe``."""
    return Slot(worker["name"], worker["device"], worker["kind"])


class DaskExecutor:
    """Worker calls on a Dask cluster, each pinned to the worker the placement chose.

    One client connection per use (a node execution): connecting costs milliseconds,
    and nothing outlives the execution that needs it.
    """

    def __init__(self, address: str, slots: list[Slot]) -> None:
        from distributed import Client

        self._slots = slots
        self.client = Client(address, set_as_default=False, timeout="60s")

    def slots(self) -> list[Slot]:
        return list(self._slots)

    def submit(self, slot: Slot, method: str, *args: Any) -> PendingCall:
        return self.client.submit(call, method, *args, workers=[slot.name], allow_other_workers=False, pure=False)

    def close(self) -> None:
        self.client.close()


class InProcessExecutor:
    """Worker calls in the orchestrating process, one at a time (``runtime.executor: inprocess``).

    The process has one worker runtime (its model instances), shared by every node
    execution of the process, like a Dask worker's.
    """

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime

    def slots(self) -> list[Slot]:
        return [slot(self.runtime.describe())]

    def submit(self, slot: Slot, method: str, *args: Any) -> Future[Any]:
        done: Future[Any] = Future()
        try:
            done.set_result(getattr(self.runtime, method)(*args))
        except BaseException as exc:
            done.set_exception(exc)
        return done

    def close(self) -> None:
        return None


@functools.lru_cache(maxsize=1)
def _process_worker(device: str) -> WorkerRuntime:
    return WorkerRuntime(INPROCESS, worker_device(device))


def process_worker(runtime: RuntimeConfig) -> WorkerRuntime:
    """This process's own worker runtime (``runtime.executor: inprocess``)."""
    return _process_worker(str(resolve_devices(runtime.device)[0]))


@contextmanager
def executor_for(runtime: RuntimeConfig, address: str | None, workers: list[dict[str, str]]) -> Iterator[Executor]:
    """The executor of a run (from its record: cluster address and workers), for one node execution."""
    if runtime.executor == INPROCESS:
        yield InProcessExecutor(process_worker(runtime))
        return
    if not address:
        raise RuntimeError(f"runtime.executor is {runtime.executor!r} but the run records no cluster address")
    executor = DaskExecutor(address, [slot(w) for w in workers])
    try:
        yield executor
    finally:
        executor.close()
