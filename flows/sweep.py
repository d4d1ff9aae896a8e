"""A sweep as a Prefect flow: its points run side by side, each an experiment run (a subflow).

Flow shape (what the Prefect UI shows)::

    bhfl-sweep                              (one per sweep run)
      eta_down=1.0,seed=0                   (bhfl-experiment subflow, named after the point)
        prepare-data, node: root, ...
      eta_down=1.0,seed=1                   (up to ``parallel`` of them at once)
      ...

Folders: ``<run_root>/<sweep>/<stamp>/`` holds ``sweep.yaml`` (every point's resolved
config) and ``sweep.json`` (status, MLflow ids, label -> config hash, run folder,
status; flows/records/sweep_record.py). Every point is an ordinary run folder.

Where the points run (flows/sweep_workers.py): on one set of workers they share where
their ``runtime`` allows, ``parallel`` at a time (default: one per shared worker, so each
experiment waits on the others' calls no longer than one call per worker; 1 when each
point brings its own executor, e.g. ``inprocess``).

MLflow: the sweep's run lives in an experiment named after the sweep; each point's parent
run is created in that experiment, nested under it (sweep -> point -> root -> servers),
named after its label and tagged ``bhfl.sweep``, ``bhfl.sweep_label`` and
``bhfl.sweep_hash``, so the UI groups a sweep and filters its points.

Resume (``resume_sweep``, or ``run_sweep(..., resume_from=FOLDER)`` with a changed spec) skips points
whose run finished, matched by config hash, resumes interrupted ones from their checkpoints and starts
the rest, under the same MLflow sweep run. A point that fails does not stop the others; the sweep then
ends failed, naming them. ``orchestration=PLAIN_CALLS`` runs it all without Prefect.
"""

from __future__ import annotations

import functools
import platform
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prefect import flow

from bhfl_core.config.base import ConfigError
from bhfl_core.config.sweep import Point, Sweep, sweep_from_dump, with_overrides
from flows import lifecycle, progress
from flows.creation_gate import run_in_thread
from flows.experiment import run_or_resume
from flows.launch import Launch
from flows.lifecycle import Attempt, finish_or_fail
from flows.orchestration import PLAIN_CALLS, PREFECT_RUNS
from flows.orchestration_protocol import Invocation, Orchestration
from flows.records.environment import git_commit
from flows.records.run_record import PipelineLink, RunRecord, fresh_run_path, new_run_path
from flows.records.sweep_record import (
    SWEEP_CONFIG,
    PointRecord,
    PointStatus,
    SweepRecord,
    read_sweep_config,
    write_sweep_config,
)
from flows.run_attempt import orchestrator_threads
from flows.services.stop_signals import Halt, signal_behind
from flows.sweep_workers import default_parallel, resolve_lazy_imports, shared_runtime
from flows.tracking.sweep_report import REPORT_DIR, write_sweep_report
from flows.tracking.tracker import Tracker

__all__ = ["PLAIN_CALLS", "PREFECT_RUNS", "SweepError", "SweepJob", "resume_sweep", "run_sweep", "sweep_flow"]


class SweepError(RuntimeError):
    """Some points of a sweep failed (the others ran to the end); names them and how to go on."""


