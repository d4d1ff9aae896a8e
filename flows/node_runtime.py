"""What one node execution needs, rebuilt from the run folder, and how it runs its work.

A ``NodeRuntime`` is built in whichever thread or process executes a node (from the
run folder and ``run.json``: tracker ids, cluster address, worker slots), so nothing of a
run lives in a process-global registry. Its ``orchestration`` says how node executions
and worker calls are run: as Prefect subflow and task runs (flows/orchestration.py
``PREFECT_RUNS``) or as plain calls (``PLAIN_CALLS``, the same code without Prefect:
tests and the orchestration benchmark).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bhfl_core.placement import utilisation
from flows.records.run_record import RunRecord
from flows.tracking.tracker import Tracker
from tasks.context import RunContext, open_run
from tasks.executor import Executor, executor_for
from tasks.worker import busy_intervals

if TYPE_CHECKING:
    from flows.orchestration_protocol import Orchestration


@dataclass
class NodeRuntime:
    """What one node execution needs, rebuilt from the run folder (in any process that sees it)."""

    ctx: RunContext
    record: RunRecord
    tracker: Tracker
    executor: Executor
    orchestration: Orchestration

    @property
    def run_path(self) -> str:
        return str(self.ctx.run_path)


@contextmanager
def node_runtime(run_path: str, orchestration: Orchestration) -> Iterator[NodeRuntime]:
    ctx = open_run(run_path)
    record = RunRecord.read(ctx.run_path)
    if record is None:
        raise RuntimeError(f"{ctx.run_path} has no run record (run.json)")
    tracker = Tracker.attach(
        record.tracking_uri,
        record.experiment_id,
        record.parent_run_id,
        record.node_runs,
        resumed=record.resumes > 0,
        run_path=ctx.run_path,  # a remote tracking server: calls go through the run folder's spool
    )
    with executor_for(ctx.config.runtime, record.cluster, record.workers) as executor:
        yield NodeRuntime(ctx, record, tracker, executor, orchestration)


def worker_utilisation(rt: NodeRuntime, start: float, end: float) -> dict[str, float]:
    """Worker utilisation over ``[start, end]``: mean busy share, and the share with every worker busy."""
    slots = rt.executor.slots()
    intervals = {k: v for k, v in busy_intervals(rt.ctx.run_path).items() if k in {s.name for s in slots}}
    mean, every = utilisation(intervals, len(slots), (start, end))
    return {"runtime/worker_utilisation": mean, "runtime/all_workers_busy": every}
