"""The experiment as Prefect flows: prepare data -> train the tree -> evaluate -> report.

Flow shape (what the Prefect UI shows)::

    bhfl-experiment                      (one per experiment run)
      prepare-data                       (subflow, flows/data.py: a task per step; cached on disk by fingerprint)
      node: root                         (subflow: one execution of the root = T_root rounds)
        node: <server>                   (subflow per execution of each internal node; siblings run concurrently)
          node: edge-<lang>
            train-clients x batches      (task per worker batch; the batch trains in that worker's process)
          proxy-train                    (task, where the server has proxy data)
      evaluate-models x workers          (task per worker, each scores a list of node models)

Where the work runs: the orchestrating process runs the flows, the server rounds
(NODEOPT on flat vectors, checkpoints) and MLflow logging; client training, proxy
training and evaluation run on the run's executor (tasks/executor.py: a Dask cluster
of worker processes, local or remote, or this process). Each node execution rebuilds
what it needs from the run folder and its record (``run.json``: tracker ids, cluster
address, worker slots), so nothing of a run lives in a process-global registry and any
process that sees the run folder and reaches the cluster can execute any subtree.
Tensors travel as files (``state/messages``) and as the workers' weighted sums.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
import yaml
from prefect import Task, flow
from prefect.settings import temporary_settings
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import quote

from bhfl_core.config.schema import ExperimentConfig, dump
from bhfl_core.config.base import ConfigError
from bhfl_core.config.loader import config_from_dict
from bhfl_core.algorithm.engine import execute_node
from bhfl_core.algorithm.node_state import ROOT_CALLER, Caller, NodeState, RoundKey
from bhfl_core.algorithm.node_step import ChildrenReport
from bhfl_core.analysis.evaluation import Evaluation
from bhfl_core.store.atomic import write_text_atomic
from bhfl_core.learning.local_train import planned_steps
from bhfl_core.learning.metrics import task_metrics
from bhfl_core.placement import Job, place, utilisation
from bhfl_core.algorithm.residuals import Candidate, needs
from bhfl_core.store.node_store import StateStore
from bhfl_core.algorithm.tree import Node
from flows import progress
from flows.creation_gate import creation_gate, run_gated, signal_running
from flows.data import run_prepare
from flows.records.run_record import RunRecord, new_run_path
from flows.tracking.tracker import Tracker, default_tracking_uri
from tasks import faults
from tasks.client_training import WorkerReport
from tasks.context import CONFIG_FILE, DATA_POINTER, TIMELINE_DIR, RunContext, mark_once, open_run, read_marks
from tasks.evaluation import baseline_models, evaluate_models, node_models
from tasks.executor import Executor, cluster_workers, executor_for, gather, process_worker
from tasks.local_cluster import ClusterStart
from tasks.time_model import load_time_model, record_timings
from tasks.training import proxy_train, train_clients, with_retries
from tasks.worker import busy_intervals

IMPORTED_AT = time.time()  # the heavy imports above are done: the timeline's "imports_done"
TASK_THREADS = 64  # threads that wait on worker calls (cheap; the work is on the workers)

@dataclass
class NodeRuntime:
    """What one node execution needs, rebuilt from the run folder (in any process that sees it)."""

    ctx: RunContext
    record: RunRecord
    tracker: Tracker
    executor: Executor
    inline: bool = False

    @property
    def run_path(self) -> str:
        return str(self.ctx.run_path)


@contextmanager
def node_runtime(run_path: str, inline: bool) -> Iterator[NodeRuntime]:
    ctx = open_run(run_path)
    record = RunRecord.read(ctx.run_path)
    if record is None:
        raise RuntimeError(f"{ctx.run_path} has no run record (run.json)")
    tracker = Tracker.attach(record.tracking_uri, record.experiment_id, record.parent_run_id, record.node_runs)
    with executor_for(ctx.config.runtime, record.cluster, record.workers) as executor:
        yield NodeRuntime(ctx, record, tracker, executor, inline)


class FlowHooks:
    """EngineHooks for servers: children as subflows (servers) or worker batches (clients).

    ``inline=True`` runs the very same node code without Prefect (plain recursion and
    direct executor calls); benchmarks use it to measure what the orchestration costs.
    """

    def __init__(self, rt: NodeRuntime) -> None:
        self.rt = rt
        self.round_started: dict[int, float] = {}

    # ------------------------------------------------------------ children

    def _run_child(self, child: Node, phi_path: str, caller: Caller) -> str:
        depth = self.rt.ctx.config.runtime.subflow_depth
        if self.rt.inline or (depth is not None and child.depth > depth):  # inside this flow run
            if not self.rt.inline:
                signal_running()  # nothing to create: the next sibling may go
            return _execute(self.rt.run_path, child.id, phi_path, caller, inline=self.rt.inline)
        child_flow = node_flow.with_options(flow_run_name=f"{child.id} <- {caller}", on_running=[signal_running],
                                            task_runner=ThreadPoolTaskRunner(max_workers=TASK_THREADS))
        return child_flow(self.rt.run_path, child.id, phi_path, caller)

    def _run_servers(self, servers: list[Node], phi_path: str, caller: Caller) -> list[str]:
        """Execute child servers, concurrently unless ``runtime.parallel_subtrees`` is off; results in cohort order.

        Each child runs in its own thread (a copy of this context: Prefect nests its
        subflow under this flow run); the subflows are created one at a time.
        """
        if not self.rt.ctx.config.runtime.parallel_subtrees:
            return [self._run_child(c, phi_path, caller) for c in servers]
        futures = [run_gated(functools.partial(self._run_child, c, phi_path, caller)) for c in servers]
        return gather(futures)

    def _run_clients(self, node: Node, leaves: list[Node], phi_path: str, caller: Caller, key: RoundKey) -> list[WorkerReport]:
        runtime = self.rt.ctx.config.runtime
        keep, select = needs(node.settings.res_up)
        jobs = [Job(c.id, planned_steps(int(c.weight), c.settings.train)) for c in leaves if c.settings.train]
        model = load_time_model(self.rt.ctx.run_path) if runtime.placement == "learned" else None
        plan = place(jobs, self.rt.executor.slots(), runtime.placement, model)
        name = f"{node.id} round {key.round + 1}: " + ", ".join(f"{len(a.jobs)} on {a.slot.name}" for a in plan)
        reports: list[WorkerReport] = _call(self.rt, train_clients, name, [(a.slot, list(a.jobs)) for a in plan],
                                                 self.rt.run_path, caller, phi_path, keep, select)
        if runtime.placement == "learned":
            record_timings(self.rt.ctx.run_path, [(r.device_kind, steps, s) for r in reports for _, steps, s in r.timings])
        return reports

    def run_children(self, node: Node, cohort: list[Node], theta: torch.Tensor, key: RoundKey) -> ChildrenReport:
        self.round_started[key.round] = time.time()
        ctx = self.rt.ctx
        phi_path = ctx.store.write_message(f"{node.id}.down", theta)
        caller = key.as_caller()
        report = ChildrenReport()
        losses: dict[str, tuple[float, int]] = {}  # child -> (training loss of its last round, examples)
        servers = [c for c in cohort if not c.is_leaf]
        leaves = [c for c in cohort if c.is_leaf]
        for child, up_path in zip(servers, self._run_servers(servers, phi_path, caller)):
            theta_child = StateStore.read_message(up_path)
            report.aggregate.add(theta_child, child.weight)
            if node.settings.res_up:
                report.candidates.append(Candidate(child.id, theta_child, child.weight))
            last = ctx.store.load_info(child.id).get("metrics", {})  # the child's last round, saved with it
            if last.get("train/examples"):
                losses[child.id] = (last["train/loss"], int(last["train/examples"]))
        if leaves:
            order = {c.id: i for i, c in enumerate(cohort)}
            workers = self._run_clients(node, leaves, phi_path, caller, key)
            for worker in workers:
                report.aggregate.merge(worker.aggregate)
                report.candidates.extend(worker.candidates)
                report.dropped.extend(worker.dropped)
                losses.update(worker.losses)
            # one order whatever the placement: selection ties and float sums then agree across worker counts
            report.candidates.sort(key=lambda c: order.get(c.node_id, len(order)))
            report.dropped.sort(key=order.__getitem__)
            for client_id in report.dropped:
                progress.note(f"client {client_id} failed and was dropped from {node.id} round {key.round + 1}")
            report.metrics["train/clients"] = float(len(leaves))
        if losses:  # example-weighted mean of the children's last-round client loss, in a fixed order
            ordered = [losses[k] for k in sorted(losses)]
            seen = sum(n for _, n in ordered)
            report.metrics["train/loss"] = sum(loss * n for loss, n in ordered) / max(seen, 1)
            report.metrics["train/examples"] = float(seen)
        return report

    # ------------------------------------------------------------ the node's own steps

    def train(self, node: Node, theta: torch.Tensor, key: RoundKey) -> tuple[torch.Tensor, dict[str, float]]:
        """Proxy TRAIN of a server, on a worker (the model travels as a message file)."""
        ctx = self.rt.ctx
        assert node.settings.train is not None
        steps = planned_steps(ctx.manifest.proxy_train.size, node.settings.train)
        slot = place([Job(node.id, steps)], self.rt.executor.slots(), "lpt")[0].slot
        theta_path = ctx.store.write_message(f"{node.id}.proxy-in", theta)
        out_path, metrics = _call(self.rt, proxy_train, f"{node.id} round {key.round + 1}: proxy on {slot.name}",
                                       slot, self.rt.run_path, node.id, key, theta_path)
        return StateStore.read_message(out_path), metrics

    def round_done(self, node: Node, key: RoundKey, theta: torch.Tensor, metrics: dict[str, float]) -> None:
        rt = self.rt
        is_root = node.parent is None
        if is_root:
            metrics = {**metrics, **_utilisation(rt, self.round_started.get(key.round, time.time()), time.time())}
        rt.tracker.log_node(node.id, metrics, step=key.round + 1)
        progress.node_round(node.id, node.depth, key.round, metrics)
        every = rt.ctx.config.eval.every
        is_last = key.round + 1 >= node.settings.rounds
        if is_root and is_last:
            mark_once(rt.ctx.run_path, "last_aggregate")
        if is_root and every and (key.round + 1) % every == 0 and not is_last:
            _evaluate_step(rt, key.round + 1)
        if not node.is_leaf:
            faults.hit("round", f"{node.id} round {key.round + 1}")


def _call(rt: NodeRuntime, task_: Task, name: str, *args: Any) -> Any:
    """Call one of the run's tasks: as a Prefect task run (created through the gate), or plainly when inline."""
    if rt.inline:
        return task_.fn(rt.executor, *args)
    named = with_retries(task_, rt.ctx.config.runtime, name, on_running=[signal_running])
    return run_gated(functools.partial(named, quote(rt.executor), *args)).result()


