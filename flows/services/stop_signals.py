"""What counts as a stop: a signal that asks a command to end (Ctrl-C, ``kill``, a closed terminal), and how to
tell it from a failure in what the work ended with.

A stopped job is not a failed one: its record says "interrupted", its MLflow runs
KILLED, and the command exits 128 + the signal (flows/cli/stopping.py installs the
handlers that raise ``Stopped``).
"""

from __future__ import annotations

import signal
import sys

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
