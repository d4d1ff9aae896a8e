"""`bhfl` with a signal sent from inside chosen functions, so it lands in a window of microseconds every time.

    python -m tests.flows.signal_at SPEC [SPEC ...] -- BHFL_ARGS ...

``SPEC`` is ``module:attr.path@N=ACTION``: the N-th call of that function first carries
out ACTION, then runs the function (``attr.path`` may name a class's method). ACTION is
a signal name (``SIGTERM``, ``SIGHUP``, ``SIGINT``) raised in the calling thread: from
the main thread its handler runs before the function's first line, so the stop lands
there, inside whatever called it; or ``hang``: the call never returns (a stuck
clean-up). Pick functions the main thread calls: from another thread, the signal's
handler runs wherever the main thread is at that moment.

Polling a log and then signalling the process lands anywhere in the seconds that
follow; this lands in the same place on every run, and on any machine.
"""

from __future__ import annotations

import importlib
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any


def _patch(spec: str) -> None:
    target, _, rest = spec.partition("@")
    nth, _, action = rest.partition("=")
    module_name, _, path = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    original: Callable[..., Any] = getattr(owner, name)
    calls = [0]
    lock = threading.Lock()

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with lock:
            calls[0] += 1
            due = calls[0] == int(nth)
        if due:
            if action == "hang":
                threading.Event().wait()
            elif threading.current_thread() is threading.main_thread():
                signal.raise_signal(signal.Signals[action])
            else:
                signal.pthread_kill(threading.main_thread().ident or 0, signal.Signals[action])
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


if __name__ == "__main__":
    split = sys.argv.index("--")
    for spec in sys.argv[1:split]:
        _patch(spec)
    sys.argv = ["bhfl", *sys.argv[split + 1 :]]
    from flows.cli.main import main

    main()