class _Sweeper:
    """One attempt at a sweep folder: runs its unfinished points, ``parallel`` at a time."""

    def __init__(self, folder: Path, launch: Launch, overrides: Sequence[str]) -> None:
        self.folder = folder
        self.launch = launch
        self.overrides = list(overrides)
        self.sweep = read_sweep_config(folder)
        record = SweepRecord.read(folder)
        assert record is not None, f"{folder} has no sweep record"
        self.record = record
        self.lock = threading.Lock()  # record changes: from the points' threads
        self.taken: set[str] = {p.run_path for p in record.points.values() if p.run_path}
        self.tracker = Tracker(record.tracking_uri, resumed=record.resumes > 0)
        self.halt = Halt()  # set when a stop ends the sweep: its points' threads then end as stopped, not failed

    def _write(self) -> None:
        self.record.write(self.folder)

    def open_run(self) -> None:
        """Create the sweep's MLflow run (first attempt) or reopen it (a resume)."""
        record, tracker = self.record, self.tracker
        if record.run_id:
            tracker.reopen_run(record.experiment_id, record.run_id, record.resumes)
            config = (self.folder / SWEEP_CONFIG).read_text(encoding="utf-8")
            tracker.log_text(config, SWEEP_CONFIG)  # a kill may have cut it
            return
        keys = sorted({k for p in self.sweep for k in p.values})
        tags = {
            "bhfl.kind": "sweep",
            "bhfl.sweep_path": str(self.folder),
            "bhfl.git_commit": git_commit(),
            "bhfl.python": platform.python_version(),
            "bhfl.task": self.sweep.points[0].config.data.task,
        }
        description = f"Sweep `{self.sweep.name}`: {len(self.sweep)} experiments over " + ", ".join(keys) + "."
        params = {"swept_keys": keys, "points": len(self.sweep)}
        record.run_id = tracker.start_pipeline(self.sweep.name, params, tags, description, run_key=record.run_key)
        record.experiment_id = tracker.experiment_id
        self._write()
        tracker.log_text((self.folder / SWEEP_CONFIG).read_text(encoding="utf-8"), SWEEP_CONFIG)

    def _label_run(self, point: Point, entry: PointRecord) -> None:
        """Name the point's MLflow run after its label and tag it with the sweep (once its run exists)."""
        run = RunRecord.read(Path(entry.run_path))
        if run is None or not run.parent_run_id:
            return
        entry.run_id = run.parent_run_id
        self.tracker.client.update_run(entry.run_id, name=point.label)
        self.tracker.set_tags(
            {
                "bhfl.sweep": self.sweep.name,
                "bhfl.sweep_path": str(self.folder),
                "bhfl.sweep_label": point.label,
                "bhfl.sweep_hash": point.hash,
            },
            run_id=entry.run_id,
        )

    def _run_point(self, point: Point, entry: PointRecord, launch: Launch) -> None:
        """Run (or resume) one point in its run folder; its end goes into the record whatever happens."""
        path = Path(entry.run_path)
        status: PointStatus = "finished"
        error = ""
        try:
            link = PipelineLink(
                path=str(self.folder), stage=point.label, experiment=self.sweep.name, run_id=self.record.run_id
            )
            run_or_resume(link, "point", path, launch, lambda: point.config, self.overrides)
        except Exception as exc:  # the other points go on; the sweep ends failed, naming this one
            status, error = "failed", f"{type(exc).__name__}: {exc}"[:2000]
            if self.halt.stop is not None:  # its workers stopped under it: the sweep's stop, not its failure
                status, error = "interrupted", ""
        with self.lock:
            entry.status, entry.error = status, error
            self._label_run(point, entry)
            self._write()
        progress.note(f"point {point.label}: {status}" + (f" ({error})" if error else ""))

    def run(self, parallel: int | None) -> dict[str, Any]:
        record = self.record
        todo: list[Point] = []
        for point in self.sweep:
            entry = record.points[point.label]
            if entry.run_finished():
                entry.status = "finished"
                if not entry.run_id:
                    self._label_run(point, entry)
                progress.note(f"point {point.label}: finished before, not run again ({entry.run_path})")
            else:
                todo.append(point)
        runtime = shared_runtime(self.sweep, [p.label for p in todo]) if todo else None
        launch = self.launch
        with ExitStack() as stack:
            if runtime is not None and runtime.executor == "local" and launch.cluster is None:
                from tasks.local_cluster import ClusterStart

                starting = ClusterStart(runtime)
                stack.callback(starting.close)
                launch = launch.for_points(starting.address())
            else:  # points of one runtime on a cluster given; or each point starts (or finds) its own executor
                launch = launch.for_points(launch.cluster if runtime is not None else None)
            local = runtime if runtime is not None and runtime.executor == "local" else None
            torch.set_num_threads(orchestrator_threads(local))  # once: the points are threads of this process
            width = max(1, min(parallel or default_parallel(runtime, launch.cluster), max(len(todo), 1)))
            record.parallel = width
            self._write()
            progress.note(
                f"sweep {self.sweep.name}: {len(todo)} of {len(self.sweep)} experiment(s) to run, {width} at a time"
                + (" on one shared set of workers" if runtime is not None else "")
            )
            if width > 1:
                resolve_lazy_imports(self.sweep)
            try:
                self._run_all(todo, width, launch)
            except BaseException as ended:  # before the workers stop under the points (the stack's close)
                if signal_behind(ended) is not None:
                    self.halt.stop = ended
                raise
        failed = [label for label, e in record.points.items() if e.status == "failed"]
        finished = sum(e.status == "finished" for e in record.points.values())
        report = write_sweep_report(self.folder, self.sweep, record)
        if report is not None:
            self.tracker.log_artifacts(report.parent, REPORT_DIR)
            progress.note(f"sweep report: {report}")
        self.tracker.log_metrics(
            self.tracker.parent_id,
            {"sweep/points": len(record.points), "sweep/finished": finished, "sweep/failed": len(failed)},
            step=record.resumes,
        )
        if failed:
            raise SweepError(
                f"{len(failed)} of {len(record.points)} experiment(s) of sweep {self.sweep.name} failed: "
                + "; ".join(f"{label}: {record.points[label].error}" for label in failed)
                + f". The others are kept; once it is fixed, continue with `bhfl resume {self.folder}` "
                "(finished experiments are not run again, interrupted ones resume from their checkpoints)."
            )
        return {
            "sweep_path": str(self.folder),
            "name": self.sweep.name,
            "tracking_uri": record.tracking_uri,
            "experiment_id": record.experiment_id,
            "run_id": record.run_id,
            "parallel": width,
            "ran": [p.label for p in todo],
            "points": {label: entry.model_dump() for label, entry in record.points.items()},
            "tasks": {p.label: p.config.data.task for p in self.sweep},
            "resumes": record.resumes,
        }

    def _run_all(self, todo: list[Point], width: int, launch: Launch) -> None:
        """Start the points in order, at most ``width`` in flight; wait for them all."""
        slots = threading.Semaphore(width)
        futures: list[Future[None]] = []
        for point in todo:
            slots.acquire()
            with self.lock:
                entry = self.record.points[point.label]
                if not entry.run_path:
                    entry.run_path = str(fresh_run_path(self.launch.run_root, point.config.name, self.taken))
                entry.status, entry.error = "running", ""
                self._write()

            def work(point: Point = point, entry: PointRecord = entry) -> None:
                try:
                    with self.halt.over_this_thread():
                        self._run_point(point, entry, launch)
                finally:
                    slots.release()

            # daemon threads on a copy of this context: the subflows nest under the sweep's flow run
            futures.append(run_in_thread(work))
        for future in futures:
            future.result()

    def end(self, error: BaseException | None) -> None:
        """The sweep's end into ``sweep.json`` (points still running end as it does) and MLflow."""
        with self.lock:
            self.record = self.record.ended(error)
            if error is not None:
                for entry in self.record.points.values():
                    if entry.status == "running":
                        entry.status = self.record.status  # failed, or interrupted (a stop)
                        if signal_behind(error) is not None:
                            RunRecord.end_abandoned(Path(entry.run_path), error)
            self._write()
        self.tracker.log_text((self.folder / "sweep.json").read_text(encoding="utf-8"), "sweep.json")
        self.tracker.finish(self.record.mlflow_status)


