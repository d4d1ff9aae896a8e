"""Server processes a command starts: they die with it, and stop when it is stopped, whatever stops it.

A child process outlives its parent unless told otherwise: a ``bhfl`` command ended by
SIGTERM or SIGHUP (a supervisor, ``kill``, a closed terminal) would leave the servers it
started running, holding their ports and databases. So a server child asks Linux to
SIGTERM it when its parent dies (``PR_SET_PDEATHSIG``, which covers SIGKILL too), and
``serve_until_stopped`` passes on the signals that stop the command.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any

from flows.services.stop_signals import STOP_SIGNALS

_PR_SET_PDEATHSIG = 1
_prctl: Any = None  # libc's prctl where there is one
# resolved here, not in the forked child: no dlopen between fork and exec (threads may hold its lock);
# not Linux: no prctl, and the server may outlive a killed parent
with contextlib.suppress(OSError, AttributeError):
    _prctl = ctypes.CDLL(None, use_errno=True).prctl

STOP_GRACE_S = 15.0  # a stopped server's time to shut down gracefully before its process group is killed


def die_with_parent() -> None:
    """(``preexec_fn``) SIGTERM this child when the thread that started it ends (its process dies)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def serve_until_stopped(cmd: Sequence[str], env: Mapping[str, str]) -> int:
    """Run server ``cmd`` until it exits or this process is stopped; its exit code, or 128 + the stopping signal.

    The server runs in a process group of its own (so the terminal's Ctrl-C reaches
    only this process, once). SIGINT, SIGTERM and SIGHUP reaching this process are
    passed on as SIGTERM, the signal servers shut down on (``mlflow server`` hands it
    to its uvicorn); whatever of its group is left ``STOP_GRACE_S`` later is killed.
    Call it from the main thread (signal handlers).
    """
    proc = subprocess.Popen(
        list(cmd),
        env=dict(env),
        stdin=subprocess.DEVNULL,
        preexec_fn=die_with_parent,  # noqa: PLW1509 (prctl resolved before fork; it takes no lock)
        process_group=0,
    )
    stopped: list[int] = []  # the signals that reached this process

    def stop(signum: int, _frame: FrameType | None) -> None:
        if not stopped:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        stopped.append(signum)

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        deadline = None
        while proc.poll() is None and (deadline is None or time.monotonic() < deadline):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.5)
            if stopped and deadline is None:
                deadline = time.monotonic() + STOP_GRACE_S
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopped:  # the server may have left children (a uvicorn) behind: its group goes too
        _end_group(proc.pid, deadline=time.monotonic() + (5.0 if proc.poll() is not None else 0.0))
        proc.wait()
        return 128 + stopped[0]
    return proc.returncode


def _end_group(pgid: int, deadline: float) -> None:
    """Wait for the server's process group to empty; SIGKILL what is left at ``deadline``."""
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:  # the group is empty
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
