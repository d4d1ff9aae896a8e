"""Executors: where worker calls run — a Dask cluster of worker processes, or this process.

``runtime.executor`` picks one per run:

- ``local``: a Dask cluster started for the run on 127.0.0.1 (tasks/local_cluster.py).
- ``cluster``: the Dask scheduler at ``runtime.cluster`` (workers started by the user:
  ``dask scheduler`` / ``dask worker ADDRESS --nthreads 1``), same code. Every worker
  must see the run folder and the data cache at the same absolute paths.
- ``inprocess``: calls run in the orchestrating process, one at a time (debugging).

The orchestrator places each batch on a named worker (``Slot``) and submits a
``WorkerRuntime`` method with its arguments there, by reference to the method itself
(``submit(slot, WorkerRuntime.proxy_train, run_path, ...)``): mypy checks the arguments
against the method's signature (``ParamSpec``), so no call is named by a string. Dask
only transports calls and results (``tasks.worker.call`` runs the method on the
worker's runtime); the in-process executor calls it on its own runtime.
An executor is found from the run record's address (``connect``), so any process that
can reach the scheduler can execute any part of the tree.

A lost worker. Dask pins a call to the *address* its worker had when the call was
submitted; when that worker dies, Dask neither moves the call (it may run there only)
nor fails it (it waits for a worker that will never have that address again), so the
round would wait forever, and Prefect's retries would never start. The executor
therefore watches the scheduler's ``remove-worker`` events and runs a lost call again
itself, on the same worker once its nanny has restarted it (a local worker is back in
well under a second): same arguments, and every draw is seeded by where it happens, so
the result is bit-identical; clients the lost call had finished are not trained again
(their checkpoints say so). Each re-run is told on the progress channel and appended to
the run folder's ``worker_losses.jsonl`` (the run's record and MLflow take it from
there: flows/experiment.py). A worker that does not come back (no nanny, or not within
``RESTART_GRACE_S``: a machine lost) fails the call with ``WorkersLostError``, a
paragraph saying how to go on: the run stops, and ``bhfl resume`` places its work on
the workers connected then. (Moving the call to another worker instead would give that
worker two batches of one round, which placement and the folded batches' transfer
files assume never happens.)
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

from bhfl_core.config.base import ConfigError
from bhfl_core.config.schema import RuntimeConfig
from bhfl_core.placement import Slot
from tasks.cluster_access import connected, security_for
from tasks.context import forget_run
from tasks.local_cluster import resolve_devices
from tasks.worker import PLUGIN, BhflWorkerPlugin, WorkerRuntime, worker_device
from tasks.worker import call as call_on_worker

INPROCESS = "inprocess"
LOSSES_FILE = "worker_losses.jsonl"  # in the run folder: one JSON line per call run again after its worker was lost
RESTART_GRACE_S = 30.0  # how long a lost worker with a nanny has to come back before its call fails the run
MAX_RERUNS = 3  # a call whose worker died this many times is likely what kills it (like Dask's allowed-failures)
# flows/progress.py shows this logger's records (the CLI's notes, the Prefect UI's logs); tasks never import flows
_NOTES = logging.getLogger("bhfl.progress")
P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class WorkersLostError(RuntimeError):
    """A call's worker is gone for good, or the call kept killing it; says which and what to do."""


class PendingCall(Protocol[R_co]):
    """A submitted call: a ``concurrent.futures.Future``, or a Dask call that reruns on a lost worker (``_Pending``)."""

    def result(self, timeout: float | None = None) -> R_co: ...


class Executor(Protocol):
    def slots(self) -> list[Slot]:
        """The worker slots a round's work is placed on (stable order)."""
        ...

    def submit(
        self, slot: Slot, method: Callable[Concatenate[WorkerRuntime, P], R], /, *args: P.args, **kwargs: P.kwargs
    ) -> PendingCall[R]:
        """Run ``method(runtime, *args, **kwargs)`` on ``slot``'s ``WorkerRuntime``; ``result()`` waits for it."""
        ...

    def forget(self, run_path: str) -> None:
        """The run has ended: every worker drops what it opened of it (``tasks.context.forget_run``)."""
        ...


