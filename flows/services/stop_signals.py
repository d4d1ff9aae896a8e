"""What counts as a stop: a signal that asks a command to end (Ctrl-C, ``kill``, a closed terminal), and how to
tell it from a failure in what the work ended with.

A stopped job is not a failed one: its record says "interrupted", its MLflow runs
KILLED, and the command exits 128 + the signal (flows/cli/stopping.py installs the
handlers that raise ``Stopped``).
"""

from __future__ import annotations

import contextlib
import contextvars
import signal
import sys
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """A stop signal, raised in the main thread: unwound like Ctrl-C; the command exits with 128 + ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_behind(exc: BaseException) -> int | None:
    """The stop signal ``exc`` comes from, if any: a ``Stopped``, Prefect's ``TerminationSignal`` or a bare
    ``KeyboardInterrupt`` (SIGINT) anywhere among its causes and contexts.

    A ``Stopped`` wins over the others: an event loop it passed through may raise a
    ``KeyboardInterrupt`` of its own, with the ``Stopped`` in its context.
    """
    prefect_exceptions = sys.modules.get("prefect.exceptions")  # only if Prefect is loaded: it is heavy
    termination = getattr(prefect_exceptions, "TerminationSignal", None)
    found: list[int] = []
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, Stopped):
            return current.signum
        if termination is not None and isinstance(current, termination):
            found.insert(0, int(current.signal))
        elif isinstance(current, KeyboardInterrupt):
            found.append(int(signal.SIGINT))
        todo.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return found[0] if found else None


class Halt:
    """The stop that ended the command, for the jobs running in its other threads (a sweep's points).

    A stop signal is raised in the main thread only: a point's thread goes on until the
    sweep, unwinding, stops the workers and the Prefect client under it, and then fails
    with what their loss raised ("... the client has been closed"). Once ``stop`` is set,
    an attempt in a thread under this halt (``over_this_thread``) that ends with an error
    ends as the stop (``as_stopped``: interrupted, MLflow KILLED), not as a failure of its
    own. It travels in a context variable, as the creation gate does (flows/creation_gate.py):
    the point's flow runs in the thread that set it, and a Prefect flow's parameters could
    not carry it.
    """

    def __init__(self) -> None:
        self.stop: BaseException | None = None

    @contextlib.contextmanager
    def over_this_thread(self) -> Iterator[None]:
        token = _HALT.set(self)
        try:
            yield
        finally:
            _HALT.reset(token)


_HALT: contextvars.ContextVar[Halt | None] = contextvars.ContextVar("bhfl_halt", default=None)


def as_stopped(error: BaseException | None) -> BaseException | None:
    """What a job that ended with ``error`` ended by: the stop of the halt over this thread once it has one."""
    halt = _HALT.get()
    return halt.stop if error is not None and halt is not None and halt.stop is not None else error