def _utilisation(rt: NodeRuntime, start: float, end: float) -> dict[str, float]:
    """Worker utilisation over ``[start, end]``: mean busy share, and the share with every worker busy."""
    slots = rt.executor.slots()
    intervals = {k: v for k, v in busy_intervals(rt.ctx.run_path).items() if k in {s.name for s in slots}}
    mean, every = utilisation(intervals, len(slots), (start, end))
    return {"runtime/worker_utilisation": mean, "runtime/all_workers_busy": every}


def _execute(run_path: str, node_id: str, phi_path: str | None, caller: Caller, inline: bool = False) -> str:
    """EXECUTENODE for one internal node, from and to message files; returns the path of theta_T."""
    with node_runtime(run_path, inline) as rt:
        ctx = rt.ctx
        phi = StateStore.read_message(phi_path) if phi_path else None
        result = execute_node(ctx.tree, ctx.tree[node_id], phi, ctx.store, FlowHooks(rt), ctx.config.seed, caller)
        return ctx.store.write_message(f"{node_id}.up", result.theta)


@flow(name="node", validate_parameters=False)
def node_flow(run_path: str, node_id: str, phi_path: str | None, caller: Caller) -> str:
    """One execution of an internal node as a Prefect subflow."""
    return _execute(run_path, node_id, phi_path, caller)


