"""The experiment as a Prefect flow: prepare data -> train the tree -> evaluate -> report.

Flow shape (what the Prefect UI shows)::

    bhfl-experiment                      (one per experiment run)
      prepare-data                       (subflow, flows/data.py: a task per step; cached on disk by fingerprint)
      node: root                         (subflow tree, flows/training.py)
      evaluate-models x workers          (task per worker, each scores a list of node models; flows/evaluation.py)

Where the work runs: this process runs the flows, the server rounds and MLflow
logging; client training, proxy training and evaluation run on the run's executor
(tasks/executor.py: a Dask cluster of worker processes, local or remote, or this
process). ``run_experiment(..., orchestration=PLAIN_CALLS)`` runs the very same code
without Prefect. The run folder (``run.json``, ``config.yaml``, ``data.json``,
``state/``) is what every node execution rebuilds its runtime from.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil
import torch
import yaml
from prefect import flow, tags
from prefect.settings import temporary_settings

from bhfl_core.algorithm.contract import ROOT_PLAN
from bhfl_core.algorithm.node_state import NodeState
from bhfl_core.config.schema import ExperimentConfig, dump
from bhfl_core.config.sweep import config_hash
from bhfl_core.store.atomic import write_text_atomic
from bhfl_core.store.run_layout import CONFIG_FILE, DATA_POINTER, TIMELINE_DIR
from bhfl_core.store.transfer import Transfer
from flows import progress
from flows.creation_gate import creation_gate
from flows.evaluation import evaluate_all, evaluate_step
from flows.node_runtime import NodeRuntime, Orchestration, node_runtime, worker_utilisation
from flows.records.environment import cpu_capability, environment_text, git_commit, package_version, peak_rss_mb
from flows.records.run_record import LOGGED_FILES, PipelineLink, RunRecord, default_tracking_uri, new_run_path
from flows.records.run_state import RunStateError, load_run, resume_config
from flows.records.warm_source import resolve_init_from, warm_start
from flows.tracking.prefect_summary import prefect_tags, publish_summary, summary_markdown
from flows.tracking.timings import evaluation_cost
from flows.tracking.tracker import Tracker
from flows.training import PLAIN_CALLS, PREFECT_RUNS, thread_task_runner
from tasks import faults
from tasks.context import RunContext, mark_once, open_run, read_marks
from tasks.executor import cluster_workers, process_worker, worker_losses
from tasks.local_cluster import ClusterStart

IMPORTED_AT = time.time()  # the heavy imports above are done: the timeline's "imports_done"
FAILED_RUN_WAIT_S = 10.0  # a failed run's last tracking calls (its status) get this long to reach a remote server
__all__ = ["PLAIN_CALLS", "PREFECT_RUNS", "experiment_flow", "resume_experiment", "run_experiment"]


def _run_tags(
    config: ExperimentConfig, run_path: Path, data_fingerprint: str, link: PipelineLink | None
) -> dict[str, str]:
    stage = {"bhfl.pipeline_stage": link.stage, "bhfl.pipeline_path": link.path} if link else {}
    warm = {"bhfl.init_from": config.model.init_from} if config.model.init_from else {}
    return {
        **stage,
        **warm,
        "bhfl.run_path": str(run_path),
        "bhfl.config_hash": config_hash(config),
        "bhfl.data_fingerprint": data_fingerprint,
        "bhfl.seed": str(config.seed),
        "bhfl.git_commit": git_commit(),
        "bhfl.python": platform.python_version(),
        "bhfl.cpu_capability": cpu_capability(),
        **{
            f"bhfl.version.{p}": package_version(p)
            for p in ("bhfl", "torch", "transformers", "datasets", "prefect", "mlflow")
        },
    }


def parent_run_name(config: ExperimentConfig) -> str:
    """The MLflow parent run's name: the config's name, seed and hash, so runs of different settings differ.

    (``bhfl.config_hash`` has the full hash; a sweep renames its points' runs to their labels.)
    """
    return f"{config.name} seed={config.seed} {config_hash(config)[:8]}"


def _describe(config: ExperimentConfig, ctx: RunContext) -> str:
    tree = ctx.tree
    return (
        f"B-HFL experiment `{config.name}`: {len(tree.clients())} clients, "
        f"{len(tree.servers())} servers, {tree.root.settings.rounds} root rounds, seed {config.seed}."
    )


@flow(name="bhfl-experiment", validate_parameters=False)
def experiment_flow(
    config: ExperimentConfig | dict[str, Any],
    run_root: str,
    tracking_uri: str,
    run_path: str | None = None,
    resume: bool = False,
    cluster: str | None = None,
    link: PipelineLink | dict[str, str] | None = None,
    force_eval: bool = False,
) -> dict[str, Any]:
    """Run one experiment end to end (or finish an interrupted one); returns where its results are.

    ``run_path`` None (e.g. a scheduled deployment run) makes a new run folder under
    ``run_root``. ``resume`` continues the run in ``run_path`` from its checkpoints.
    ``cluster``: the address of a local cluster already started for this run (the CLI
    starts it while Prefect starts); None starts one here when ``runtime.executor`` is
    ``local``. ``config`` is validated here only when it comes as plain data (a
    deployment run); ``bhfl run`` passes the config it validated. ``link``: the pipeline
    this run is a stage of (flows/pipeline.py; its MLflow parent run nests under the pipeline's).
    ``force_eval``: evaluate a finished run again (``resume_experiment``).
    """
    cfg = config if isinstance(config, ExperimentConfig) else ExperimentConfig.model_validate(config)
    stage = link if link is None or isinstance(link, PipelineLink) else PipelineLink.model_validate(link)
    return _experiment(
        cfg, run_root, tracking_uri, run_path, PREFECT_RUNS, resume, cluster, stage, force_eval=force_eval
    )


def _workers(cfg: ExperimentConfig, address: str | None) -> list[dict[str, str]]:
    """The workers this run places work on: the cluster's, or this process."""
    return cluster_workers(address, cfg.runtime) if address else [process_worker(cfg.runtime).describe()]


def _experiment(
    cfg: ExperimentConfig,
    run_root: str,
    tracking_uri: str,
    run_path: str | None,
    orchestration: Orchestration,
    resume: bool = False,
    cluster: str | None = None,
    link: PipelineLink | None = None,
    force_eval: bool = False,
) -> dict[str, Any]:
    started = time.time()
    root = Path(run_root).resolve()
    if not resume:  # a warm start's source is found and checked before anything is written
        cfg = resolve_init_from(cfg, root)
    path = Path(run_path).resolve() if run_path else new_run_path(root, cfg.name)
    path.mkdir(parents=True, exist_ok=True)
    record = RunRecord.read(path) if resume else None
    if record is None:
        record = RunRecord(name=cfg.name, tracking_uri=tracking_uri, pipeline=link)
        write_text_atomic(path / CONFIG_FILE, yaml.safe_dump(dump(cfg), sort_keys=False))
    else:
        resumes = record.resumes + int(not force_eval)  # a forced re-evaluation is no resume
        record = record.model_copy(update={"status": "running", "pid": os.getpid(), "error": "", "resumes": resumes})
    shutil.rmtree(path / TIMELINE_DIR, ignore_errors=True)  # the timeline is the latest attempt's
    record.timeline = {
        "process_start": psutil.Process().create_time(),
        "imports_done": IMPORTED_AT,
        "flow_start": started,
    }
    record.write(path)

    tracker: Tracker | None = None
    rt: NodeRuntime | None = None
    with ExitStack() as stack:
        if orchestration is PREFECT_RUNS:  # its Prefect runs are created one at a time (flows/creation_gate.py)
            stack.enter_context(creation_gate())
        starting = None
        artefacts: Future[None] | None = None  # the parent run's files, logged beside the first round
        if cfg.runtime.executor == "local" and cluster is None:  # workers boot while data and MLflow get ready
            starting = ClusterStart(cfg.runtime, path)
            stack.callback(starting.close)
        try:
            faults.hit("prepare")
            data_root = orchestration.prepare(cfg, root / "cache").root
            (path / DATA_POINTER).write_text(json.dumps({"data_root": str(data_root)}))
            mark_once(path, "data_ready")
            ctx = open_run(path, cfg)
            ctx.transfer.clear()  # models in flight when an earlier attempt died are not reused
            stack.callback(ctx.transfer.release)
            tracker = _open_tracking(cfg, ctx, path, record, force_eval)
            if LOGGED_FILES not in record.logged:  # (again, after a kill while they were logged: idempotent)
                # the parent run's files do not hold up the first round: logged beside it, awaited at the end
                logging_files = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="bhfl-artefacts"))
                artefacts = logging_files.submit(_log_run_files, tracker, cfg, data_root)
            mark_once(path, "tracking_ready")
            address = cluster or (starting.address() if starting else cfg.runtime.cluster)
            workers = _workers(cfg, address)
            mark_once(path, "workers_ready")
            record.cluster, record.workers = address or "", workers
            record.write(path)
            torch.set_num_threads(_orchestrator_threads(cfg, workers))
            rt = stack.enter_context(node_runtime(str(path), orchestration))
            if not ctx.store.has(ctx.tree.root_id):  # a resume finds the root saved: nothing is copied again
                if cfg.model.init_from:
                    copied = warm_start(ctx)
                    what = f"{len(copied)} node model(s) copied" if copied else "its model is the frozen backbone"
                    progress.note(f"warm start from {cfg.model.init_from}: {what}")
                if not ctx.store.has(ctx.tree.root_id):  # no warm start, or a backbone only (fresh adapters)
                    initial = rt.executor.submit(rt.executor.slots()[0], "initial_model", str(path)).result()
                    ctx.store.save(ctx.tree.root_id, NodeState(model=Transfer.get(initial)))
                    ctx.transfer.done_with(initial)
            rounds = ctx.tree.root.settings.rounds
            done = ctx.store.load_header(ctx.tree.root_id).rounds_done
            # a forced re-evaluation of a finished run: a step of its own after the last root round
            eval_step = rounds + record.forced_evaluations + 1 if force_eval else rounds
            progress.note(f"{len(workers)} worker(s): " + ", ".join(f"{w['name']} ({w['device']})" for w in workers))
            progress.run_started(rounds, done)
            if record.resumes and not force_eval:
                if removed := ctx.store.remove_partial_writes():
                    progress.note(f"removed {removed} checkpoint write(s) that the interrupted run left unfinished")
                progress.note(
                    f"resuming {path.name}: root round {done + 1 if done < rounds else rounds} of {rounds}; "
                    "finished nodes and rounds are loaded from their checkpoints, not run again"
                )
                _log_committed_rounds(ctx, tracker)
                if 0 < done < rounds and cfg.eval.every and done % cfg.eval.every == 0:
                    evaluate_step(rt, done)  # the interrupted run may have died evaluating this step
            peaks = {"memory/peak_rss_setup_mb": peak_rss_mb(reset=True)}
            train_started = time.time()
            if not force_eval:
                orchestration.run_node(str(path), ctx.tree.root_id, None, ROOT_PLAN, subflow=True)
            train_s = time.time() - train_started
            peaks["memory/peak_rss_train_mb"] = peak_rss_mb(reset=True)
            usage = worker_utilisation(rt, train_started, train_started + train_s)
            eval_started = time.time()
            faults.hit("eval", "final")
            evaluation = evaluate_all(rt, step=eval_step, final=True)
            eval_s = time.time() - eval_started
            peaks["memory/peak_rss_eval_mb"] = peak_rss_mb(reset=False)
            timings = {
                "time/setup_s": train_started - started,
                "time/train_s": train_s,
                "time/final_eval_s": eval_s,
                "time/total_s": time.time() - started,
            }
            # step 0 on every path; a resume after this point keeps the values logged here
            timings.update(evaluation_cost(tracker, timings, rounds, train_started))
            # run-level figures at step 0 on every path; where a killed attempt logged them, they stay
            # (a forced re-evaluation logs only its time/eval_s, at its step)
            if not force_eval:
                tracker.log_metrics(tracker.parent_id, {**timings, **peaks, **usage, **_losses(tracker, path)}, step=0)
            if record.resumes or force_eval:  # ... and the report shows those
                timings = {**timings, **tracker.values_at(tracker.parent_id, timings, step=0)}
            if artefacts is not None:
                artefacts.result()
                _record_logged(path, LOGGED_FILES)
            from flows.tracking.report import write_report  # matplotlib and the report code: not needed at start-up

            headline = write_report(tracker, ctx, evaluation, timings, step=eval_step)  # report.md, tables, figures
            if orchestration is PREFECT_RUNS:  # the headlines and the MLflow link on the flow run's page
                summary = summary_markdown(
                    cfg, path, record.tracking_uri, tracker.experiment_id, tracker.parent_id, headline
                )
                publish_summary(cfg, summary)
            tracker.finish("FINISHED")
            record = _finish_record(path, record, "finished", forced_evaluation=force_eval)
        except BaseException as exc:
            record = _finish_record(path, record, "failed", f"{type(exc).__name__}: {exc}"[:2000])
            if tracker is not None and tracker.parent_id:
                tracker.finish("FAILED")
                if isinstance(exc, Exception):  # (not after Ctrl-C) a remote server: its status on its way
                    tracker.close(wait=FAILED_RUN_WAIT_S)
            raise
    # a remote tracking server: the calls still on their way, waited for (what is left: `bhfl sync`)
    undelivered = tracker.close()
    return {
        "run_path": str(path),
        "tracking_uri": record.tracking_uri,
        "experiment_id": tracker.experiment_id,
        "run_id": tracker.parent_id,
        "headline": headline,
        "timings": timings,
        "memory": peaks,
        "utilisation": usage,
        "timeline": record.timeline,
        "resumes": record.resumes,
        "wall_time_s": time.time() - started,
        "tracking_undelivered": undelivered.message() if undelivered else "",
    }


