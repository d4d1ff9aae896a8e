"""How a ``bhfl`` command ends when it is told to stop: Ctrl-C (SIGINT), ``kill`` or a supervisor (SIGTERM), a
closed terminal (SIGHUP).

The first stop signal raises ``Stopped`` in the main thread wherever it is, so the command
unwinds as from Ctrl-C: Prefect marks its runs crashed, and the servers and workers the
command started stop with it. A signal can land anywhere, including inside a library's
own bookkeeping: Prefect's task engine, interrupted before its task run exists, fails
while reporting the crash (``ValueError: Task run is not set``), with the ``Stopped`` as
that error's context. So once a stop has been asked for, *whatever* the unwinding raises
is a consequence of the stop, not a failure of its own: the command ends with one line
and exit 128 + the signal (130, 143, 129), never a traceback (``StopRequest.signal_of``,
read by ``guarded`` and the command's entry, flows/cli/main.py).

A stop can also land inside a finaliser (a ``__del__`` the garbage collector runs, a
weakref callback), where Python prints an exception and drops it: ``sys.unraisablehook``
sees it dropped and the main thread is signalled again, so the stop is raised where it
unwinds the command (``StopRequest._unraisable``), not lost until the grace period.

Two rules keep the unwinding itself safe and bounded:

- later signals do not interrupt it (a supervisor or a closing terminal may send
  several): they are ignored, except Ctrl-C, which a user presses again to mean "now";
- it has ``BHFL_STOP_GRACE_S`` seconds (default 60; measured: 2-4 s): past them the
  command ends the way a kill ends it (``end_now``), the path ``bhfl resume`` is built
  and tested for.

Inside a Prefect flow run, Prefect's own SIGTERM handler stands in for this one
(``prefect.utilities.engine.capture_sigterm``): it raises ``TerminationSignal``, marks
the flow run crashed and sends the signal again once this handler is back. ``watch_prefect``
makes that handler record the stop here first and, like this one, let later SIGTERMs
pass while the command stops; without it (another Prefect), a ``TerminationSignal`` in
the chain of what the command ended with still counts. What was written stays
consistent because every file a resume reads is written to a temporary name and renamed
(docs/runtime.md, "Faults").

The handlers are process-wide by nature; they are installed only by the command's entry
(``main``), never by a flow, a task or a test process that imports the commands.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from flows.services.stop_signals import STOP_SIGNALS, Stopped, signal_behind

GRACE_ENV = "BHFL_STOP_GRACE_S"
DEFAULT_GRACE_S = 60.0


def _grace_s() -> float:
    raw = os.environ.get(GRACE_ENV, "")
    try:
        grace = float(raw) if raw else DEFAULT_GRACE_S
    except ValueError:
        grace = -1.0
    if not grace > 0:
        print(f"error: {GRACE_ENV}={raw!r}: not a number of seconds > 0 (default {DEFAULT_GRACE_S:g})", file=sys.stderr)
        raise SystemExit(2)
    return grace


class StopRequest:
    """The stop this command was asked for: the first signal (it decides the exit code), whether the command
    has said so, and what to tell the user to do next.

    The handler runs in the main thread between any two bytecodes, so it takes no lock the
    main thread might hold: the first signal is recorded by the main thread alone (the
    handler, ``signal_of``), the grace period's thread is started beforehand and only
    woken, and "said once" is an atomic counter.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.hint: Callable[[], str] = str  # how to go on, e.g. the resume command (set by the command)
        self.grace_s = DEFAULT_GRACE_S
        self.say: Callable[[str], None] = lambda text: print(text, file=sys.stderr, flush=True)
        self._tells = itertools.count()
        self._asked = threading.Event()
        self._installed = False
        self._dropped = False  # the stop was raised where Python drops exceptions: raise it again (``_unraisable``)
        self._redo = threading.Event()
        self._unraisable_before: Callable[[Any], object] = sys.unraisablehook

    def install(self) -> None:
        """Handle SIGINT, SIGTERM and SIGHUP from now on (the command's entry, in the main thread, once)."""
        self.grace_s = _grace_s()
        threading.Thread(target=self._grace_period, name="bhfl-stop-grace", daemon=True).start()
        threading.Thread(target=self._raise_again, name="bhfl-stop-again", daemon=True).start()
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)
        self._unraisable_before, sys.unraisablehook = sys.unraisablehook, self._unraisable
        self._installed = True

    def _unraisable(self, unraisable: Any) -> None:
        """A stop raised where Python cannot propagate an exception is raised again once the main thread is out.

        A signal's handler runs wherever the main thread is, also inside a ``__del__`` (the
        garbage collector runs them at any allocation: Prefect's and asyncio's objects have
        them) or a weakref callback; an exception raised there is printed ("Exception
        ignored in ...") and dropped, and the command would run on until the grace period
        ended it as a kill, its work thrown away. This hook (``sys.unraisablehook``) sees
        the dropped stop and has ``_raise_again`` signal the main thread again, whose
        handler raises it afresh in ordinary code. (Signalled from here, the handler would
        run before the hook returns: dropped again.) Should it land in a finaliser again,
        it comes back here, so the stop is never lost.
        """
        if self.signum is not None and _is_a_stop(unraisable.exc_value):
            self._dropped = True
            self._redo.set()  # a thread started beforehand: the hook may run where any lock is held
            return
        self._unraisable_before(unraisable)

    def _raise_again(self) -> None:
        while True:
            self._redo.wait()
            self._redo.clear()
            time.sleep(0.01)  # the main thread is out of the hook by then (else: dropped, and back here)
            # a real signal, not _thread.interrupt_main: it also wakes a main thread blocked in a system call
            signal.pthread_kill(threading.main_thread().ident or 0, self.signum or signal.SIGTERM)

    def _again(self) -> bool:
        """Whether the stop that arrives now is one dropped before (``_unraisable``), to be raised again."""
        dropped, self._dropped = self._dropped, False
        return dropped

    def watch_prefect(self) -> None:
        """Have Prefect's SIGTERM handler (the one flow runs install) record the stop here and let later SIGTERMs
        pass; called once Prefect is imported, before a flow runs.

        Prefect looks its handler up by name (``_prefect_sigterm_handler``) each time it
        installs or checks it, so the wrapped one is used everywhere.
        """
        if not self._installed:  # a process that runs commands in-process (tests) keeps Prefect's as it is
            return
        from prefect.utilities import engine

        prefects = getattr(engine, "_prefect_sigterm_handler", None)
        if prefects is None or getattr(prefects, "_bhfl_stop", False):
            return

        def handler(signum: int, frame: FrameType | None) -> None:
            if self.signum is not None and not self._again():
                return  # stopping already: as in ``_on_signal``
            self.noticed(signum)
            prefects(signum, frame)  # raises TerminationSignal: Prefect marks its runs crashed

        handler._bhfl_stop = True  # type: ignore[attr-defined]
        engine._prefect_sigterm_handler = handler  # type: ignore[assignment]

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is None or self._again():
            self.noticed(signum)
            raise Stopped(self.signum or signum)
        if signum == signal.SIGINT:  # Ctrl-C again while stopping: the user wants it now
            first = signal.Signals(self.signum).name
            self.end_now(f"stopped by {first}, then Ctrl-C again: ended at once. {self.hint_text()}")
        # any other: the command is already stopping; let it finish doing so

    def noticed(self, signum: int) -> None:
        """A stop signal arrived (here, or through Prefect's handler): the first one starts the grace period."""
        if self.signum is None:
            self.signum = signum
            self._asked.set()

    def signal_of(self, ended: BaseException | None) -> int | None:
        """The stop signal behind how the command (or a part of it) ended, if a stop was asked for."""
        if self.signum is None and ended is not None and (behind := signal_behind(ended)) is not None:
            self.noticed(behind)
        return self.signum

    @property
    def exit_code(self) -> int:
        """128 + the first stop signal (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP)."""
        assert self.signum is not None
        return 128 + self.signum

    @property
    def signal_name(self) -> str:
        """The first stop signal's name (SIGINT, SIGTERM, SIGHUP)."""
        return signal.Signals(self.exit_code - 128).name

    def tell(self, text: str) -> None:
        """Say how the command stopped, once: the first part of the command to know says it best."""
        if next(self._tells):
            return
        with contextlib.suppress(Exception):  # a closed terminal: nothing to tell it
            self.say(text)

    def _grace_period(self) -> None:
        self._asked.wait()
        _quiet_libraries()
        time.sleep(self.grace_s)  # the command normally exits long before, and this daemon thread with it
        name = signal.Signals(self.signum or signal.SIGTERM).name
        self.end_now(f"stopped by {name}, but still stopping after {self.grace_s:g} s: ended now. {self.hint_text()}")

    def hint_text(self) -> str:
        """How to go on, as the command last said (empty if it cannot say)."""
        try:
            return self.hint()
        except Exception:  # it reads the run folder: never let it stop the stop
            return ""

    def end_now(self, text: str, code: int | None = None) -> None:
        """End the process at once, as a kill would (its workers and servers killed first), after saying ``text``
        unless the command has said how it stopped already.

        Exit ``code``, or 128 + the stop signal. No cleanup runs: every file a resume
        reads is complete or absent, and the run's record says "interrupted". The text
        goes straight to the file descriptor (the console's lock may be held by the thread
        this one ends).
        """
        if not next(self._tells):
            with contextlib.suppress(OSError):
                os.write(2, f"\n{text}\n".encode())
        import psutil

        with contextlib.suppress(psutil.Error):
            for child in psutil.Process().children(recursive=True):  # workers, forkserver, servers
                with contextlib.suppress(psutil.Error):
                    child.kill()
        os._exit(code if code is not None else self.exit_code)