def evaluate_all(rt: NodeRuntime, step: int, final: bool = False) -> Evaluation:
    """Score every node model (and, when ``final``, the configured per-client baselines) on every test set.

    Node models first, then the baselines (local-only, local adaptation; they train
    first), each phase spread over the workers; both phases' wall times go to MLflow.
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
        jobs = [Job(name, max(1, round(load))) for name, load in zip(names, loads)]
        plan = place(jobs, rt.executor.slots(), "lpt")
        batches = [(a.slot, list(a.jobs)) for a in plan]
        name = f"evaluate {len(names)} models on " + ", ".join(a.slot.name for a in plan)
        stats.update(_call(rt, evaluate_models, name, batches, rt.run_path))
        seconds[timer] = time.time() - started
    evaluation = Evaluation.from_stats(ctx.tree, task_metrics(ctx.manifest.task), stats)
    from flows.tracking.report import log_evaluation  # matplotlib and the report code: not needed at start-up

    log_evaluation(rt.tracker, evaluation, step, seconds)
    progress.note(f"evaluated {len(stats)} models after root round {step}")
    return evaluation


def _run_tags(config: ExperimentConfig, run_path: Path, data_fingerprint: str) -> dict[str, str]:
    resolved = json.dumps(dump(config), sort_keys=True)
    return {
        "bhfl.run_path": str(run_path),
        "bhfl.config_hash": hashlib.sha256(resolved.encode()).hexdigest()[:16],
        "bhfl.data_fingerprint": data_fingerprint,
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
    config: dict[str, Any], run_root: str, tracking_uri: str, run_path: str | None = None, resume: bool = False,
    cluster: str | None = None,
) -> dict[str, Any]:
    """Run one experiment end to end (or finish an interrupted one); returns where its results are.

    ``run_path`` None (e.g. a scheduled deployment run) makes a new run folder under
    ``run_root``. ``resume`` continues the run in ``run_path`` from its checkpoints.
    ``cluster``: the address of a local cluster already started for this run (the CLI
    starts it while Prefect starts); None starts one here when ``runtime.executor`` is
    ``local``.
    """
    return _experiment(config, run_root, tracking_uri, run_path, inline=False, resume=resume, cluster=cluster)


def _workers(cfg: ExperimentConfig, address: str | None) -> list[dict[str, str]]:
    """The workers this run places work on: the cluster's, or this process."""
    return cluster_workers(address, cfg.runtime) if address else [process_worker(cfg.runtime).describe()]


