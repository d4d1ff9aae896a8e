"""The experiment as Prefect flows: prepare data -> train the tree -> evaluate -> report.

Flow shape (what the Prefect UI shows)::

    bhfl-experiment                      (one per experiment run)
      prepare-data                       (subflow, flows/data.py: a task per step; cached on disk by fingerprint)
      node: root                         (subflow: one execution of the root = T_root rounds)
        node: <server>                   (subflow per execution of each internal node)
          node: edge-<lang>
            train-clients x workers      (task per worker, each trains a list of clients)
          proxy-train                    (task, where the server has proxy data)
      evaluate-models x workers          (task per worker, each scores a list of node models)

Tasks and subflows receive the run folder, node ids and message paths only; tensors
stay in the process and on disk (bhfl_core.state_store).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from prefect import Task, flow
from prefect.settings import temporary_settings
from prefect.task_runners import ThreadPoolTaskRunner

from bhfl_core.config import ConfigError, ExperimentConfig, dump
from bhfl_core.config_loader import config_from_dict
from bhfl_core.engine import ChildrenReport, RoundKey, execute_node
from bhfl_core.evaluation import Evaluation
from bhfl_core.files import write_text_atomic
from bhfl_core.metrics import task_metrics
from bhfl_core.params import get_flat
from bhfl_core.placement import split_by_load
from bhfl_core.residuals import Candidate, needs
from bhfl_core.state_store import NodeState, StateStore
from bhfl_core.tree import Node
from flows.data import run_prepare
from flows.progress import Reporter, SilentReporter
from flows.run_record import RunRecord
from flows.report import log_evaluation, write_report
from flows.tracking import Tracker, default_tracking_uri
from tasks import faults
from tasks.context import (CONFIG_FILE, DATA_POINTER, RunContext, forget_context, get_context, resolve_devices,
                           resolve_workers)
from tasks.evaluation import baseline_models, evaluate_models, node_models
from tasks.training import WorkerReport, proxy_train, train_clients


@dataclass
class FlowRuntime:
    """Process-local objects of a running experiment that cannot travel as flow parameters."""

    ctx: RunContext
    tracker: Tracker
    reporter: Reporter
    record: RunRecord


_RUNTIMES: dict[str, FlowRuntime] = {}
_REPORTER: Reporter = SilentReporter()


def _runtime(run_path: str) -> FlowRuntime:
    return _RUNTIMES[str(Path(run_path).resolve())]


class FlowHooks:
    """EngineHooks for servers: children as subflows (servers) or worker tasks (clients).

    ``inline=True`` runs the very same node and worker code without Prefect (plain
    recursion, workers one after another); benchmarks use it to measure what the
    orchestration costs.
    """

    def __init__(self, rt: FlowRuntime, inline: bool = False) -> None:
        self.rt = rt
        self.inline = inline
        self.run_path = str(rt.ctx.run_path)

    def _run_child(self, child: Node, phi_path: str, caller: str) -> str:
        if self.inline:
            return _execute(self.run_path, child.id, phi_path, caller, inline=True)
        child_flow = node_flow.with_options(
            flow_run_name=f"{child.id} <- {caller}", task_runner=ThreadPoolTaskRunner(max_workers=self.rt.ctx.workers)
        )
        return child_flow(self.run_path, child.id, phi_path, caller)

    def _run_workers(self, node: Node, plan: list[list[str]], phi_path: str, caller: str) -> list[WorkerReport]:
        keep, select = needs(node.settings.res_up)
        if self.inline:
            return [train_clients.fn(self.run_path, caller, ids, phi_path, keep, select) for ids in plan]
        task_ = with_retries(train_clients, self.rt.ctx.config)
        futures = [task_.submit(self.run_path, caller, ids, phi_path, keep, select) for ids in plan]
        return [f.result() for f in futures]  # plan order, so the float sums are deterministic

    def run_children(self, node: Node, cohort: list[Node], theta: torch.Tensor, key: RoundKey) -> ChildrenReport:
        ctx = self.rt.ctx
        phi_path = ctx.store.write_message(f"{node.id}.down", theta)
        caller = f"{node.id}:{key.round}"
        report = ChildrenReport()
        losses: dict[str, tuple[float, int]] = {}  # child -> (training loss of its last round, examples)
        for child in (c for c in cohort if not c.is_leaf):
            theta_child = StateStore.read_message(self._run_child(child, phi_path, caller))
            report.aggregate.add(theta_child, child.weight)
            if node.settings.res_up:
                report.candidates.append(Candidate(child.id, theta_child, child.weight))
            last = ctx.store.load_info(child.id).get("metrics", {})  # the child's last round, saved with it
            if last.get("train/examples"):
                losses[child.id] = (last["train/loss"], int(last["train/examples"]))
        leaves = [c for c in cohort if c.is_leaf]
        if leaves:
            plan = split_by_load([c.id for c in leaves], [c.weight for c in leaves], ctx.workers)
            for worker in self._run_workers(node, plan, phi_path, caller):
                report.aggregate.merge(worker.aggregate)
                report.candidates.extend(worker.candidates)
                report.dropped.extend(worker.dropped)
                losses.update(worker.losses)
            for client_id in report.dropped:
                self.rt.reporter.note(f"client {client_id} failed and was dropped from {node.id} round {key.round + 1}")
            report.metrics["train/clients"] = float(len(leaves))
        if losses:  # servers above the edges: their children's last-round client loss, example-weighted
            seen = sum(n for _, n in losses.values())
            report.metrics["train/loss"] = sum(loss * n for loss, n in losses.values()) / max(seen, 1)
            report.metrics["train/examples"] = float(seen)
        return report

    def train(self, node: Node, theta: torch.Tensor, key: RoundKey) -> tuple[torch.Tensor, dict[str, float]]:
        fn = proxy_train.fn if self.inline else with_retries(proxy_train, self.rt.ctx.config)
        return fn(self.run_path, node.id, key, theta)

    def round_done(self, node: Node, key: RoundKey, theta: torch.Tensor, metrics: dict[str, float]) -> None:
        self.rt.tracker.log_node(node.id, metrics, step=key.round + 1)
        self.rt.reporter.node_round(node.id, node.depth, key.round, metrics)
        every = self.rt.ctx.config.eval.every
        is_last = key.round + 1 >= node.settings.rounds
        if node.parent is None and every and (key.round + 1) % every == 0 and not is_last:
            _evaluate_step(self.rt, key.round + 1, self.inline)
        if not node.is_leaf:
            faults.hit("round", f"{node.id} round {key.round + 1}")


def with_retries(task_: Task, config: ExperimentConfig) -> Task:
    """The task with the run's Prefect retries (``runtime.retries``, ``runtime.retry_delay_s``)."""
    return task_.with_options(retries=config.runtime.retries, retry_delay_seconds=config.runtime.retry_delay_s)