def _sweep(folder: Path, launch: Launch, overrides: Sequence[str], parallel: int | None) -> dict[str, Any]:
    sweeper = _Sweeper(folder, launch, overrides)
    sweeper.open_run()
    return finish_or_fail(lambda: sweeper.run(parallel), sweeper.end)


@dataclass(frozen=True)
class SweepJob:
    """A sweep as a job of the lifecycle (flows/lifecycle.py): ``sweep``, a new sweep's points (a resume reads
    them from its folder), and ``parallel``, the experiments at once (None: ``default_parallel``)."""

    sweep: Sweep | None = None
    parallel: int | None = None
    counted = True

    def create(self, launch: Launch, folder: Path) -> None:
        """``sweep.yaml`` (every point's resolved config) and ``sweep.json`` with every point pending."""
        assert self.sweep is not None, "a new sweep folder needs the sweep"
        folder.mkdir(parents=True, exist_ok=True)
        write_sweep_config(folder, self.sweep)
        points = {p.label: PointRecord(config_hash=p.hash, values=p.values) for p in self.sweep}
        SweepRecord(name=self.sweep.name, tracking_uri=launch.tracking_uri, points=points).write(folder)

    def with_overrides(self, folder: Path, overrides: Sequence[str]) -> SweepJob:
        """Points not started take the change now; interrupted ones when they resume (their own run's resume)."""
        record = SweepRecord.found(folder)
        fresh = [label for label, e in record.points.items() if not e.run_path]
        sweep = read_sweep_config(folder)
        write_sweep_config(folder, with_overrides(sweep, overrides, fresh, str(folder / SWEEP_CONFIG)))
        return self

    def invocation(self, launch: Launch, attempt: Attempt) -> Invocation[dict[str, Any]]:
        parameters = {
            "sweep_path": str(attempt.folder),
            "parallel": self.parallel,
            "overrides": list(attempt.overrides),
            "cluster": launch.cluster,
        }
        body = functools.partial(_sweep, attempt.folder, launch, attempt.overrides, self.parallel)
        # named as an experiment's and a served sweep's: its name and the minute it started (it was the folder's stamp)
        name = f"{SweepRecord.found(attempt.folder).name} {lifecycle.stamp()}"
        return Invocation(sweep_flow, parameters, body, attempt.flow_run_name(name))