def _open_tracking(
    cfg: ExperimentConfig, ctx: RunContext, path: Path, record: RunRecord, force_eval: bool = False
) -> Tracker:
    """The run's MLflow runs: reopened (a resume), else created, or adopted where a killed attempt created them.

    The record holds the runs' key (``run_key``) before they are created and their ids
    right after, so a kill between the two leaves runs a resume finds by that key.
    """
    tracker = Tracker(record.tracking_uri, resumed=record.resumes > 0 or force_eval, run_path=path)
    if record.parent_run_id:
        tracker.reopen(record.experiment_id, record.parent_run_id, record.node_runs, record.resumes)
        return tracker
    nest = record.pipeline
    tracker.start(
        cfg.name,
        dump(cfg),
        ctx.tree,
        _run_tags(cfg, path, ctx.manifest.fingerprint, nest),
        _describe(cfg, ctx),
        run_key=record.run_key,
        run_name=parent_run_name(cfg),
        experiment=nest.experiment if nest else None,
        parent_run_id=nest.run_id if nest else None,
    )
    faults.hit("tracking")  # created, not yet recorded: the resume must adopt these runs
    if record.resumes:
        tracker.tag_resume(record.resumes)
    record.experiment_id, record.parent_run_id, record.node_runs = (
        tracker.experiment_id,
        tracker.parent_id,
        tracker.node_runs,
    )
    record.write(path)
    return tracker