def _execute(run_path: str, node_id: str, phi_path: str | None, caller: str, inline: bool = False) -> str:
    """EXECUTENODE for one internal node, from and to message files; returns the path of theta_T."""
    rt = _runtime(run_path)
    ctx = rt.ctx
    phi = StateStore.read_message(phi_path) if phi_path else None
    result = execute_node(ctx.tree, ctx.tree[node_id], phi, ctx.store, FlowHooks(rt, inline), ctx.config.seed, caller)
    return ctx.store.write_message(f"{node_id}.up", result.theta)


@flow(name="node", validate_parameters=False)
def node_flow(run_path: str, node_id: str, phi_path: str | None, caller: str) -> str:
    """One execution of an internal node as a Prefect subflow."""
    return _execute(run_path, node_id, phi_path, caller)


def evaluate_all(rt: FlowRuntime, step: int, inline: bool = False, final: bool = False) -> Evaluation:
    """Score every node model (and, when ``final``, the configured per-client baselines) on every test set.

    Node models first, then the baselines (local-only, local adaptation; they train
    first), each phase split over the workers; both phases' wall times go to MLflow.
    """
    ctx = rt.ctx
    stats: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    nodes = node_models(ctx)
    phases = [("time/eval_s", nodes, [1.0] * len(nodes))]
    if final:
        phases.append(("time/baselines_s", *baseline_models(ctx)))
    for timer, names, loads in phases:
        if not names:
            continue
        started = time.time()
        plan = split_by_load(names, loads, ctx.workers)
        if inline:
            for ids in plan:
                stats.update(evaluate_models.fn(str(ctx.run_path), ids))
        else:
            task_ = with_retries(evaluate_models, ctx.config)
            for future in [task_.submit(str(ctx.run_path), ids) for ids in plan]:
                stats.update(future.result())
        seconds[timer] = time.time() - started
    evaluation = Evaluation.from_stats(ctx.tree, task_metrics(ctx.manifest.task), stats)
    log_evaluation(rt.tracker, evaluation, step, seconds)
    rt.reporter.note(f"evaluated {len(stats)} models after root round {step}")
    return evaluation


