"""Running `bhfl` commands as a user runs them: to their end with the output captured (``cli``), or, as a user
without servers of their own runs them, each in a session of its own (``start``, ``wait_for``, ``left_behind``)."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.flows.kill_chain import leftovers
from tests.small import REPO, SMALL


def cli(
    *args: str, timeout: float = 120, python: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``bhfl ARGS`` in a subprocess (``python``: options for the interpreter, e.g. ``-X importtime``; ``env``:
    variables set for it, e.g. a server of the user's)."""
    extra = env or {}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    for own_servers in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL"):  # the commands' defaults, not the user's
        env.pop(own_servers, None)
    env.update(extra)
    return subprocess.run(
        [sys.executable, *python, "-m", "flows.cli.app", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def sets(*extra: str) -> list[str]:
    """``--set`` arguments for the small experiment (tests/small.py) and ``extra``."""
    return [arg for s in [*SMALL, *extra] for arg in ("--set", s)]


def own_servers_env(**extra: str) -> dict[str, str]:
    """The environment of a user without a Prefect server of their own: `bhfl` starts its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PREFECT_SERVER_DATABASE"))}
    env.pop("PREFECT_HOME", None)
    return {**env, "HF_HUB_OFFLINE": "1", **extra}


def start(args: list[str], env: dict[str, str], log: Path, signal_at: Sequence[str] = ()) -> subprocess.Popen:
    """`bhfl ARGS` in a session of its own (its pid is the session id), stdout and stderr to ``log``.

    ``signal_at``: where the command signals itself (tests/flows/signal_at.py's specs).
    """
    entry = ["tests.flows.signal_at", *signal_at, "--"] if signal_at else ["flows.cli.app"]
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", *entry, *args],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_for(what: str, found: Callable[[], Any], proc: subprocess.Popen, log: Path, timeout_s: float = 420) -> Any:
    """``found()`` once it is true; fails if the command ends first or ``timeout_s`` passes.

    The default is 3x the slowest wait measured on a loaded 2-core machine (two busy loops beside other
    helpers' tests): a sweep's second point's first root round (tests/flows/test_signals.py), 136 s (76 s at
    a lighter load; the whole test took 78 s in CI) against the 180 s it had. It only bounds a failure's wait."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := found():
            return result
        assert proc.poll() is None, f"exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"no {what} after {timeout_s} s:\n{log.read_text()[-3000:]}")


def left_behind(session: int, grace_s: float = 10.0) -> list[str]:
    """The processes of a command's session still alive ``grace_s`` after it ended; killed (the suite goes on)."""
    alive = leftovers(session, grace_s)
    for entry in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(entry.split()[0]), signal.SIGKILL)
    return alive


def scored_with(run_path: str, model: str, **eval_settings: Any) -> tuple[Any, Any]:
    """``model`` of a finished run scored by a real worker runtime with ``eval`` settings changed (e.g.
    ``client_model_sample``, ``clients``): its ``ModelValues`` and the worker's scoring table."""
    from bhfl_core.analysis.matrix_axes import PROXY, ModelRef
    from tasks.context import RunContext
    from tasks.scoring import score_models
    from tasks.worker import WorkerRuntime, worker_device

    opened = RunContext.open(Path(run_path))
    settings = opened.config.eval.model_copy(update=eval_settings)
    ctx = RunContext.open(Path(run_path), opened.config.model_copy(update={"eval": settings}))
    runtime = WorkerRuntime("test", worker_device("cpu"))
    (values,) = score_models(ctx, runtime._trainer(ctx), [ModelRef.of_node(model)])
    return values, ctx.scoring_table(PROXY)
