"""Prefect runs are *created* one at a time; the runs themselves go on concurrently.

Sibling subtrees run in parallel, so their subflows and tasks would be created at
the same moment. A Prefect server on SQLite answers concurrent run creations with
"database is locked" (HTTP 503; PrefectHQ/prefect#18934), and the client retries only
after ~2 s: measured on a 5-edge tree, parallel subtrees were slower than sequential
ones (7 stalls of 2 s in 3 root rounds). Creating runs one at a time removes the
collisions between our own requests and costs a few milliseconds per run.

``run_gated(call)`` starts ``call`` (a subflow or task call) in its own thread once no
other creation of this experiment is under way, and releases the gate as soon as the
new run is Running (its ``on_running`` hook, ``signal_running``). The gate and the
"running" signal travel in context variables: the experiment opens the gate
(``creation_gate``) and every thread that calls ``run_gated`` works on a copy of the
context, so the gate belongs to one experiment run, not to the process.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")

_GATE: contextvars.ContextVar[threading.Lock | None] = contextvars.ContextVar("bhfl_creation_gate", default=None)
_RUNNING: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("bhfl_run_running", default=None)
_POLL_S = 0.02


@contextmanager
def creation_gate() -> Iterator[None]:
    """While the block runs, Prefect run creations from this context (and the threads it starts) go one at a time."""
    token = _GATE.set(threading.Lock())
    try:
        yield
    finally:
        _GATE.reset(token)


def signal_running(*_: Any) -> None:
    """``on_running`` hook of gated flows and tasks: the run exists, the next one may be created."""
    if (running := _RUNNING.get()) is not None:
        running.set()


def _run(future: Future[T], call: Callable[[], T]) -> None:
    try:
        future.set_result(call())
    except BaseException as exc:  # handed to whoever waits on the future
        future.set_exception(exc)


def run_in_thread(call: Callable[[], T]) -> Future[T]:
    """Run ``call()`` in a new thread, on a copy of this context, at once.

    For work that creates its Prefect runs through ``run_gated`` itself (holding the
    gate around it would deadlock).
    """
    future: Future[T] = Future()
    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(_run, future, call), name="bhfl-work", daemon=True).start()
    return future


def run_gated(call: Callable[[], T]) -> Future[T]:
    """Run ``call()`` in a new thread (on a copy of this context); return at once if no gate is open,
    else once the run it creates is Running (or ``call`` has already returned or failed)."""
    future: Future[T] = Future()
    running = threading.Event()
    context = contextvars.copy_context()
    context.run(_RUNNING.set, running)
    thread = threading.Thread(target=context.run, args=(_run, future, call), name="bhfl-run", daemon=True)
    gate = _GATE.get()
    if gate is None:
        thread.start()
        return future
    with gate:
        thread.start()
        while not running.wait(_POLL_S) and not future.done():
            pass
    return future
