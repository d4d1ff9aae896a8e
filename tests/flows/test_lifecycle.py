"""The one job lifecycle and the orchestration protocol, on a toy job (nothing is trained).

A job of the lifecycle is its folder and record, a flow and a body; these tests give it a
record of the real shape (a sweep's) and a body that notes what it saw, and check what
every kind of job relies on: the record written before the job is invoked, the resume
rule checked once for any kind, the record's states (running, resumed, ended), and the
same job invoked as a Prefect flow run (named, ``resume`` marked) or as a plain call.
Worker calls are plain functions: the plain orchestration calls them, the Prefect one
wraps them as tasks named after them with the run's retries.
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prefect import flow

from bhfl_core.config.base import ConfigError
from bhfl_core.config.schema import RuntimeConfig
from flows import lifecycle
from flows.launch import Launch
from flows.lifecycle import Attempt, finish_or_fail
from flows.orchestration import PLAIN_CALLS, PREFECT_RUNS, as_task
from flows.orchestration_protocol import Invocation
from flows.records.pipeline_record import PipelineRecord
from flows.records.run_record import RunStateError
from flows.records.run_state import check_resume_overrides
from flows.records.sweep_record import SWEEP_CONFIG, SweepRecord
from flows.services.stop_signals import Stopped

pytestmark = pytest.mark.integration


@flow(name="bhfl-lifecycle-test", validate_parameters=False)
def toy_flow(folder: str) -> dict[str, Any]:
    """Stands in for a job's flow (a name of its own: other tests count bhfl-* runs)."""
    return _body(Path(folder), "flow")


def _body(folder: Path, how: str) -> dict[str, Any]:
    record = SweepRecord.found(folder)
    return finish_or_fail(
        lambda: {"how": how, "resumes": record.resumes, "status": record.status},
        lambda error: record.ended(error).write(folder),
    )


@dataclass(frozen=True)
class ToyJob:
    counted: bool = True

    def create(self, launch: Launch, folder: Path) -> None:
        folder.mkdir(parents=True)
        (folder / SWEEP_CONFIG).write_text("{}")
        SweepRecord(name="toy", tracking_uri=launch.tracking_uri).write(folder)

    def with_overrides(self, folder: Path, overrides: Sequence[str]) -> ToyJob:
        (folder / "overrides.txt").write_text("\n".join(overrides))
        return self

    def invocation(self, launch: Launch, attempt: Attempt) -> Invocation[dict[str, Any]]:
        body = functools.partial(_body, attempt.folder, "plain")
        name = attempt.flow_run_name(attempt.folder.name)
        return Invocation(toy_flow, {"folder": str(attempt.folder)}, body, name)


@pytest.mark.parametrize("orchestration", [PLAIN_CALLS, PREFECT_RUNS], ids=["plain", "prefect"])
def test_a_job_is_recorded_invoked_ended_and_resumed(tmp_path, orchestration):
    folder = tmp_path / "toy" / "20260101-000000-000"
    launch = Launch.of(tmp_path, orchestration=orchestration)
    first = lifecycle.run(ToyJob(), launch, folder)
    assert first == {"how": "flow" if orchestration is PREFECT_RUNS else "plain", "resumes": 0, "status": "running"}
    assert SweepRecord.found(folder).status == "finished"
    assert launch.tracking_uri == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"

    with pytest.raises(ConfigError, match=r"--set tree.root.rounds=3: a resumed sweep keeps its config"):
        lifecycle.resume(ToyJob(), folder, SweepRecord.found(folder), orchestration, ["tree.root.rounds=3"])
    assert not (folder / "overrides.txt").exists() and SweepRecord.found(folder).resumes == 0  # nothing written

    again = lifecycle.resume(ToyJob(), folder, SweepRecord.found(folder), orchestration, ["runtime.workers=1"])
    assert again["resumes"] == 1 and (folder / "overrides.txt").read_text() == "runtime.workers=1"
    not_counted = lifecycle.resume(ToyJob(counted=False), folder, SweepRecord.found(folder), orchestration)
    assert not_counted["resumes"] == 1