def _log_committed_rounds(ctx: RunContext, tracker: Tracker) -> None:
    """Log each server's last committed round from its saved state, where a kill came between commit and log.

    A round's metrics are logged right after its state is committed; a kill in between
    would lose that point. The state holds the round's metrics, so a resume logs them at
    the round's step (a no-op where they are in the store: resumed trackers skip those).
    """
    for node in ctx.tree.servers():
        state = ctx.store.load_header(node.id)
        if state.rounds_done and state.metrics:
            tracker.log_node(node.id, state.metrics, step=state.rounds_done)


def _record_logged(path: Path, phase: str) -> None:
    """Note in ``run.json`` that an MLflow logging phase finished (re-read: evaluations updated it)."""
    current = RunRecord.read(path)
    if current is not None and phase not in current.logged:
        current.logged.append(phase)
        current.write(path)


def _log_run_files(tracker: Tracker, cfg: ExperimentConfig, data_root: Path) -> None:
    """The parent run's files: the resolved config, the data manifest and report, the package list."""
    tracker.log_text(yaml.safe_dump(dump(cfg), sort_keys=False), "config.yaml")
    tracker.log_data_report(data_root)
    faults.hit("artefacts")
    tracker.log_text(environment_text(), "environment/packages.txt")


def _losses(tracker: Tracker, path: Path) -> dict[str, float]:
    """Calls that ran again because their worker was lost (tasks/executor.py): a tag and a count, where any were."""
    losses = worker_losses(path)
    if not losses:
        return {}
    text = "; ".join(f"{x['worker']} lost during {x['call']}, which ran again" for x in losses)
    tracker.set_tags({"bhfl.worker_losses": text[:5000]})  # (MLflow's limit on a tag value is larger)
    return {"runtime/worker_losses": float(len(losses))}