QUIET_ON_STOP = "distributed"  # the loggers (and their children) a stop's unwinding silences


def _quiet_libraries() -> None:
    """Silence Dask's loggers once a stop is asked for: what they log from then on is the stop's doing.

    A sweep's points run in threads of the command, each with a Dask client of the
    workers the command started; the command stops those workers as it ends, and a
    point's client, still waiting on them, logs each refused reconnection at ERROR with
    its traceback (after the command's one line). dask's own logging config sets levels on
    ``distributed.client`` and others, so each logger of the family is set, not just the
    parent. Runs in the grace period's thread (ordinary code, not the signal handler).
    """
    for name in [QUIET_ON_STOP, *logging.Logger.manager.loggerDict]:
        if name == QUIET_ON_STOP or name.startswith(QUIET_ON_STOP + "."):
            logging.getLogger(name).setLevel(logging.CRITICAL + 1)


def _is_a_stop(exc: BaseException | None) -> bool:
    """Whether ``exc`` is the stop itself (a ``Stopped``, Prefect's ``TerminationSignal``), not an error raised
    while a stop unwinds (that one has the stop in its context, and must not raise the stop a second time)."""
    termination = getattr(sys.modules.get("prefect.exceptions"), "TerminationSignal", None)
    return isinstance(exc, Stopped) or (termination is not None and isinstance(exc, termination))