def _run_tags(config: ExperimentConfig, run_path: Path, data_root: Path) -> dict[str, str]:
    resolved = json.dumps(dump(config), sort_keys=True)
    return {
        "bhfl.run_path": str(run_path),
        "bhfl.config_hash": hashlib.sha256(resolved.encode()).hexdigest()[:16],
        "bhfl.data_fingerprint": data_root.name,
        "bhfl.seed": str(config.seed),
        "bhfl.git_commit": git_commit(),
        "bhfl.python": platform.python_version(),
        **{f"bhfl.version.{p}": _version(p) for p in ("bhfl", "torch", "transformers", "datasets", "prefect", "mlflow")},
    }


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def git_commit() -> str:
    """The project's git commit (``+dirty`` with uncommitted changes); ``unknown`` outside a checkout."""
    repo = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        if commit.returncode:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _describe(config: ExperimentConfig, ctx: RunContext) -> str:
    tree = ctx.tree
    return (f"B-HFL experiment `{config.name}`: {len(tree.clients())} clients, "
            f"{len(tree.servers())} servers, {tree.root.settings.rounds} root rounds, seed {config.seed}.")


@flow(name="bhfl-experiment", validate_parameters=False)
def experiment_flow(
    config: dict[str, Any], run_root: str, tracking_uri: str, run_path: str | None = None, resume: bool = False
) -> dict[str, Any]:
    """Run one experiment end to end (or finish an interrupted one); returns where its results are.

    ``run_path`` None (e.g. a scheduled deployment run) makes a new run folder under
    ``run_root``. ``resume`` continues the run in ``run_path`` from its checkpoints.
    """
    return _experiment(config, run_root, tracking_uri, run_path, inline=False, resume=resume)