@flow(name="bhfl-sweep", validate_parameters=False, flow_run_name=lifecycle.served_run_name)
def sweep_flow(
    sweep_path: str | None = None,
    sweep: dict[str, Any] | None = None,
    run_root: str | None = None,
    tracking_uri: str | None = None,
    parallel: int | None = None,
    overrides: list[str] | None = None,
    cluster: str | None = None,
) -> dict[str, Any]:
    """Run the sweep in ``sweep_path`` (its ``sweep.yaml`` and ``sweep.json``), or finish it.

    Without ``sweep_path`` (a scheduled deployment run) a new sweep folder is made under
    ``run_root`` from ``sweep`` (a resolved sweep, ``Sweep.dump``). Each point is a
    ``bhfl-experiment`` subflow named after its label.
    """
    if sweep_path is None:
        if sweep is None or run_root is None:
            raise ConfigError("bhfl-sweep: give sweep_path, or sweep and run_root (a new sweep)")
        resolved = sweep_from_dump(sweep, source="bhfl-sweep parameters")
        new = Launch.of(Path(run_root), tracking_uri)
        sweep_path = str(new_run_path(new.run_root, resolved.name))
        SweepJob(resolved).create(new, Path(sweep_path))
    folder = Path(sweep_path).resolve()
    launch = Launch.at(folder, SweepRecord.found(folder), PREFECT_RUNS, cluster)
    return _sweep(folder, launch, overrides or (), parallel)


def _adopt(folder: Path, sweep: Sweep) -> None:
    """Point an existing sweep folder at ``sweep`` (a changed spec): runs are kept by config hash.

    A point whose config hash the folder knows keeps its run folder and status; a new one
    is pending. Finished points the new spec drops stay in the folder (they are results);
    unfinished ones it drops are forgotten (their run folders stay on disk).
    """
    record = SweepRecord.resumable(folder)
    if sweep.name != record.name:
        raise ConfigError(
            f"--resume {folder}: that folder holds sweep {record.name!r}, this spec is {sweep.name!r}; "
            "resume a folder of the same sweep (or set name: to match)"
        )
    old_sweep = read_sweep_config(folder)
    known = record.by_hash()
    points: dict[str, PointRecord] = {}
    for p in sweep:
        entry = known.pop(p.hash, None)
        points[p.label] = (
            entry.model_copy(update={"values": p.values})
            if entry is not None
            else PointRecord(config_hash=p.hash, values=p.values)
        )
    kept = [p for p in old_sweep if p.hash in known and known[p.hash].run_finished() and p.label not in points]
    points.update({p.label: known[p.hash] for p in kept})
    write_sweep_config(folder, Sweep(sweep.name, (*sweep.points, *kept), sweep.baseline))
    record.points = points
    record.write(folder)