STOP = StopRequest()


def run_command(load_app: Callable[[], Callable[[], object]]) -> None:
    """Run the application ``load_app()`` returns as this process's command, stoppable from the first line.

    The handlers go in first, then ``load_app`` imports the application (a stop while it
    loads ends the command like one that comes later), then it runs. Whatever it ends
    with after a stop was asked for (typer's exit 130 for any ``KeyboardInterrupt``, an
    error raised while a library unwound) becomes one line and exit 128 + the signal.
    The command's entries call it: flows/cli/main.py (``bhfl``) and
    ``python -m flows.cli.app``.
    """
    STOP.install()
    from flows.cli.terminal import printable_output
    from tasks import collector
    from tasks.heap import give_back_freed_memory

    printable_output()  # a non-UTF-8 terminal shows ? for a character it lacks (was: a traceback)
    give_back_freed_memory()  # before the command's heavy imports and allocations
    collected = collector.pause()  # until the job's work starts (flows/cli/jobs.py), or the command ends
    try:
        load_app()()
    except BaseException as ended:
        if STOP.signal_of(ended) is None:
            raise
        STOP.tell(f"stopped by {STOP.signal_name}. {STOP.hint_text()}".rstrip())
        raise SystemExit(STOP.exit_code) from None
    finally:
        collector.restore(collected)
