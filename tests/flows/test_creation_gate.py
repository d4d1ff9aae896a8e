"""Runs created through the gate: one creation at a time, the runs themselves concurrent."""

import threading
import time

import pytest

from flows.creation_gate import creation_gate, run_gated, signal_running

pytestmark = pytest.mark.integration

CREATE_S, RUN_S = 0.15, 0.4


def _fake_run(log: list[tuple[str, str, float]], name: str):
    """What a Prefect run does: a creation phase, then Running (the hook), then its body."""

    def call() -> str:
        log.append((name, "create", time.monotonic()))
        time.sleep(CREATE_S)
        signal_running()
        log.append((name, "running", time.monotonic()))
        time.sleep(RUN_S)
        return name

    return call


def test_creations_do_not_overlap_but_runs_do():
    log: list[tuple[str, str, float]] = []
    with creation_gate():
        started = time.monotonic()
        futures = [run_gated(_fake_run(log, n)) for n in ("a", "b", "c")]
        assert [f.result() for f in futures] == ["a", "b", "c"]
        elapsed = time.monotonic() - started
    at = {(name, what): t for name, what, t in log}
    for first, second in (("a", "b"), ("b", "c")):
        assert at[(second, "create")] >= at[(first, "running")]  # one creation at a time
    assert elapsed < 3 * (CREATE_S + RUN_S)  # the runs overlapped
    assert elapsed >= 3 * CREATE_S


def test_without_a_gate_calls_start_at_once_and_errors_come_back():
    log: list[tuple[str, str, float]] = []
    futures = [run_gated(_fake_run(log, n)) for n in ("a", "b")]
    [f.result() for f in futures]
    creates = sorted(t for _, what, t in log if what == "create")
    assert creates[1] - creates[0] < CREATE_S  # not serialised

    def fails() -> None:
        raise ValueError("boom")

    with creation_gate():
        future = run_gated(fails)  # a call that fails before Running does not hold the gate
        assert isinstance(future.exception(timeout=5), ValueError)
        assert run_gated(lambda: threading.current_thread().name).result(timeout=5) == "bhfl-run"
