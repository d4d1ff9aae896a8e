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

Where the points run: when every point runs on ``runtime.executor: local`` with the same
``runtime`` settings, the sweep starts one local worker cluster and every point places
its work on it (a worker serves any run: tasks/worker.py), so N experiments share N
workers instead of starting N clusters on the same cores. ``parallel`` (default: the
number of workers the points share; 1 when each point brings its own executor, e.g.
``inprocess``, where two at once would only share this process's cores) bounds the
experiments in flight: an experiment alternates between worker calls and its own server
rounds, evaluation and bookkeeping here, so one per worker keeps every worker busy while
each experiment waits on the others' calls no longer than one call per worker.

MLflow: the sweep's run lives in an experiment named after the sweep; each point's parent
run is created in that experiment, nested under it (sweep -> point -> root -> servers),
named after its label and tagged ``bhfl.sweep``, ``bhfl.sweep_label`` and
``bhfl.sweep_hash``, so the UI groups a sweep and filters its points.

Resume (``resume_sweep``, or ``run_sweep(..., resume_from=FOLDER)`` with a changed spec)
skips points whose run finished, matched by config hash, resumes interrupted ones from
their checkpoints and starts the rest, under the same MLflow sweep run. A point that fails
does not stop the others; the sweep then ends failed, naming them.
``orchestration=PLAIN_CALLS`` runs it all without Prefect.
"""

from __future__ import annotations

import os
import platform
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.settings import temporary_settings

from bhfl_core.config.base import ConfigError
from bhfl_core.config.schema import RuntimeConfig, dump
from bhfl_core.config.sweep import Point, Sweep, sweep_from_dump, with_overrides
from flows import progress
from flows.creation_gate import run_in_thread
from flows.experiment import resume_experiment, run_experiment
from flows.node_runtime import Orchestration
from flows.records.environment import git_commit
from flows.records.run_record import PipelineLink, RunRecord, default_tracking_uri, new_run_path
from flows.records.run_state import RESUME_OVERRIDABLE
from flows.records.sweep_record import (
    SWEEP_CONFIG,
    PointRecord,
    PointStatus,
    SweepRecord,
    read_sweep_config,
    resumable,
    write_sweep_config,
)
from flows.tracking.sweep_report import REPORT_DIR, write_sweep_report
from flows.tracking.tracker import Tracker
from flows.training import PLAIN_CALLS, PREFECT_RUNS, thread_task_runner

__all__ = ["PLAIN_CALLS", "PREFECT_RUNS", "SweepError", "resume_sweep", "run_sweep", "sweep_flow"]


class SweepError(RuntimeError):
    """Some points of a sweep failed (the others ran to the end); names them and how to go on."""


def shared_runtime(sweep: Sweep, labels: Sequence[str]) -> RuntimeConfig | None:
    """The ``runtime`` every point in ``labels`` has, if they can share one set of workers; else None.

    Shareable: a local cluster (``executor: local``) or a given one (``executor: cluster``),
    with identical ``runtime`` settings (a grid over ``runtime.workers`` gets a cluster per point).
    """
    runtimes = {repr(dump(sweep[label].config)["runtime"]): sweep[label].config.runtime for label in labels}
    if len(runtimes) != 1:
        return None
    (runtime,) = runtimes.values()
    return runtime if runtime.executor in ("local", "cluster") else None


def default_parallel(runtime: RuntimeConfig | None, cluster: str | None) -> int:
    """Experiments in flight by default: one per shared worker (module docstring); 1 without shared workers."""
    if runtime is None:
        return 1
    if runtime.executor == "local":
        from tasks.local_cluster import local_slots

        return len(local_slots(runtime))
    from tasks.executor import cluster_workers

    return len(cluster_workers(cluster or runtime.cluster or "", runtime))


def resolve_lazy_imports(sweep: Sweep) -> None:
    """Resolve, in this thread, every transformers name the points' orchestration imports.

    transformers resolves its top-level names lazily, and two threads resolving one name
    at once can fail (``ImportError: cannot import name 'PreTrainedTokenizerFast'``: seen
    when two experiments of a sweep prepared their data side by side). Once resolved, a
    name is a plain module attribute.
    """
    import transformers

    from bhfl_core.learning.task_kinds import get_task_kind

    names = {"AutoConfig", "AutoTokenizer", "BertConfig", "PreTrainedTokenizerBase", "PreTrainedTokenizerFast"}
    names |= {get_task_kind(p.config.data.task).auto_class for p in sweep}
    for name in sorted(names):
        getattr(transformers, name)


def _fresh_path(run_root: Path, name: str, taken: set[str]) -> Path:
    """A new run folder for ``name`` that no point of this sweep took (stamps have millisecond resolution)."""
    while True:
        path = new_run_path(run_root, name)
        if str(path) not in taken and not path.exists():
            taken.add(str(path))
            return path
        time.sleep(0.002)


class _Sweeper:
    """One attempt at a sweep folder: runs its unfinished points, ``parallel`` at a time."""

    def __init__(self, folder: Path, orchestration: Orchestration, overrides: Sequence[str]) -> None:
        self.folder = folder
        self.run_root = folder.parents[1]
        self.orchestration = orchestration
        self.overrides = list(overrides)
        self.sweep = read_sweep_config(folder)
        record = SweepRecord.read(folder)
        assert record is not None, f"{folder} has no sweep record"
        self.record = record
        self.lock = threading.Lock()  # record changes: from the points' threads
        self.taken: set[str] = {p.run_path for p in record.points.values() if p.run_path}
        self.tracker = Tracker(record.tracking_uri, resumed=record.resumes > 0)

    def _write(self) -> None:
        self.record.write(self.folder)

    def open_run(self) -> None:
        """Create the sweep's MLflow run (first attempt) or reopen it (a resume)."""
        record, tracker = self.record, self.tracker
        if record.run_id:
            tracker.reopen_run(record.experiment_id, record.run_id, record.resumes)
            tracker.log_text((self.folder / SWEEP_CONFIG).read_text(), SWEEP_CONFIG)  # a kill may have cut it
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
        tracker.log_text((self.folder / SWEEP_CONFIG).read_text(), SWEEP_CONFIG)

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

    def _run_point(self, point: Point, entry: PointRecord, cluster: str | None) -> None:
        """Run (or resume) one point in its run folder; its end goes into the record whatever happens."""
        path = Path(entry.run_path)
        status: PointStatus = "finished"
        error = ""
        try:
            if RunRecord.read(path) is not None:  # started before: continue it from its checkpoints
                progress.note(f"point {point.label}: resuming {path}")
                resume_experiment(path, self.orchestration, self.overrides, cluster=cluster, flow_run_name=point.label)
            else:
                progress.note(f"point {point.label}: {point.config.name} in {path}")
                link = PipelineLink(
                    path=str(self.folder), stage=point.label, experiment=self.sweep.name, run_id=self.record.run_id
                )
                run_experiment(
                    point.config,
                    self.run_root,
                    self.record.tracking_uri,
                    self.orchestration,
                    run_path=path,
                    cluster=cluster,
                    link=link,
                    flow_run_name=point.label,
                )
        except Exception as exc:  # the other points go on; the sweep ends failed, naming this one
            status, error = "failed", f"{type(exc).__name__}: {exc}"[:2000]
        with self.lock:
            entry.status, entry.error = status, error
            self._label_run(point, entry)
            self._write()
        progress.note(f"point {point.label}: {status}" + (f" ({error})" if error else ""))

    def run(self, parallel: int | None, cluster: str | None) -> dict[str, Any]:
        started = time.time()
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
        with ExitStack() as stack:
            if runtime is not None and runtime.executor == "local" and cluster is None:
                from tasks.local_cluster import ClusterStart

                starting = ClusterStart(runtime, self.folder)
                stack.callback(starting.close)
                cluster = starting.address()
            elif runtime is None:
                cluster = None  # each point starts (or finds) its own executor
            width = max(1, min(parallel or default_parallel(runtime, cluster), max(len(todo), 1)))
            record.parallel = width
            self._write()
            progress.note(
                f"sweep {self.sweep.name}: {len(todo)} of {len(self.sweep)} experiment(s) to run, {width} at a time"
                + (" on one shared set of workers" if runtime is not None else "")
            )
            if width > 1:
                resolve_lazy_imports(self.sweep)
            self._run_all(todo, width, cluster)
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
            "wall_time_s": time.time() - started,
        }

    def _run_all(self, todo: list[Point], width: int, cluster: str | None) -> None:
        """Start the points in order, at most ``width`` in flight; wait for them all."""
        slots = threading.Semaphore(width)
        futures: list[Future[None]] = []
        for point in todo:
            slots.acquire()
            with self.lock:
                entry = self.record.points[point.label]
                if not entry.run_path:
                    entry.run_path = str(_fresh_path(self.run_root, point.config.name, self.taken))
                entry.status, entry.error = "running", ""
                self._write()

            def work(point: Point = point, entry: PointRecord = entry) -> None:
                try:
                    self._run_point(point, entry, cluster)
                finally:
                    slots.release()

            # daemon threads on a copy of this context: the subflows nest under the sweep's flow run
            futures.append(run_in_thread(work))
        for future in futures:
            future.result()