def _finish_record(
    path: Path, record: RunRecord, status: str, error: str = "", forced_evaluation: bool = False
) -> RunRecord:
    """Write the attempt's end into ``run.json`` (re-read: evaluations during training updated it)."""
    current = RunRecord.read(path) or record
    forced = current.forced_evaluations + int(forced_evaluation)
    current = current.model_copy(
        update={"status": status, "error": error, "forced_evaluations": forced, "worker_losses": worker_losses(path)}
    )
    current.timeline.update({**read_marks(path), "finished": time.time()})
    current.write(path)
    return current


def _orchestrator_threads(cfg: ExperimentConfig, workers: list[dict[str, str]]) -> int:
    """Torch threads for this process's own math (aggregation): what the local CPU workers leave over.

    (When it trains itself, ``runtime.executor: inprocess``, the worker code sets the run's
    training threads for each call.)
    """
    cores = os.cpu_count() or 1
    cpu_workers = sum(1 for w in workers if w["device"] == "cpu") if cfg.runtime.executor == "local" else 0
    return max(1, cores - cpu_workers)


def _invoke(
    config: ExperimentConfig,
    run_root: Path,
    uri: str,
    path: str,
    orchestration: Orchestration,
    resume: bool,
    cluster: str | None,
    link: PipelineLink | None = None,
    flow_run_name: str | None = None,
    force_eval: bool = False,
) -> dict[str, Any]:
    if orchestration is not PREFECT_RUNS:
        return _experiment(config, str(run_root), uri, path, orchestration, resume, cluster, link, force_eval)
    # Flow heartbeats only detect crashed deployment runs; off, each subflow ends ~1 s sooner.
    with temporary_settings(updates={"flows.heartbeat_frequency": None}), tags(*prefect_tags(config)):
        name = flow_run_name or f"{config.name} {time.strftime('%Y-%m-%d %H:%M')}"
        action = "re-evaluate " if force_eval else "resume " if resume else ""
        flow_ = experiment_flow.with_options(flow_run_name=action + name, task_runner=thread_task_runner())
        return flow_(config, str(run_root), uri, path, resume, cluster, link, force_eval)