def _experiment(
    config: dict[str, Any], run_root: str, tracking_uri: str, run_path: str | None, inline: bool, resume: bool = False
) -> dict[str, Any]:
    started = time.time()
    cfg = ExperimentConfig.model_validate(config)
    root = Path(run_root).resolve()
    path = Path(run_path).resolve() if run_path else new_run_path(root, cfg.name)
    path.mkdir(parents=True, exist_ok=True)
    record = RunRecord.read(path) if resume else None
    if record is None:
        record = RunRecord(name=cfg.name, tracking_uri=tracking_uri)
        write_text_atomic(path / CONFIG_FILE, yaml.safe_dump(dump(cfg), sort_keys=False))
    else:
        record = record.model_copy(update={"status": "running", "pid": os.getpid(), "error": "",
                                           "resumes": record.resumes + 1})
    record.write(path)

    tracker: Tracker | None = None
    rt: FlowRuntime | None = None
    try:
        faults.hit("prepare")
        data_root = run_prepare(cfg, root / "cache", note=_REPORTER.note, inline=inline).root
        (path / DATA_POINTER).write_text(json.dumps({"data_root": str(data_root)}))
        forget_context(path)  # a resumed run in the same process must see the files as they are now
        ctx = get_context(path)
        torch.set_num_threads(cfg.runtime.torch_threads or os.cpu_count() or 1)

        tracker = Tracker(record.tracking_uri)
        if record.parent_run_id:
            tracker.reopen(record.experiment_id, record.parent_run_id, record.node_runs, record.resumes)
        else:
            tracker.start(cfg.name, dump(cfg), ctx.tree, _run_tags(cfg, path, data_root), _describe(cfg, ctx))
            record.experiment_id, record.parent_run_id, record.node_runs = tracker.experiment_id, tracker.parent_id, tracker.node_runs
            record.write(path)
            tracker.log_text(yaml.safe_dump(dump(cfg), sort_keys=False), "config.yaml")
            tracker.log_data_report(data_root)
            tracker.log_text(environment_text(), "environment/packages.txt")
        rt = FlowRuntime(ctx, tracker, _REPORTER, record)
        _RUNTIMES[str(path)] = rt
        if not ctx.store.has(ctx.tree.root_id):
            init = get_flat(ctx.build_model(cfg.seed + cfg.model.init_seed_offset))
            ctx.store.save(ctx.tree.root_id, NodeState(model=init))
        rounds = ctx.tree.root.settings.rounds
        done = ctx.store.load_info(ctx.tree.root_id).get("rounds_done", 0)
        rt.reporter.start(rounds, done)
        if record.resumes:
            if removed := ctx.store.remove_partial_writes():
                rt.reporter.note(f"removed {removed} checkpoint write(s) that the interrupted run left unfinished")
            rt.reporter.note(f"resuming {path.name}: root round {done + 1 if done < rounds else rounds} of {rounds}; "
                             "finished nodes and rounds are loaded from their checkpoints, not run again")
            if 0 < done < rounds and cfg.eval.every and done % cfg.eval.every == 0:
                _evaluate_step(rt, done, inline)  # the interrupted run may have died evaluating this step
        peaks = {"memory/peak_rss_setup_mb": peak_rss_mb(reset=True)}
        train_started = time.time()
        if inline:
            _execute(str(path), ctx.tree.root_id, None, "", inline=True)
        else:
            root_flow = node_flow.with_options(flow_run_name="root", task_runner=ThreadPoolTaskRunner(max_workers=ctx.workers))
            root_flow(str(path), ctx.tree.root_id, None, "")
        train_s = time.time() - train_started
        peaks["memory/peak_rss_train_mb"] = peak_rss_mb(reset=True)
        eval_started = time.time()
        faults.hit("eval", "final")
        evaluation = evaluate_all(rt, step=rounds, inline=inline, final=True)
        eval_s = time.time() - eval_started
        peaks["memory/peak_rss_eval_mb"] = peak_rss_mb(reset=False)
        timings = {"time/setup_s": train_started - started, "time/train_s": train_s, "time/final_eval_s": eval_s,
                   "time/total_s": time.time() - started}
        tracker.log_metrics(tracker.parent_id, {**timings, **peaks}, step=record.resumes)
        headline = write_report(tracker, ctx, evaluation, timings)  # report.md, tables, figures (flows/report.py)
        tracker.finish("FINISHED")
        record.status = "finished"
        record.write(path)
    except BaseException as exc:
        record.status, record.error = "failed", f"{type(exc).__name__}: {exc}"[:2000]
        record.write(path)
        if tracker is not None and tracker.parent_id:
            tracker.finish("FAILED")
        raise
    finally:
        if rt is not None:
            rt.reporter.stop()
        _RUNTIMES.pop(str(path), None)
    return {
        "run_path": str(path),
        "tracking_uri": record.tracking_uri,
        "experiment_id": tracker.experiment_id,
        "run_id": tracker.parent_id,
        "headline": headline,
        "timings": timings,
        "memory": peaks,
        "resumes": record.resumes,
        "wall_time_s": time.time() - started,
    }


def _evaluate_step(rt: FlowRuntime, step: int, inline: bool) -> None:
    """An evaluation during training (``eval.every``), recorded so a resumed run does not repeat it."""
    if step in rt.record.evaluated_steps:
        return
    faults.hit("eval", f"step {step}")
    evaluate_all(rt, step=step, inline=inline)
    rt.record.evaluated_steps.append(step)
    rt.record.write(rt.ctx.run_path)


def environment_text() -> str:
    """Installed distributions (``name==version``), logged with every run so two runs are comparable."""
    names = sorted({f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions() if d.metadata["Name"]})
    return "\n".join(names) + "\n"


def peak_rss_mb(reset: bool) -> float:
    """This process's peak resident memory (MB) since the last reset (Linux; NaN elsewhere).

    Resetting (``/proc/self/clear_refs`` = 5) lets each phase report its own peak, so
    training memory is not hidden behind data preparation or evaluation.
    """
    try:
        status = Path("/proc/self/status").read_text()
        peak = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) / 1024
        if reset:
            Path("/proc/self/clear_refs").write_text("5")
        return peak
    except (OSError, StopIteration, ValueError):
        return float("nan")


def new_run_path(run_root: Path, name: str) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-%f")[:-3]
    return run_root / name / stamp