def gather(futures: Sequence[PendingCall[R]]) -> list[R]:
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
    with connected(address, runtime) as client:  # (a tls:// cluster: with the run's certificates)
        client.register_plugin(BhflWorkerPlugin())
        workers = sorted(client.run(_describe).values(), key=lambda w: w["name"])
    if not workers:  # a ConfigError: one paragraph with the fix and `bhfl resume` (exit 2), not a traceback
        tls = " with the scheduler's --tls-ca-file, --tls-cert and --tls-key" if address.startswith("tls://") else ""
        raise ConfigError(
            f"runtime.cluster: the Dask scheduler at {address} has no workers. Start one per GPU or CPU slot, from "
            f"the .venv bhfl is installed in (`dask worker {address} --nthreads 1 --memory-limit 0`{tls}), and wait "
            f'until each worker\'s log says "Registered to" (one that exited at once says why at the end of its log).'
        )
    if runtime.executor == "cluster" and runtime.workers != "auto":
        workers = workers[: int(runtime.workers)]
    return workers


def slot(worker: dict[str, str]) -> Slot:
    """What placement needs of a worker described by ``WorkerRuntime.describe``."""
    return Slot(worker["name"], worker["device"], worker["kind"])


class _Call:
    """One submitted call and where it is: its Dask key, the worker (name, address) it is pinned to, its re-runs."""

    def __init__(self, method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.method, self.args, self.kwargs = method, args, kwargs
        self.name: str = method.__name__
        self.key = self.worker = self.address = ""
        self.future: Any = None
        self.lost = False  # its worker left the scheduler while it held the call
        self.cause = ""  # why the scheduler removed that worker (``loss_cause``)
        self.changed = threading.Event()  # finished, failed or lost
        self.reruns = 0


def _what(call: _Call) -> str:
    """A call in words, for the user: the clients a training call trains, else its method."""
    ids = call.args[2] if call.method is WorkerRuntime.train_clients and len(call.args) > 2 else None
    return f"training {', '.join(map(str, ids))}" if isinstance(ids, list) else call.name


class _Pending(Generic[R]):
    """What ``DaskExecutor.submit`` returns: ``result()`` waits, running the call again if its worker is lost."""

    def __init__(self, executor: DaskExecutor, call: _Call) -> None:
        self._executor, self._call = executor, call

    def result(self, timeout: float | None = None) -> R:
        result: R = self._executor.result(self._call, timeout)
        return result


class DaskExecutor:
    """Worker calls on a Dask cluster, each pinned to the worker the placement chose.

    One client connection per use (a node execution): connecting costs milliseconds,
    and nothing outlives the execution that needs it. A call whose worker is lost runs
    again on it once it is back (module docstring).
    """

    def __init__(self, address: str, slots: list[Slot], security: Any = None) -> None:
        from distributed import Client

        self._slots = slots
        self.address = address
        self.client = Client(address, security=security, set_as_default=False, timeout="60s")
        self._lock = threading.Lock()
        self._calls: dict[str, _Call] = {}  # key -> call, while it is pending
        self._removed: set[str] = set()  # worker addresses the scheduler removed while this executor lived
        self._nanny: dict[str, bool] = {}  # worker name -> whether a nanny restarts it, as last seen
        self.client.subscribe_topic("all", self._on_event)  # before any submit: one stream, so events keep order

    def slots(self) -> list[Slot]:
        return list(self._slots)

    def submit(
        self, slot: Slot, method: Callable[Concatenate[WorkerRuntime, P], R], /, *args: P.args, **kwargs: P.kwargs
    ) -> PendingCall[R]:
        """Send the call to ``slot``'s worker; one that is not connected now counts as lost (``result`` waits)."""
        call = _Call(method, args, kwargs)
        self._send(call, slot.name, self._roster().get(slot.name, ""))
        return _Pending[R](self, call)

    def result(self, call: _Call, timeout: float | None = None) -> Any:
        """The call's result; a call whose worker was lost is run again (and waited for) first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not call.changed.wait(left):
                raise TimeoutError(f"{call.worker}'s call ({_what(call)}): no result in {timeout} s")
            if not call.lost and _killed(call.future):  # a scheduler with allowed-failures 0 fails it instead
                call.lost = True
            if not call.lost:
                try:  # (its worker lost while handing the result over: ``_on_event`` cancels the fetch)
                    return call.future.result()
                except CancelledError:
                    if not call.lost:
                        raise
                finally:
                    if not call.lost:
                        with self._lock:
                            self._calls.pop(call.key, None)
            self._rerun(call)

    def forget(self, run_path: str) -> None:
        """Every worker of the cluster drops its context of the ended run (its proxy and test splits, tree, store).

        A worker serves run after run (a sweep's shared workers, a user's cluster) and
        keeps the contexts it opened in a bounded cache (``OpenedRuns``: 8 runs), so
        without this each worker held the data of its last 8 runs, finished or not: at
        10,000 clients ~45 MB of test rows a run. Run on the workers directly
        (``Client.run``), not queued behind the calls of other runs. Best effort: a worker
        that does not answer keeps the context until the cache's bound drops it.
        """
        try:
            self.client.run(forget_run, run_path, on_error="ignore")
        except Exception as exc:  # (a scheduler gone at the run's end: the run's result stands)
            _NOTES.debug("workers could not forget %s: %s", run_path, exc)

    def close(self) -> None:
        self.client.unsubscribe_topic("all")  # first: the scheduler would send this client's own departure to it
        self.client.close()

    async def _on_event(self, event: tuple[float, Any]) -> None:
        """(In the client's event loop.) A worker left the scheduler: every call pinned to it is lost.

        Their futures are cancelled: Dask would keep them (and a fetch of a result that
        lived on the lost worker) waiting for an address that is gone.
        """
        message = event[1]
        action = message.get("action") if isinstance(message, dict) else None
        lost = []
        with self._lock:
            if action == "add-worker":  # back at the same address (a fixed --worker-port)
                self._removed.discard(message["worker"])
            if action != "remove-worker":
                return
            self._removed.add(message["worker"])
            for call in self._calls.values():
                if call.address == message["worker"]:
                    call.lost, call.cause = True, loss_cause(message)
                    call.changed.set()
                    lost.append(call.future)
        if lost:
            await self.client.cancel(lost, asynchronous=True, reason="its worker was lost")

    def _done(self, call: _Call, key: str) -> None:
        """(A Dask callback thread.) The call's future under ``key`` ended; an earlier key's end is old news."""
        with self._lock:
            if call.key == key:
                call.changed.set()

    def _roster(self) -> dict[str, str]:
        """Connected workers by name -> address, as the scheduler has them now."""
        workers = self.client.scheduler_info(n_workers=-1)["workers"]
        with self._lock:
            self._nanny.update({str(w["name"]): bool(w.get("nanny")) for w in workers.values()})
            return {str(w["name"]): a for a, w in workers.items() if a not in self._removed}

    def _address(self, call: _Call, name: str) -> str:
        """Worker ``name``'s address once it is connected (a nanny restarts a lost worker in seconds), else the
        run stops."""
        roster = self._roster()
        has_nanny = self._nanny.get(name, True)
        deadline = time.monotonic() + (RESTART_GRACE_S if has_nanny else 0.0)
        while name not in roster and time.monotonic() < deadline:
            time.sleep(0.2)
            roster = self._roster()
        if name in roster:
            return roster[name]
        why = f"not back within {RESTART_GRACE_S:.0f} s" if has_nanny else "it has no nanny to restart it"
        raise WorkersLostError(
            f"worker {name} of the Dask cluster at {self.address} was lost before finishing its call "
            f"({_what(call)}), and is gone ({why}), so the run stops here rather than change its "
            f"placement mid-round. Start it again (`dask worker {self.address} --name {name} --nthreads 1`) or "
            "not: a resume places its work on the workers connected then."
        )

    def _send(self, call: _Call, name: str, address: str) -> None:
        """Submit ``call`` under a new key, pinned to worker ``name`` at ``address`` ("": not connected)."""
        key = f"{call.name}-{uuid.uuid4().hex}"
        with self._lock:
            self._calls.pop(call.key, None)
            call.key, call.worker, call.address = key, name, address
            call.lost = not address or address in self._removed  # gone (since the roster was read): no event comes
            call.changed.clear()
            self._calls[key] = call
            if call.lost:
                call.changed.set()
                return
        call.future = self.client.submit(
            call_on_worker, call.method, call.kwargs, *call.args, key=key, workers=[address], allow_other_workers=False
        )
        call.future.add_done_callback(lambda _: self._done(call, key))

    def _rerun(self, call: _Call) -> None:
        """Run a call again after the loss of its worker: tell the user, record it, send it."""
        if call.future is not None:
            call.future.release()
        lost, what = call.worker, _what(call)
        call.reruns += 1
        if call.reruns > MAX_RERUNS:
            raise WorkersLostError(
                f"worker {lost} was lost {MAX_RERUNS} times before finishing the same call ({what}): the call "
                "itself may be what kills it (out of memory? the worker's log says)."
            )
        address = self._address(call, lost)
        kept = (
            " (clients the call had finished are not trained again)"
            if call.method is WorkerRuntime.train_clients
            else ""
        )
        _NOTES.warning(f"worker {lost} was lost before finishing its call ({what}); restarted, it runs it again{kept}")
        _record_loss(call, lost)
        self._send(call, lost, address)


def loss_cause(event: dict[str, Any]) -> str:
    """Why the scheduler removed a worker, from its ``remove-worker`` event: Dask's stimulus without its time.

    ``handle-worker-cleanup``: the worker's connection closed (its process died or was
    killed; the local workers' nanny logs are silenced, so this is what a run keeps of it);
    ``check-worker-ttl``: no heartbeat for ``distributed.scheduler.worker-ttl``;
    ``retire-workers``: retired on purpose. Kept in ``worker_losses.jsonl`` for diagnosis.
    """
    return re.sub(r"-[0-9.]+$", "", str(event.get("stimulus_id") or "unknown"))


def _killed(future: Any) -> bool:
    """Whether Dask failed the future because workers died running it (``KilledWorker``)."""
    from distributed import KilledWorker

    return bool(future.status == "error" and isinstance(future.exception(), KilledWorker))


def _record_loss(call: _Call, lost: str) -> None:
    """Append the re-run to the run folder's ``LOSSES_FILE`` (every worker method takes the run folder first)."""
    run_path = Path(str(call.args[0])) if call.args else None
    if run_path is None or not run_path.is_dir():
        return
    line = {"time": time.time(), "worker": lost, "call": _what(call), "cause": call.cause}
    with open(run_path / LOSSES_FILE, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(line) + "\n")


def worker_losses(run_path: Path) -> list[dict[str, Any]]:
    """Every call of the run that ran again after its worker was lost (all attempts), oldest first."""
    path = run_path / LOSSES_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class InProcessExecutor:
    """Worker calls in the orchestrating process, one at a time (``runtime.executor: inprocess``).

    The process has one worker runtime (its model instances), shared by every node
    execution of the process, like a Dask worker's.
    """

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime

    def slots(self) -> list[Slot]:
        return [slot(self.runtime.describe())]

    def submit(
        self, slot: Slot, method: Callable[Concatenate[WorkerRuntime, P], R], /, *args: P.args, **kwargs: P.kwargs
    ) -> Future[R]:
        done: Future[R] = Future()
        try:
            done.set_result(method(self.runtime, *args, **kwargs))
        except BaseException as exc:
            done.set_exception(exc)
        return done

    def forget(self, run_path: str) -> None:
        forget_run(run_path)  # the process's own cache: its worker shares it

    def close(self) -> None:
        return None


class ProcessWorker:
    """This process's own worker runtime (``runtime.executor: inprocess``), kept between node executions and runs.

    Kept because it holds model instances, which cost a model build each: every node
    execution of a run, and the next run of a sweep, reuse them, as a Dask worker does.
    Bound: one runtime, for the device last asked for; another device replaces it (and
    its models). Invalidation: nothing else, as nothing in it belongs to a run: each call
    opens its run through ``open_run``, and the runtime's models (two at most) are keyed
    by everything they depend on (``tasks.worker._model_key``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: tuple[str, WorkerRuntime] | None = None  # (device setting, its runtime)

    def get(self, device: str) -> WorkerRuntime:
        with self._lock:
            if self._kept is None or self._kept[0] != device:
                self._kept = (device, WorkerRuntime(INPROCESS, worker_device(device)))
            return self._kept[1]


_PROCESS_WORKER = ProcessWorker()


def process_worker(runtime: RuntimeConfig) -> WorkerRuntime:
    """This process's own worker runtime (``runtime.executor: inprocess``): ``ProcessWorker``."""
    return _PROCESS_WORKER.get(str(resolve_devices(runtime.device)[0]))


@contextmanager
def executor_for(runtime: RuntimeConfig, address: str | None, workers: list[dict[str, str]]) -> Iterator[Executor]:
    """The executor of a run (from its record: cluster address and workers), for one node execution."""
    if runtime.executor == INPROCESS:
        yield InProcessExecutor(process_worker(runtime))
        return
    if not address:
        raise RuntimeError(f"runtime.executor is {runtime.executor!r} but the run records no cluster address")
    executor = DaskExecutor(address, [slot(w) for w in workers], security_for(address, runtime))
    try:
        yield executor
    finally:
        executor.close()