def _sweep(
    folder: Path, orchestration: Orchestration, overrides: Sequence[str], parallel: int | None, cluster: str | None
) -> dict[str, Any]:
    sweeper = _Sweeper(folder, orchestration, overrides)
    record = sweeper.record
    sweeper.open_run()
    try:
        result = sweeper.run(parallel, cluster)
    except BaseException as exc:
        with sweeper.lock:
            for entry in record.points.values():
                if entry.status == "running":
                    entry.status = "failed"
            record.status, record.error = "failed", f"{type(exc).__name__}: {exc}"[:2000]
            sweeper._write()
        sweeper.tracker.log_text((folder / "sweep.json").read_text(), "sweep.json")
        sweeper.tracker.finish("FAILED")
        raise
    record.status = "finished"
    sweeper._write()
    sweeper.tracker.log_text((folder / "sweep.json").read_text(), "sweep.json")
    sweeper.tracker.finish("FINISHED")
    return result


def new_sweep_folder(sweep: Sweep, run_root: Path, tracking_uri: str | None = None, folder: Path | None = None) -> Path:
    """Write a new sweep folder (``sweep.yaml``, ``sweep.json`` with every point pending); its path."""
    run_root = run_root.resolve()
    folder = (folder or new_run_path(run_root, sweep.name)).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    write_sweep_config(folder, sweep)
    record = SweepRecord(
        name=sweep.name,
        tracking_uri=tracking_uri or default_tracking_uri(run_root),
        points={p.label: PointRecord(config_hash=p.hash, values=p.values) for p in sweep},
    )
    record.write(folder)
    return folder


