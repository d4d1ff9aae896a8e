"""Runs created through the gate: one creation at a time, the runs themselves concurrent."""

import threading
import time

import pytest

from flows.creation_gate import creation_gate, run_gated, signal_running

pytestmark = pytest.mark.integration

CREATE_S, RUN_S = 0.15, 0.4
MEET_S = 60  # how long a call waits for the others at a meeting point: only a serialising gate makes it wait long


def _fake_run(
    log: list[tuple[str, str, float]],
    name: str,
    creating: threading.Barrier | None = None,
    running: threading.Barrier | None = None,
):
    """What a Prefect run does: a creation phase, then Running (the hook), then its body.

    ``creating``/``running``: the calls meet there, in that phase (each waits for the others): a barrier the
    gate makes unreachable breaks after ``MEET_S`` and fails the call, where a measured time would depend on
    how busy the machine is."""

    def call() -> str:
        log.append((name, "create", time.monotonic()))
        if creating is not None:
            creating.wait(MEET_S)
        time.sleep(CREATE_S)
        log.append((name, "running", time.monotonic()))  # before the hook: once it runs, the next creation may
        signal_running()  # start and log its own time first
        if running is not None:
            running.wait(MEET_S)
        else:
            time.sleep(RUN_S)
        return name

    return call


def test_creations_do_not_overlap_but_runs_do():
    log: list[tuple[str, str, float]] = []
    with creation_gate():
        together = threading.Barrier(3)  # every run in its body at once: the runs overlap
        futures = [run_gated(_fake_run(log, n, running=together)) for n in ("a", "b", "c")]
        assert [f.result() for f in futures] == ["a", "b", "c"]
    at = {(name, what): t for name, what, t in log}
    for first, second in (("a", "b"), ("b", "c")):
        assert at[(second, "create")] >= at[(first, "running")]  # one creation at a time


def test_without_a_gate_calls_start_at_once_and_errors_come_back():
    log: list[tuple[str, str, float]] = []
    together = threading.Barrier(2)  # both creating at once: not serialised
    futures = [run_gated(_fake_run(log, n, creating=together)) for n in ("a", "b")]
    assert [f.result() for f in futures] == ["a", "b"]

    def fails() -> None:
        raise ValueError("boom")

    with creation_gate():
        future = run_gated(fails)  # a call that fails before Running does not hold the gate
        assert isinstance(future.exception(timeout=5), ValueError)
        assert run_gated(lambda: threading.current_thread().name).result(timeout=5) == "bhfl-run"