def _invoke(config: ExperimentConfig, run_root: Path, uri: str, path: str, inline: bool, resume: bool) -> dict[str, Any]:
    if inline:
        return _experiment(dump(config), str(run_root), uri, path, inline=True, resume=resume)
    # Flow heartbeats only detect crashed deployment runs; off, each subflow ends ~1 s sooner.
    with temporary_settings(updates={"flows.heartbeat_frequency": None}):
        workers = resolve_workers(config, resolve_devices(config.runtime.device))
        name = f"resume {Path(path).name}" if resume else Path(path).name
        flow_ = experiment_flow.with_options(flow_run_name=name, task_runner=ThreadPoolTaskRunner(max_workers=workers))
        return flow_(dump(config), str(run_root), uri, path, resume)


def run_experiment(
    config: ExperimentConfig,
    run_root: Path,
    tracking_uri: str | None = None,
    reporter: Reporter | None = None,
    inline: bool = False,
    run_path: Path | None = None,
) -> dict[str, Any]:
    """Run the experiment flow in this process (Prefect's local server unless PREFECT_API_URL is set).

    ``inline=True`` runs the same code with no Prefect at all (benchmarks: orchestration share).
    ``run_path`` (default: a new ``<run_root>/<name>/<timestamp>``) is the run folder.
    """
    global _REPORTER
    run_root = run_root.resolve()
    run_root.mkdir(parents=True, exist_ok=True)
    _REPORTER = reporter or SilentReporter()
    uri = tracking_uri or default_tracking_uri(run_root)
    try:
        path = run_path or new_run_path(run_root, config.name)
        return _invoke(config, run_root, uri, str(path), inline, resume=False)
    finally:
        _REPORTER = SilentReporter()


RESUME_OVERRIDABLE = ("runtime.", "eval.batch_size")  # where and how it runs, not what it computes


def resume_experiment(
    run_path: Path, reporter: Reporter | None = None, inline: bool = False, overrides: Sequence[str] = ()
) -> dict[str, Any]:
    """Continue the run in ``run_path`` after a failure: same config, checkpoints, MLflow runs.

    Finished node executions and rounds are loaded from the state store, not redone;
    every random draw depends only on (seed, node, round), so the result is
    bit-identical to a run that never stopped. ``overrides`` may change only keys that
    do not change results (``runtime.*``, ``eval.batch_size``), e.g. fewer workers after
    running out of GPU memory.
    """
    global _REPORTER
    run_path = run_path.resolve()
    config, record = load_run(run_path)
    if record.effective_status == "running":
        raise RunStateError(f"run {run_path} is still running (process {record.pid}); wait for it or stop it first")
    if overrides:
        for assignment in overrides:
            if not assignment.split("=", 1)[0].strip().startswith(RESUME_OVERRIDABLE):
                raise ConfigError(f"--set {assignment}: a resumed run keeps its config; only runtime.* and "
                                  f"eval.batch_size may change (they do not change results). Start a new run instead.")
        config = config_from_dict(dump(config), overrides, source=str(run_path / CONFIG_FILE))
        write_text_atomic(run_path / CONFIG_FILE, yaml.safe_dump(dump(config), sort_keys=False))
    _REPORTER = reporter or SilentReporter()
    try:
        # run_root: the folder holding the shared data cache (<run_root>/<name>/<stamp>)
        return _invoke(config, run_path.parents[1], record.tracking_uri, str(run_path), inline, resume=True)
    finally:
        _REPORTER = SilentReporter()


class RunStateError(RuntimeError):
    """A run folder that cannot be resumed as asked (missing, still running, unreadable); says why."""


def load_run(run_path: Path) -> tuple[ExperimentConfig, RunRecord]:
    """The resolved config and the record of an existing run folder."""
    if not (run_path / CONFIG_FILE).is_file():
        raise RunStateError(f"{run_path} is not a run folder (no {CONFIG_FILE}); `bhfl runs` lists the runs")
    try:
        config = ExperimentConfig.model_validate(yaml.safe_load((run_path / CONFIG_FILE).read_text()))
        record = RunRecord.read(run_path)
    except (ValueError, yaml.YAMLError) as exc:
        raise RunStateError(f"{run_path}: the run's {CONFIG_FILE} or run.json is unreadable ({exc})") from None
    if record is None:
        record = RunRecord(name=config.name, status="failed", tracking_uri=default_tracking_uri(run_path.parents[1]))
    return config, record
