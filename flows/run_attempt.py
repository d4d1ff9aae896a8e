"""One attempt at an experiment's run folder: set up -> train the tree -> evaluate -> report.

The body of the ``bhfl-experiment`` flow (flows/experiment.py), phase by phase. Where
the work runs: this process runs the server rounds and MLflow logging; client training,
proxy training and evaluation run on the run's executor (tasks/executor.py). A resumed
attempt is the same code: every phase finds what an earlier attempt finished (data by
fingerprint, MLflow runs by id or key, node states by round) and does the rest.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil
import torch

from bhfl_core.algorithm.contract import ROOT_PLAN
from bhfl_core.algorithm.node_state import NodeState
from bhfl_core.config.schema import ExperimentConfig, RuntimeConfig
from bhfl_core.store.atomic import write_text_atomic
from bhfl_core.store.run_layout import DATA_POINTER, TIMELINE_DIR
from bhfl_core.store.transfer import Transfer
from flows import progress
from flows.evaluation import evaluate_all, evaluate_step
from flows.launch import Launch
from flows.lifecycle import finish_or_fail
from flows.node_runtime import NodeRuntime, node_runtime, worker_utilisation
from flows.records.disk_usage import run_folder_figures
from flows.records.environment import peak_rss_mb
from flows.records.run_record import LOGGED_FILES, RunRecord
from flows.records.warm_source import warm_start
from flows.run_tracking import log_committed_rounds, log_run_files, open_tracking, record_logged, worker_loss_metrics
from flows.services.stop_signals import as_stopped
from flows.tracking.prefect_summary import summary_markdown
from flows.tracking.timings import evaluation_cost
from flows.tracking.tracker import Tracker
from tasks.cluster_access import check_shared_folders
from tasks.context import RunContext, forget_run, mark_once, open_run, read_marks
from tasks.executor import cluster_workers, process_worker, worker_losses
from tasks.faults import FaultPlan
from tasks.local_cluster import ClusterStart, local_slots
from tasks.worker import WorkerRuntime

IMPORTED_AT = time.time()  # the heavy imports above are done: the timeline's "imports_done"
FAILED_RUN_WAIT_S = 10.0  # a failed run's last tracking calls (its status) get this long to reach a remote server


def run_attempt(cfg: ExperimentConfig, launch: Launch, path: Path, force_eval: bool = False) -> dict[str, Any]:
    """Run (or finish) the experiment in ``path``, whose record the job wrote; returns where its results are.

    ``force_eval``: evaluate a finished run again (``resume_experiment``): nothing is
    trained, the evaluation is logged at a step of its own.
    """
    attempt = _Attempt(cfg, launch, path, force_eval)
    with ExitStack() as stack:
        stack.enter_context(launch.orchestration.gate())  # its Prefect runs are created one at a time
        finish_or_fail(lambda: attempt.run(stack), attempt.end)
    return attempt.result()


class _Attempt:
    """What one attempt holds between its phases (the record, the tracker, the timings)."""

    def __init__(self, cfg: ExperimentConfig, launch: Launch, path: Path, force_eval: bool) -> None:
        self.started = time.time()
        self.cfg, self.launch, self.path, self.force_eval = cfg, launch, path, force_eval
        record = RunRecord.read(path)
        assert record is not None, f"{path} has no run record (the job writes it before invoking the flow)"
        shutil.rmtree(path / TIMELINE_DIR, ignore_errors=True)  # the timeline is the latest attempt's
        record.timeline = {
            "process_start": psutil.Process().create_time(),
            "imports_done": IMPORTED_AT,
            "flow_start": self.started,
        }
        record.write(path)
        self.record = record
        self.tracker: Tracker | None = None
        self.artefacts: Future[None] | None = None  # the parent run's files, logged beside the first round
        self.summary: dict[str, Any] = {}

    def run(self, stack: ExitStack) -> None:
        rt = self._set_up(stack)
        rounds = rt.ctx.tree.root.settings.rounds
        done = rt.ctx.store.load_header(rt.ctx.tree.root_id).rounds_done
        progress.run_started(rounds, done)
        if self.record.resumes and not self.force_eval:
            self._resume_notes(rt, done, rounds)
        peaks = {"memory/peak_rss_setup_mb": peak_rss_mb(reset=True)}
        train_started = time.time()
        if not self.force_eval:
            self.launch.orchestration.run_node(str(self.path), rt.ctx.tree.root_id, None, ROOT_PLAN, subflow=True)
        train_s = time.time() - train_started
        peaks["memory/peak_rss_train_mb"] = peak_rss_mb(reset=True)
        usage = worker_utilisation(rt, train_started, train_started + train_s)
        self._evaluate_and_report(rt, train_started, train_s, peaks, usage)

    def _set_up(self, stack: ExitStack) -> NodeRuntime:
        """Data, MLflow runs and workers (the workers boot while data and MLflow get ready); the initial model."""
        cfg, path = self.cfg, self.path
        starting = None
        if cfg.runtime.executor == "local" and self.launch.cluster is None:
            starting = ClusterStart(cfg.runtime)
            stack.callback(starting.close)
        FaultPlan.for_run(path).hit("prepare")  # (the run context, with its plan, needs the data)
        data_root = self.launch.orchestration.prepare(cfg, self.launch.data_cache).root
        write_text_atomic(path / DATA_POINTER, json.dumps({"data_root": str(data_root)}))  # read by runs, resume
        mark_once(path, "data_ready")
        ctx = open_run(path, cfg)
        stack.callback(forget_run, path)  # the context holds the run's data: not kept once the attempt ends
        ctx.transfer.clear()  # models in flight when an earlier attempt died are not reused
        stack.callback(ctx.transfer.release)
        self.tracker = tracker = open_tracking(cfg, ctx, path, self.record, self.force_eval)
        if LOGGED_FILES not in self.record.logged:  # (again, after a kill while they were logged: idempotent)
            # the parent run's files do not hold up the first round: logged beside it, awaited at the end
            logging_files = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="bhfl-artefacts"))
            self.artefacts = logging_files.submit(log_run_files, tracker, cfg, data_root, ctx.faults)
        mark_once(path, "tracking_ready")
        address = self.launch.cluster or (starting.address() if starting else cfg.runtime.cluster)
        workers = cluster_workers(address, cfg.runtime) if address else [process_worker(cfg.runtime).describe()]
        if cfg.runtime.executor == "cluster" and address:  # workers elsewhere: do they see our files?
            check_shared_folders(address, cfg.runtime, self.launch.run_root, path, data_root, workers)
        mark_once(path, "workers_ready")
        self.record.cluster, self.record.workers = address or "", workers
        self.record.write(path)
        if self.launch.sole:  # (a sweep sets it once for all its points: flows/sweep.py)
            torch.set_num_threads(orchestrator_threads(cfg.runtime if cfg.runtime.executor == "local" else None))
        rt = stack.enter_context(node_runtime(str(path), self.launch.orchestration))
        stack.callback(rt.executor.forget, str(path))  # workers serve other runs next: not kept there either
        _initial_model(rt, ctx)
        progress.note(f"{len(workers)} worker(s): " + ", ".join(f"{w['name']} ({w['device']})" for w in workers))
        return rt

    def _resume_notes(self, rt: NodeRuntime, done: int, rounds: int) -> None:
        """A resume: half-written checkpoints removed, rounds logged that a kill cut, an interrupted evaluation."""
        ctx = rt.ctx
        if removed := ctx.store.remove_partial_writes():
            progress.note(f"removed {removed} checkpoint write(s) that the interrupted run left unfinished")
        progress.note(
            f"resuming {self.path.name}: root round {done + 1 if done < rounds else rounds} of {rounds}; "
            "finished nodes and rounds are loaded from their checkpoints, not run again"
        )
        assert self.tracker is not None
        log_committed_rounds(ctx, self.tracker)
        if 0 < done < rounds and self.cfg.eval.every and done % self.cfg.eval.every == 0:
            evaluate_step(rt, done)  # the interrupted run may have died evaluating this step

    def _evaluate_and_report(
        self, rt: NodeRuntime, train_started: float, train_s: float, peaks: dict[str, float], usage: dict[str, float]
    ) -> None:
        """The final evaluation, the run-level figures (step 0), the report and the headlines where runs are seen."""
        tracker, record, rounds = self.tracker, self.record, rt.ctx.tree.root.settings.rounds
        assert tracker is not None
        # a forced re-evaluation of a finished run: a step of its own after the last root round
        eval_step = rounds + record.forced_evaluations + 1 if self.force_eval else rounds
        eval_started = time.time()
        rt.ctx.faults.hit("eval", "final")
        evaluation = evaluate_all(rt, step=eval_step, final=True)
        eval_s = time.time() - eval_started
        peaks["memory/peak_rss_eval_mb"] = peak_rss_mb(reset=False)
        timings = {
            "time/setup_s": train_started - self.started,
            "time/train_s": train_s,
            "time/final_eval_s": eval_s,
            "time/total_s": time.time() - self.started,
        }
        # step 0 on every path; a resume after this point keeps the values logged here
        timings.update(evaluation_cost(tracker, timings, rounds, train_started))
        # run-level figures at step 0 on every path; where a killed attempt logged them, they stay
        # (a forced re-evaluation logs only its time/eval_s, at its step)
        if not self.force_eval:
            figures = {**timings, **peaks, **usage, **worker_loss_metrics(tracker, self.path)}
            tracker.log_metrics(tracker.parent_id, figures, step=0)
        if record.resumes or self.force_eval:  # ... and the report shows those
            timings = {**timings, **tracker.values_at(tracker.parent_id, timings, step=0)}
        if self.artefacts is not None:
            self.artefacts.result()
            record_logged(self.path, LOGGED_FILES)
        from flows.tracking.report import write_report  # matplotlib and the report code: not needed at start-up

        headlines = write_report(tracker, rt.ctx, evaluation, timings, step=eval_step)  # report.md, tables, figures
        headline = headlines.own
        # the run folder as the run leaves it (report included; only run.json is rewritten after): one walk
        disk = run_folder_figures(self.path, len(rt.ctx.tree.clients()))
        if not self.force_eval:
            tracker.log_metrics(tracker.parent_id, disk, step=0)
        markdown = summary_markdown(
            self.cfg, self.path, record.tracking_uri, tracker.experiment_id, tracker.parent_id, headline
        )
        self.launch.orchestration.publish(self.cfg, markdown)  # the headlines and the MLflow link
        self.summary = {"headline": headline, "timings": timings, "memory": peaks, "utilisation": usage, "disk": disk}
        self.summary |= {"baseline": headlines.baseline, "baseline_name": headlines.baseline_name}  # its column
        tracker.finish("FINISHED")

    def end(self, error: BaseException | None) -> None:
        """The attempt's end into ``run.json`` (re-read: evaluations during training updated it); a failure's
        status into MLflow too (a finished run's is set as the last step of its work)."""
        current = RunRecord.read(self.path) or self.record
        forced = current.forced_evaluations + int(self.force_eval and error is None)
        error = as_stopped(error)  # a sweep's point failing as its sweep stops under it: that stop
        current = current.ended(error).model_copy(
            update={"forced_evaluations": forced, "worker_losses": worker_losses(self.path)}
        )
        current.timeline.update({**read_marks(self.path), "finished": time.time()})
        current.write(self.path)
        self.record = current
        tracker = self.tracker
        if error is not None and tracker is not None and tracker.parent_id:
            tracker.finish(current.mlflow_status)
            if isinstance(error, Exception):  # (not after Ctrl-C) a remote server: its status on its way
                tracker.close(wait=FAILED_RUN_WAIT_S)

    def result(self) -> dict[str, Any]:
        """Where the results are; a remote tracking server's calls still on their way are waited for first
        (what is left: `bhfl sync`)."""
        assert self.tracker is not None
        undelivered = self.tracker.close()
        return {
            "run_path": str(self.path),
            "tracking_uri": self.record.tracking_uri,
            "experiment_id": self.tracker.experiment_id,
            "run_id": self.tracker.parent_id,
            **self.summary,
            "timeline": self.record.timeline,
            "resumes": self.record.resumes,
            "tracking_undelivered": undelivered.message() if undelivered else "",
        }


def _initial_model(rt: NodeRuntime, ctx: RunContext) -> None:
    """The root's first model: a warm start's, else built on a worker (a resume finds it saved: nothing is done)."""
    cfg = ctx.config
    if ctx.store.has(ctx.tree.root_id):
        return
    if cfg.model.init_from:
        copied = warm_start(ctx)
        what = f"{len(copied)} node model(s) copied" if copied else "its model is the frozen backbone"
        progress.note(f"warm start from {cfg.model.init_from}: {what}")
    if not ctx.store.has(ctx.tree.root_id):  # no warm start, or a backbone only (fresh adapters)
        initial = rt.executor.submit(rt.executor.slots()[0], WorkerRuntime.initial_model, str(rt.ctx.run_path)).result()
        ctx.store.save(ctx.tree.root_id, NodeState(model=Transfer.get(initial)))
        ctx.transfer.done_with(initial)


def orchestrator_threads(local: RuntimeConfig | None) -> int:
    """Torch threads for this process's own math (aggregation): what its local CPU workers leave over.

    ``local``: the runtime of the local cluster this process's jobs use (None: none; a
    cluster elsewhere, or ``runtime.executor: inprocess``, whose worker code sets the run's
    training threads for each call and restores them after). Set once per process: by a
    run, or by a sweep for all its points (``Launch.sole``), never by one point of many.
    """
    cores = os.cpu_count() or 1
    cpu_workers = sum(device == "cpu" for _, device in local_slots(local)) if local is not None else 0
    return max(1, cores - cpu_workers)