def run_experiment(
    config: ExperimentConfig,
    run_root: Path,
    tracking_uri: str | None = None,
    orchestration: Orchestration = PREFECT_RUNS,
    run_path: Path | None = None,
    cluster: str | None = None,
    link: PipelineLink | None = None,
    flow_run_name: str | None = None,
) -> dict[str, Any]:
    """Run the experiment flow in this process (Prefect's local server unless PREFECT_API_URL is set).

    ``orchestration=PLAIN_CALLS`` runs the same code with no Prefect at all (tests; benchmarks: orchestration share).
    ``run_path`` (default: a new ``<run_root>/<name>/<timestamp>``) is the run folder.
    ``cluster``: a local cluster already started for this run (``runtime.executor: local``).
    ``link``: the pipeline this run is a stage of; ``flow_run_name``: the Prefect flow run's name
    (default: the run folder's timestamp). A ``model.init_from`` source is checked (ConfigError)
    before anything is written or started. Progress goes to the ``bhfl.progress`` logger (flows/progress.py).
    """
    run_root = run_root.resolve()
    config = resolve_init_from(config, run_root)
    run_root.mkdir(parents=True, exist_ok=True)
    uri = tracking_uri or default_tracking_uri(run_root)
    path = run_path or new_run_path(run_root, config.name)
    return _invoke(
        config,
        run_root,
        uri,
        str(path),
        orchestration,
        resume=False,
        cluster=cluster,
        link=link,
        flow_run_name=flow_run_name,
    )


def resume_experiment(
    run_path: Path,
    orchestration: Orchestration = PREFECT_RUNS,
    overrides: Sequence[str] = (),
    cluster: str | None = None,
    flow_run_name: str | None = None,
    force_eval: bool = False,
) -> dict[str, Any]:
    """Continue the run in ``run_path`` after a failure: same config, checkpoints, MLflow runs.

    Finished node executions and rounds are loaded from the state store, not redone;
    every random draw depends only on (seed, node, round), so the result is
    bit-identical to a run that never stopped. ``overrides`` may change only keys that
    do not change results (``runtime.*``, ``eval.batch_size``), e.g. fewer workers after
    running out of GPU memory.

    ``force_eval``: evaluate a finished run again (after a fix to the evaluation code, say),
    logged as a new step (root rounds + n for the n-th), never over the points it has;
    the report files are rewritten from it. Nothing is trained.
    """
    run_path = run_path.resolve()
    config, record = load_run(run_path)
    if record.effective_status == "running":
        raise RunStateError(f"run {run_path} is still running (process {record.pid}); wait for it or stop it first")
    if force_eval and record.status != "finished":
        raise RunStateError(f"run {run_path} is not finished: `bhfl resume` finishes it, evaluation included")
    config = resume_config(run_path, config, overrides)
    # run_root: the folder holding the shared data cache (<run_root>/<name>/<stamp>)
    return _invoke(
        config,
        run_path.parents[1],
        record.tracking_uri,
        str(run_path),
        orchestration,
        resume=True,
        cluster=cluster,
        flow_run_name=flow_run_name,
        force_eval=force_eval,
    )
