"""One lifecycle for every kind of job: record -> invoke -> finish or fail -> resume.

An experiment run, a sweep and a pipeline differ in what they do, not in how they are
kept: each has a folder ``<run_root>/<name>/<stamp>`` with a record (flows/records/:
``run.json``, ``sweep.json``, ``pipeline.json``, one ``ProcessRecord`` shape), a Prefect
flow, and a body. This module is the one place that says how any of them

- **starts** (``start``): its folder and record are written (``Job.create``: so a kill at
  any later moment leaves a job that ``bhfl resume`` continues), then it is **invoked**
  through the launch's orchestration (a flow run, or its body called);
- **ends** (``finish_or_fail``): the body's end is written into the record, finished or
  failed with the error, whatever happens;
- **resumes** (``resume``): the record must not belong to a live process; the ``--set``
  changes are checked once, against the one rule (``RESUME_OVERRIDABLE``: only what does
  not change results), applied by the kind, and the record counts the attempt before the
  job is invoked again on the same folder, MLflow runs and checkpoints.

What differs is a ``Job``: a small frozen value per kind (flows/experiment.py
``ExperimentJob``, flows/sweep.py ``SweepJob``, flows/pipeline.py ``PipelineJob``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Self, TypeVar

from flows.launch import Launch
from flows.orchestration_protocol import Invocation, Orchestration
from flows.records.run_record import ProcessRecord
from flows.records.run_state import check_resume_overrides

R = TypeVar("R")
Result = dict[str, Any]


@dataclass(frozen=True)
class Attempt:
    """One attempt at a job's folder: the first, or a resume (with the ``--set`` changes it brought)."""

    folder: Path
    resume: bool = False
    overrides: tuple[str, ...] = ()
    name: str | None = None  # the flow run's name; None: the kind's default

    def flow_run_name(self, default: str) -> str:
        """``name`` (else ``default``), marked ``resume`` when the attempt continues the job."""
        name = self.name or default
        return f"resume {name}" if self.resume else name


class Job(Protocol):
    """What one kind of job brings to the lifecycle."""

    @property
    def counted(self) -> bool:
        """Whether resuming it counts as a resume (``resumes`` in the record, ``bhfl.resumes`` in MLflow)."""
        ...

    def create(self, launch: Launch, folder: Path) -> None:
        """Write a new job's folder: what it runs and its record (status ``running``)."""
        ...

    def with_overrides(self, folder: Path, overrides: Sequence[str]) -> Self:
        """The job as it resumes with ``overrides`` (checked already), the changes written into its folder."""
        ...

    def invocation(self, launch: Launch, attempt: Attempt) -> Invocation[Result]:
        """The job's flow and its parameters, and its body, for ``attempt`` under ``launch``."""
        ...


def start(job: Job, launch: Launch, attempt: Attempt) -> Result:
    """Invoke the job (its folder written) through the launch's orchestration; returns what its body returns."""
    return launch.orchestration.invoke(job.invocation(launch, attempt))


def run(job: Job, launch: Launch, folder: Path, name: str | None = None) -> Result:
    """A new job in ``folder``: its record first, then the job."""
    job.create(launch, folder)
    return start(job, launch, Attempt(folder, name=name))


def resume(
    job: Job,
    folder: Path,
    record: ProcessRecord,
    orchestration: Orchestration,
    overrides: Sequence[str] = (),
    cluster: str | None = None,
    name: str | None = None,
) -> Result:
    """Continue the job in ``folder`` from its ``record`` (as the kind read it).

    RunStateError if the record says it cannot be resumed (its process still runs; a
    pipeline that finished). The same folder, MLflow store and runs; ``overrides`` may
    change only what does not change results (a ConfigError before anything is written).
    """
    record.check_resumable(folder)
    check_resume_overrides(overrides, record.NOUN)
    if overrides:
        job = job.with_overrides(folder, overrides)
    record.resumed(counted=job.counted).write(folder)
    launch = Launch.at(folder, record, orchestration, cluster)
    return start(job, launch, Attempt(folder, resume=True, overrides=tuple(overrides), name=name))


def finish_or_fail(work: Callable[[], R], end: Callable[[BaseException | None], None]) -> R:
    """``work()``, then ``end(None)``; if it raised (an interrupt included), ``end(error)`` and the error goes on.

    ``end`` writes the record's end (``ProcessRecord.ended``) and closes what the kind
    opened (its MLflow run's status).
    """
    try:
        result = work()
    except BaseException as exc:
        end(exc)
        raise
    end(None)
    return result


def stamp() -> str:
    """A flow run's default name for a job started now: the minute it started."""
    return time.strftime("%Y-%m-%d %H:%M")


def served_run_name() -> str:
    """The name of a flow run a deployment starts (``bhfl serve``), as ``bhfl run`` names its own: the job's name
    and the minute it started (Prefect's own is a random pair of words, which says nothing in its UI).

    The flows take it as their ``flow_run_name``; a job started by a command names its flow
    run itself (``with_options``), which replaces this.
    """
    from prefect.runtime import flow_run

    parameters = flow_run.parameters
    job = next((parameters[key] for key in ("config", "sweep", "pipeline") if parameters.get(key) is not None), None)
    name = job.get("name") if isinstance(job, dict) else getattr(job, "name", None)
    return f"{name} {stamp()}" if name else str(flow_run.name)