def test_the_prefect_flow_run_is_named_and_marked_as_a_resume(tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    folder = tmp_path / "toy" / "20260101-000000-001"
    lifecycle.run(ToyJob(), Launch.of(tmp_path), folder)
    lifecycle.resume(ToyJob(), folder, SweepRecord.found(folder), PREFECT_RUNS)
    names = [folder.name, f"resume {folder.name}"]
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=names)))
    assert sorted(r.name for r in runs) == sorted(names) and {r.state_name for r in runs} == {"Completed"}


def test_a_failed_body_ends_its_record_failed_and_the_error_goes_on(tmp_path):
    folder = tmp_path / "toy" / "20260101-000000-002"
    ToyJob().create(Launch.of(tmp_path), folder)
    record = SweepRecord.found(folder)

    def work() -> None:
        raise ValueError("broken")

    with pytest.raises(ValueError, match="broken"):
        finish_or_fail(work, lambda error: record.ended(error).write(folder))
    ended = SweepRecord.found(folder)
    assert ended.status == "failed" and ended.error == "ValueError: broken"
    resumed = ended.resumed()
    assert (resumed.status, resumed.error, resumed.resumes, resumed.pid) == ("running", "", 1, os.getpid())


def test_a_stopped_body_ends_its_record_interrupted_whatever_the_unwinding_raised(tmp_path):
    """A stop is not a failure: the record says interrupted (its MLflow runs KILLED), also when what the work
    ended with is an error raised while it unwound (Prefect's crash report failing, with the stop as its context)."""
    folder = tmp_path / "toy" / "20260101-000000-003"
    ToyJob().create(Launch.of(tmp_path), folder)
    record = SweepRecord.found(folder)

    def work() -> None:
        try:
            raise Stopped(signal.SIGTERM)
        except Stopped:
            raise ValueError("Task run is not set")  # noqa: B904  (as Prefect's handle_crash raises it)

    with pytest.raises(ValueError):
        finish_or_fail(work, lambda error: record.ended(error).write(folder))
    ended = SweepRecord.found(folder)
    assert (ended.status, ended.error, ended.mlflow_status) == ("interrupted", "stopped by SIGTERM", "KILLED")
    assert record.ended(ValueError("broken")).mlflow_status == "FAILED"


def test_one_resume_rule_and_one_record_shape_for_every_kind(tmp_path):
    check_resume_overrides(["runtime.workers=2", "eval.batch_size=64"], "pipeline")
    with pytest.raises(ConfigError, match="a resumed pipeline keeps its config"):
        check_resume_overrides(["seed=1"], "pipeline")

    with pytest.raises(RunStateError, match="is not a pipeline folder"):
        PipelineRecord.resumable(tmp_path)
    folder = tmp_path / "p" / "20260101-000000-000"
    folder.mkdir(parents=True)
    (folder / "pipeline.yaml").write_text("{}")
    PipelineRecord(name="p").write(folder)  # running, in this (live) process
    with pytest.raises(RunStateError, match="still running"):
        PipelineRecord.resumable(folder)
    PipelineRecord(name="p", status="finished").write(folder)
    with pytest.raises(RunStateError, match="finished: there is nothing to resume"):
        PipelineRecord.resumable(folder)
    assert PipelineRecord.find("p/20260101-000000-000", tmp_path) == folder.resolve()
    assert PipelineRecord.find_all(tmp_path) == [folder] and SweepRecord.find_all(tmp_path) == []


def double_up(executor: Any, x: int) -> int:
    return 2 * x


def test_worker_calls_are_plain_functions_dispatched_alike(tmp_path):
    rt = SimpleNamespace(executor="executor")
    assert PLAIN_CALLS.call_task(rt, double_up, "double 3", 3) == 6
    assert PLAIN_CALLS.start_task(rt, double_up, "double 4", 4).result() == 8
    named = as_task(double_up, RuntimeConfig(retries=2, retry_delay_s=0.5), "double 5")
    assert (named.name, named.task_run_name, named.retries) == ("double-up", "double 5", 2)
    assert named.fn is double_up