def start_sweep(
    sweep: Sweep,
    launch: Launch,
    folder: Path | None = None,
    parallel: int | None = None,
    resume_from: Path | None = None,
) -> dict[str, Any]:
    """``sweep`` under ``launch`` (``run_sweep``'s arguments but the run identities, which ``launch`` holds)."""
    if resume_from is not None:
        resume_from = resume_from.resolve()
        _adopt(resume_from, sweep)
        return resume_sweep(resume_from, launch.orchestration, parallel=parallel, cluster=launch.cluster)
    folder = (folder or new_run_path(launch.run_root, sweep.name)).resolve()
    # the points' run folders and data cache: beside the sweep folder (<run_root>/<sweep>/<stamp>)
    return lifecycle.run(SweepJob(sweep, parallel), launch.under(folder.parents[1]), folder)


def run_sweep(
    sweep: Sweep,
    run_root: Path,
    tracking_uri: str | None = None,
    orchestration: Orchestration = PREFECT_RUNS,
    folder: Path | None = None,
    parallel: int | None = None,
    cluster: str | None = None,
    resume_from: Path | None = None,
) -> dict[str, Any]:
    """Run every point of ``sweep`` (Prefect's server unless PREFECT_API_URL is set, or PLAIN_CALLS).

    ``folder`` (default: a new ``<run_root>/<sweep>/<timestamp>``) is the sweep folder;
    ``resume_from``: an existing sweep folder of the same sweep instead, whose finished
    points (by config hash) are kept. ``parallel``: experiments at once (default:
    ``default_parallel``); ``cluster``: the address of a local cluster already started
    for the points (else the sweep starts one when they can share it).
    """
    launch = Launch.of(run_root, tracking_uri, orchestration, cluster)
    return start_sweep(sweep, launch, folder, parallel, resume_from)


def resume_sweep(
    folder: Path,
    orchestration: Orchestration = PREFECT_RUNS,
    overrides: Sequence[str] = (),
    parallel: int | None = None,
    cluster: str | None = None,
) -> dict[str, Any]:
    """Finish the sweep in ``folder``: finished points are kept, interrupted ones resume, the rest run.

    ``overrides`` may change only ``runtime.*`` and ``eval.batch_size`` (as for ``bhfl
    resume``), of every point not finished yet.
    """
    folder = folder.resolve()
    record = SweepRecord.found(folder)
    return lifecycle.resume(SweepJob(parallel=parallel), folder, record, orchestration, overrides, cluster)


def sweep_deployment(sweep: Sweep, cron: str, name: str, run_root: Path, tracking_uri: str) -> Any:
    """The deployment ``bhfl-sweep/<name>``: every scheduled run is a new sweep folder of the resolved points.

    Its parameters are the resolved sweep (every point's full config), as ``bhfl serve``
    does for one experiment (flows/serve.py), so each run computes the same experiments.
    """
    from prefect.deployments.runner import EntrypointType

    return sweep_flow.to_deployment(
        name=name,
        cron=cron,
        parameters={"sweep": sweep.dump(), "run_root": str(run_root), "tracking_uri": tracking_uri},
        description=f"B-HFL sweep `{sweep.name}` ({len(sweep)} experiments) on a schedule: {cron}",
        tags=["bhfl", "sweep", sweep.name],
        enforce_parameter_schema=False,
        entrypoint_type=EntrypointType.MODULE_PATH,  # runs from any working directory
    )


def serve_sweep(sweep: Sweep, cron: str, name: str, run_root: Path, tracking_uri: str) -> None:
    """Register the deployment ``bhfl-sweep/<name>`` and serve it until interrupted."""
    from flows.serve import serve_deployment

    serve_deployment(sweep_deployment(sweep, cron, name, run_root, tracking_uri))
