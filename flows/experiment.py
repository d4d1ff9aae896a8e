"""The experiment as Prefect flows: prepare data -> train the tree -> evaluate -> report.

Flow shape (what the Prefect UI shows)::

    bhfl-experiment                      (one per experiment run)
      prepare-data                       (task; cached on disk by data fingerprint)
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
import json
import os
import platform
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import yaml
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.settings import temporary_settings
from prefect.task_runners import ThreadPoolTaskRunner

from bhfl_core.config import ExperimentConfig, dump
from bhfl_core.engine import ChildrenReport, RoundKey, execute_node
from bhfl_core.evaluation import EvalRow, eval_rows, headline_metrics, matrix_csv
from bhfl_core.params import get_flat
from bhfl_core.placement import split_by_load
from bhfl_core.residuals import Candidate, needs
from bhfl_core.state_store import NodeState, StateStore
from bhfl_core.tree import Node
from data_prep.prepare import prepare_data
from flows.progress import Reporter, SilentReporter
from flows.tracking import Tracker, default_tracking_uri
from tasks.context import CONFIG_FILE, DATA_POINTER, RunContext, get_context, resolve_devices, resolve_workers
from tasks.evaluation import evaluate_models
from tasks.training import WorkerReport, proxy_train, train_clients


@dataclass
class FlowRuntime:
    """Process-local objects of a running experiment that cannot travel as flow parameters."""

    ctx: RunContext
    tracker: Tracker
    reporter: Reporter


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
        futures = [train_clients.submit(self.run_path, caller, ids, phi_path, keep, select) for ids in plan]
        return [f.result() for f in futures]  # plan order, so the float sums are deterministic

    def run_children(self, node: Node, cohort: list[Node], theta: torch.Tensor, key: RoundKey) -> ChildrenReport:
        ctx = self.rt.ctx
        phi_path = ctx.store.write_message(f"{node.id}.down", theta)
        caller = f"{node.id}:{key.round}"
        report = ChildrenReport()
        for child in (c for c in cohort if not c.is_leaf):
            theta_child = StateStore.read_message(self._run_child(child, phi_path, caller))
            report.aggregate.add(theta_child, child.weight)
            if node.settings.res_up:
                report.candidates.append(Candidate(child.id, theta_child, child.weight))
        leaves = [c for c in cohort if c.is_leaf]
        if leaves:
            plan = split_by_load([c.id for c in leaves], [c.weight for c in leaves], ctx.workers)
            losses: dict[str, tuple[float, int]] = {}
            for worker in self._run_workers(node, plan, phi_path, caller):
                report.aggregate.merge(worker.aggregate)
                report.candidates.extend(worker.candidates)
                losses.update(worker.losses)
            seen = sum(n for _, n in losses.values())
            report.metrics["train/loss"] = sum(loss * n for loss, n in losses.values()) / max(seen, 1)
            report.metrics["train/clients"] = float(len(leaves))
            report.metrics["train/examples"] = float(seen)
        return report

    def train(self, node: Node, theta: torch.Tensor, key: RoundKey) -> tuple[torch.Tensor, dict[str, float]]:
        fn = proxy_train.fn if self.inline else proxy_train
        return fn(self.run_path, node.id, key, theta)

    def round_done(self, node: Node, key: RoundKey, theta: torch.Tensor, metrics: dict[str, float]) -> None:
        self.rt.tracker.log_node(node.id, metrics, step=key.round + 1)
        self.rt.reporter.node_round(node.id, node.depth, key.round, metrics)
        every = self.rt.ctx.config.eval.every
        is_last = key.round + 1 >= node.settings.rounds
        if node.parent is None and every and (key.round + 1) % every == 0 and not is_last:
            evaluate_all(self.rt, step=key.round + 1, inline=self.inline)


def _execute(run_path: str, node_id: str, phi_path: str | None, caller: str, inline: bool = False) -> str:
    """EXECUTENODE for one internal node, from and to message files; returns the path of theta_T."""
    rt = _runtime(run_path)
    ctx = rt.ctx
    phi = StateStore.read_message(phi_path) if phi_path else None
    theta = execute_node(ctx.tree, ctx.tree[node_id], phi, ctx.store, FlowHooks(rt, inline), ctx.config.seed, caller)
    return ctx.store.write_message(f"{node_id}.up", theta)


@flow(name="node", validate_parameters=False)
def node_flow(run_path: str, node_id: str, phi_path: str | None, caller: str) -> str:
    """One execution of an internal node as a Prefect subflow."""
    return _execute(run_path, node_id, phi_path, caller)


def evaluate_all(rt: FlowRuntime, step: int, inline: bool = False) -> list[EvalRow]:
    """Score every server model and every persistent client model on every test split."""
    ctx = rt.ctx
    nodes = [n.id for n in ctx.tree.servers()]
    if ctx.config.eval.client_models:
        nodes += [n.id for n in ctx.tree.clients() if n.settings.persistent]
    plan = split_by_load(nodes, [1.0] * len(nodes), ctx.workers)
    confusions: dict[str, Any] = {}
    if inline:
        for ids in plan:
            confusions.update(evaluate_models.fn(str(ctx.run_path), ids))
    else:
        for future in [evaluate_models.submit(str(ctx.run_path), ids) for ids in plan]:
            confusions.update(future.result())
    rows = eval_rows(ctx.tree, confusions)
    per_node: dict[str, dict[str, float]] = {}
    for r in rows:
        per_node.setdefault(r.node, {})[f"eval/{r.test_set}/{r.metric}"] = r.value
    for node_id, values in per_node.items():
        rt.tracker.log_node(node_id, values, step)
    rt.tracker.log_metrics(rt.tracker.parent_id, headline_metrics(ctx.tree, rows), step)
    rt.reporter.note(f"evaluated {len(confusions)} models after root round {step}")
    return rows


@task(name="prepare-data", cache_policy=NO_CACHE, persist_result=False)
def prepare_data_task(config: ExperimentConfig, cache_root: str) -> str:
    """Prepare (or reuse, by fingerprint) the data; returns the prepared folder."""
    return str(prepare_data(config, Path(cache_root), log=_REPORTER.note).root)


def _run_tags(config: ExperimentConfig, run_path: Path, data_root: Path) -> dict[str, str]:
    resolved = json.dumps(dump(config), sort_keys=True)
    return {
        "bhfl.run_path": str(run_path),
        "bhfl.config_hash": hashlib.sha256(resolved.encode()).hexdigest()[:16],
        "bhfl.data_fingerprint": data_root.name,
        "bhfl.seed": str(config.seed),
        "bhfl.python": platform.python_version(),
        "bhfl.torch": torch.__version__,
    }


def _describe(config: ExperimentConfig, ctx: RunContext) -> str:
    tree = ctx.tree
    return (f"B-HFL experiment `{config.name}`: {len(tree.clients())} clients, "
            f"{len(tree.servers())} servers, {tree.root.settings.rounds} root rounds, seed {config.seed}.")


@flow(name="bhfl-experiment", validate_parameters=False)
def experiment_flow(config: dict[str, Any], run_root: str, tracking_uri: str, run_path: str) -> dict[str, Any]:
    """Run one experiment end to end; returns where its results are and the headline metrics."""
    return _experiment(config, run_root, tracking_uri, run_path, inline=False)


def _experiment(config: dict[str, Any], run_root: str, tracking_uri: str, run_path: str, inline: bool) -> dict[str, Any]:
    started = time.time()
    cfg = ExperimentConfig.model_validate(config)
    root = Path(run_root).resolve()
    path = Path(run_path).resolve()
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(yaml.safe_dump(dump(cfg), sort_keys=False))

    data_root = Path((prepare_data_task.fn if inline else prepare_data_task)(cfg, str(root / "cache")))
    (path / DATA_POINTER).write_text(json.dumps({"data_root": str(data_root)}))
    ctx = get_context(path)
    torch.set_num_threads(cfg.runtime.torch_threads or os.cpu_count() or 1)

    tracker = Tracker(tracking_uri)
    tracker.start(cfg.name, dump(cfg), ctx.tree, _run_tags(cfg, path, data_root), _describe(cfg, ctx))
    tracker.log_text(yaml.safe_dump(dump(cfg), sort_keys=False), "config.yaml")
    tracker.log_artifact(data_root / "manifest.json", "data")
    rt = FlowRuntime(ctx, tracker, _REPORTER)
    _RUNTIMES[str(path)] = rt
    try:
        if not ctx.store.has(ctx.tree.root_id):
            init = get_flat(ctx.build_model(cfg.seed + cfg.model.init_seed_offset))
            ctx.store.save(ctx.tree.root_id, NodeState(model=init))
        rt.reporter.start(ctx.tree.root.settings.rounds)
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
        rows = evaluate_all(rt, step=ctx.tree.root.settings.rounds, inline=inline)
        eval_s = time.time() - eval_started
        tracker.log_text(matrix_csv(rows), "eval/matrix.csv")
        headline = headline_metrics(ctx.tree, rows)
        peaks["memory/peak_rss_eval_mb"] = peak_rss_mb(reset=False)
        timings = {"time/setup_s": train_started - started, "time/train_s": train_s, "time/final_eval_s": eval_s,
                   "time/total_s": time.time() - started}
        tracker.log_metrics(tracker.parent_id, {**timings, **peaks}, step=0)
        tracker.finish("FINISHED")
    except BaseException:
        tracker.finish("FAILED")
        raise
    finally:
        rt.reporter.stop()
        _RUNTIMES.pop(str(path), None)
    return {
        "run_path": str(path),
        "tracking_uri": tracking_uri,
        "experiment_id": tracker.experiment_id,
        "run_id": tracker.parent_id,
        "headline": headline,
        "timings": timings,
        "memory": peaks,
        "wall_time_s": time.time() - started,
    }


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


def run_experiment(
    config: ExperimentConfig,
    run_root: Path,
    tracking_uri: str | None = None,
    reporter: Reporter | None = None,
    inline: bool = False,
) -> dict[str, Any]:
    """Run the experiment flow in this process (Prefect's local server unless PREFECT_API_URL is set).

    ``inline=True`` runs the same code with no Prefect at all (benchmarks: orchestration share).
    """
    global _REPORTER
    run_root = run_root.resolve()
    run_root.mkdir(parents=True, exist_ok=True)
    _REPORTER = reporter or SilentReporter()
    uri = tracking_uri or default_tracking_uri(run_root)
    path = str(new_run_path(run_root, config.name))
    try:
        if inline:
            return _experiment(dump(config), str(run_root), uri, path, inline=True)
        # Flow heartbeats only detect crashed deployment runs; off, each subflow ends ~1 s sooner.
        with temporary_settings(updates={"flows.heartbeat_frequency": None}):
            workers = resolve_workers(config, resolve_devices(config.runtime.device))
            flow_ = experiment_flow.with_options(task_runner=ThreadPoolTaskRunner(max_workers=workers))
            return flow_(dump(config), str(run_root), uri, path)
    finally:
        _REPORTER = SilentReporter()