@flow(name="bhfl-sweep", validate_parameters=False)
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
        sweep_path = str(new_sweep_folder(resolved, Path(run_root), tracking_uri))
    return _sweep(Path(sweep_path), PREFECT_RUNS, overrides or (), parallel, cluster)


def _invoke(
    folder: Path,
    orchestration: Orchestration,
    overrides: Sequence[str],
    parallel: int | None,
    cluster: str | None,
    resume: bool,
) -> dict[str, Any]:
    if orchestration is not PREFECT_RUNS:
        return _sweep(folder, orchestration, overrides, parallel, cluster)
    # as for an experiment (flows/experiment.py): heartbeats only help deployment runs
    with temporary_settings(updates={"flows.heartbeat_frequency": None}):
        name = f"resume {folder.name}" if resume else folder.name
        flow_ = sweep_flow.with_options(flow_run_name=name, task_runner=thread_task_runner())
        return flow_(str(folder), None, None, None, parallel, list(overrides), cluster)


def _adopt(folder: Path, sweep: Sweep) -> None:
    """Point an existing sweep folder at ``sweep`` (a changed spec): runs are kept by config hash.

    A point whose config hash the folder knows keeps its run folder and status; a new one
    is pending. Finished points the new spec drops stay in the folder (they are results);
    unfinished ones it drops are forgotten (their run folders stay on disk).
    """
    record = resumable(folder)
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


def _check_resume_overrides(overrides: Sequence[str]) -> None:
    for assignment in overrides:
        if not assignment.split("=", 1)[0].strip().startswith(RESUME_OVERRIDABLE):
            raise ConfigError(
                f"--set {assignment}: a resumed sweep keeps its configs; only runtime.* and eval.batch_size "
                "may change (they do not change results). Start a new sweep instead."
            )


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
    if resume_from is not None:
        resume_from = resume_from.resolve()
        _adopt(resume_from, sweep)
        return resume_sweep(resume_from, orchestration, parallel=parallel, cluster=cluster)
    folder = new_sweep_folder(sweep, run_root, tracking_uri, folder)
    return _invoke(folder, orchestration, (), parallel, cluster, resume=False)


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
    record = resumable(folder)
    _check_resume_overrides(overrides)
    if overrides:  # points not started take the change now; interrupted ones when they resume
        sweep = read_sweep_config(folder)
        fresh = [label for label, e in record.points.items() if not e.run_path]
        write_sweep_config(folder, with_overrides(sweep, overrides, fresh, str(folder / SWEEP_CONFIG)))
    record = record.model_copy(
        update={"status": "running", "pid": os.getpid(), "error": "", "resumes": record.resumes + 1}
    )
    record.write(folder)
    return _invoke(folder, orchestration, overrides, parallel, cluster, resume=True)


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
    from prefect import serve
    from prefect.deployments.runner import RunnerDeployment

    deployment = sweep_deployment(sweep, cron, name, run_root, tracking_uri)
    assert isinstance(deployment, RunnerDeployment)  # to_deployment is sync outside an event loop
    serve(deployment, print_starting_message=True)