def _experiment(
    config: dict[str, Any], run_root: str, tracking_uri: str, run_path: str | None, inline: bool, resume: bool = False,
    cluster: str | None = None,
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
    shutil.rmtree(path / TIMELINE_DIR, ignore_errors=True)  # the timeline is the latest attempt's
    record.timeline = {"process_start": psutil.Process().create_time(), "imports_done": IMPORTED_AT, "flow_start": started}
    record.write(path)

    tracker: Tracker | None = None
    rt: NodeRuntime | None = None
    with ExitStack() as stack:
        if not inline:  # this experiment's Prefect runs are created one at a time (flows/creation_gate.py)
            stack.enter_context(creation_gate())
        starting = None
        artefacts: Future[None] | None = None  # the parent run's files, logged beside the first round
        if cfg.runtime.executor == "local" and cluster is None:  # workers boot while data and MLflow get ready
            starting = ClusterStart(cfg.runtime, path)
            stack.callback(starting.close)
        try:
            faults.hit("prepare")
            data_root = run_prepare(cfg, root / "cache", inline=inline).root
            (path / DATA_POINTER).write_text(json.dumps({"data_root": str(data_root)}))
            mark_once(path, "data_ready")
            ctx = open_run(path)
            tracker = Tracker(record.tracking_uri)
            if record.parent_run_id:
                tracker.reopen(record.experiment_id, record.parent_run_id, record.node_runs, record.resumes)
            else:
                tracker.start(cfg.name, dump(cfg), ctx.tree, _run_tags(cfg, path, ctx.manifest.fingerprint), _describe(cfg, ctx))
                record.experiment_id, record.parent_run_id, record.node_runs = (tracker.experiment_id, tracker.parent_id,
                                                                                 tracker.node_runs)
                record.write(path)
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
            rt = stack.enter_context(node_runtime(str(path), inline))
            if not ctx.store.has(ctx.tree.root_id):
                initial = rt.executor.submit(rt.executor.slots()[0], "initial_model", str(path)).result()
                ctx.store.save(ctx.tree.root_id, NodeState(model=StateStore.read_message(initial)))
            rounds = ctx.tree.root.settings.rounds
            done = ctx.store.load_info(ctx.tree.root_id).get("rounds_done", 0)
            progress.note(f"{len(workers)} worker(s): " + ", ".join(f"{w['name']} ({w['device']})" for w in workers))
            progress.run_started(rounds, done)
            if record.resumes:
                if removed := ctx.store.remove_partial_writes():
                    progress.note(f"removed {removed} checkpoint write(s) that the interrupted run left unfinished")
                progress.note(f"resuming {path.name}: root round {done + 1 if done < rounds else rounds} of {rounds}; "
                              "finished nodes and rounds are loaded from their checkpoints, not run again")
                if 0 < done < rounds and cfg.eval.every and done % cfg.eval.every == 0:
                    _evaluate_step(rt, done)  # the interrupted run may have died evaluating this step
            peaks = {"memory/peak_rss_setup_mb": peak_rss_mb(reset=True)}
            train_started = time.time()
            if inline:
                _execute(str(path), ctx.tree.root_id, None, ROOT_CALLER, inline=True)
            else:
                root_flow = node_flow.with_options(flow_run_name="root",
                                                   task_runner=ThreadPoolTaskRunner(max_workers=TASK_THREADS))
                root_flow(str(path), ctx.tree.root_id, None, ROOT_CALLER)
            train_s = time.time() - train_started
            peaks["memory/peak_rss_train_mb"] = peak_rss_mb(reset=True)
            usage = _utilisation(rt, train_started, train_started + train_s)
            eval_started = time.time()
            faults.hit("eval", "final")
            evaluation = evaluate_all(rt, step=rounds, final=True)
            eval_s = time.time() - eval_started
            peaks["memory/peak_rss_eval_mb"] = peak_rss_mb(reset=False)
            timings = {"time/setup_s": train_started - started, "time/train_s": train_s, "time/final_eval_s": eval_s,
                       "time/total_s": time.time() - started}
            tracker.log_metrics(tracker.parent_id, {**timings, **peaks, **usage}, step=record.resumes)
            if artefacts is not None:
                artefacts.result()
            from flows.tracking.report import write_report  # matplotlib and the report code: not needed at start-up

            headline = write_report(tracker, ctx, evaluation, timings)  # report.md, tables, figures
            tracker.finish("FINISHED")
            record = _finish_record(path, record, "finished")
        except BaseException as exc:
            record = _finish_record(path, record, "failed", f"{type(exc).__name__}: {exc}"[:2000])
            if tracker is not None and tracker.parent_id:
                tracker.finish("FAILED")
            raise
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
    }


def _log_run_files(tracker: Tracker, cfg: ExperimentConfig, data_root: Path) -> None:
    """The parent run's files: the resolved config, the data manifest and report, the package list."""
    tracker.log_text(yaml.safe_dump(dump(cfg), sort_keys=False), "config.yaml")
    tracker.log_data_report(data_root)
    tracker.log_text(environment_text(), "environment/packages.txt")


def _finish_record(path: Path, record: RunRecord, status: str, error: str = "") -> RunRecord:
    """Write the attempt's end into ``run.json`` (re-read: evaluations during training updated it)."""
    current = RunRecord.read(path) or record
    current = current.model_copy(update={"status": status, "error": error})
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


def _evaluate_step(rt: NodeRuntime, step: int) -> None:
    """An evaluation during training (``eval.every``), recorded so a resumed run does not repeat it."""
    record = RunRecord.read(rt.ctx.run_path) or rt.record
    if step in record.evaluated_steps:
        return
    faults.hit("eval", f"step {step}")
    evaluate_all(rt, step=step)
    record.evaluated_steps.append(step)
    record.write(rt.ctx.run_path)


def environment_text() -> str:
    """Installed distributions (``name==version``), logged with every run so two runs are comparable."""
    names = sorted({f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions() if d.metadata["Name"]})
    return "\n".join(names) + "\n"


def peak_rss_mb(reset: bool) -> float:
    """This process's peak resident memory (MB) since the last reset (Linux; NaN elsewhere).

    Resetting (``/proc/self/clear_refs`` = 5) lets each phase report its own peak, so
    training memory is not hidden behind data preparation or evaluation. Worker
    processes are not included (benchmarks/throughput.py measures the process tree).
    """
    try:
        status = Path("/proc/self/status").read_text()
        peak = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) / 1024
        if reset:
            Path("/proc/self/clear_refs").write_text("5")
        return peak
    except (OSError, StopIteration, ValueError):
        return float("nan")


def _invoke(config: ExperimentConfig, run_root: Path, uri: str, path: str, inline: bool, resume: bool,
            cluster: str | None) -> dict[str, Any]:
    if inline:
        return _experiment(dump(config), str(run_root), uri, path, inline=True, resume=resume, cluster=cluster)
    # Flow heartbeats only detect crashed deployment runs; off, each subflow ends ~1 s sooner.
    with temporary_settings(updates={"flows.heartbeat_frequency": None}):
        name = f"resume {Path(path).name}" if resume else Path(path).name
        flow_ = experiment_flow.with_options(flow_run_name=name, task_runner=ThreadPoolTaskRunner(max_workers=TASK_THREADS))
        return flow_(dump(config), str(run_root), uri, path, resume, cluster)


def run_experiment(
    config: ExperimentConfig,
    run_root: Path,
    tracking_uri: str | None = None,
    inline: bool = False,
    run_path: Path | None = None,
    cluster: str | None = None,
) -> dict[str, Any]:
    """Run the experiment flow in this process (Prefect's local server unless PREFECT_API_URL is set).

    ``inline=True`` runs the same code with no Prefect at all (benchmarks: orchestration share).
    ``run_path`` (default: a new ``<run_root>/<name>/<timestamp>``) is the run folder.
    ``cluster``: a local cluster already started for this run (``runtime.executor: local``).
    Progress goes to the ``bhfl.progress`` logger (flows/progress.py).
    """
    run_root = run_root.resolve()
    run_root.mkdir(parents=True, exist_ok=True)
    uri = tracking_uri or default_tracking_uri(run_root)
    path = run_path or new_run_path(run_root, config.name)
    return _invoke(config, run_root, uri, str(path), inline, resume=False, cluster=cluster)


RESUME_OVERRIDABLE = ("runtime.", "eval.batch_size")  # where and how it runs, not what it computes


def resume_experiment(
    run_path: Path, inline: bool = False, overrides: Sequence[str] = (), cluster: str | None = None
) -> dict[str, Any]:
    """Continue the run in ``run_path`` after a failure: same config, checkpoints, MLflow runs.

    Finished node executions and rounds are loaded from the state store, not redone;
    every random draw depends only on (seed, node, round), so the result is
    bit-identical to a run that never stopped. ``overrides`` may change only keys that
    do not change results (``runtime.*``, ``eval.batch_size``), e.g. fewer workers after
    running out of GPU memory.
    """
    run_path = run_path.resolve()
    config, record = load_run(run_path)
    if record.effective_status == "running":
        raise RunStateError(f"run {run_path} is still running (process {record.pid}); wait for it or stop it first")
    config = resume_config(run_path, config, overrides)
    # run_root: the folder holding the shared data cache (<run_root>/<name>/<stamp>)
    return _invoke(config, run_path.parents[1], record.tracking_uri, str(run_path), inline, resume=True, cluster=cluster)


def resume_config(run_path: Path, config: ExperimentConfig, overrides: Sequence[str]) -> ExperimentConfig:
    """The run's config with the ``runtime.*`` / ``eval.batch_size`` changes a resume may make (written back)."""
    if not overrides:
        return config
    for assignment in overrides:
        if not assignment.split("=", 1)[0].strip().startswith(RESUME_OVERRIDABLE):
            raise ConfigError(f"--set {assignment}: a resumed run keeps its config; only runtime.* and "
                              f"eval.batch_size may change (they do not change results). Start a new run instead.")
    config = config_from_dict(dump(config), overrides, source=str(run_path / CONFIG_FILE))
    write_text_atomic(run_path / CONFIG_FILE, yaml.safe_dump(dump(config), sort_keys=False))
    return config


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
