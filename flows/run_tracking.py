"""An experiment run's MLflow side: its runs created, reopened or adopted; what a resume logs again.

The run's record (``run.json``) holds the MLflow ids, and the key of the runs before they
are created, so any attempt finds its runs: a resume reopens them, an attempt killed
between creating and recording them adopts them (flows/run_attempt.py calls these).
"""

from __future__ import annotations

import platform
from pathlib import Path

import yaml

from bhfl_core.config.schema import ExperimentConfig, dump
from bhfl_core.config.sweep import config_hash
from flows.records.environment import cpu_capability, environment_text, git_commit, package_version
from flows.records.run_record import PipelineLink, RunRecord
from flows.tracking.tracker import Tracker
from tasks.context import RunContext
from tasks.executor import worker_losses
from tasks.faults import FaultPlan


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


def open_tracking(
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
    ctx.faults.hit("tracking")  # created, not yet recorded: the resume must adopt these runs
    if record.resumes:
        tracker.tag_resume(record.resumes)
    record.experiment_id, record.parent_run_id, record.node_runs = (
        tracker.experiment_id,
        tracker.parent_id,
        tracker.node_runs,
    )
    record.write(path)
    return tracker


def log_committed_rounds(ctx: RunContext, tracker: Tracker) -> None:
    """Log each server's last committed round from its saved state, where a kill came between commit and log.

    A round's metrics are logged right after its state is committed; a kill in between
    would lose that point. The state holds the round's metrics, so a resume logs them at
    the round's step (a no-op where they are in the store: resumed trackers skip those).
    """
    for node in ctx.tree.servers():
        state = ctx.store.load_header(node.id)
        if state.rounds_done and state.metrics:
            tracker.log_node(node.id, state.metrics, step=state.rounds_done)


def record_logged(path: Path, phase: str) -> None:
    """Note in ``run.json`` that an MLflow logging phase finished (re-read: evaluations updated it)."""
    current = RunRecord.read(path)
    if current is not None and phase not in current.logged:
        current.logged.append(phase)
        current.write(path)


def log_run_files(tracker: Tracker, cfg: ExperimentConfig, data_root: Path, faults: FaultPlan) -> None:
    """The parent run's files: the resolved config, the data manifest and report, the package list."""
    tracker.log_text(yaml.safe_dump(dump(cfg), sort_keys=False), "config.yaml")
    tracker.log_data_report(data_root)
    faults.hit("artefacts")
    tracker.log_text(environment_text(), "environment/packages.txt")


def worker_loss_metrics(tracker: Tracker, path: Path) -> dict[str, float]:
    """Calls that ran again because their worker was lost (tasks/executor.py): a tag and a count, where any were."""
    losses = worker_losses(path)
    if not losses:
        return {}
    text = "; ".join(f"{x['worker']} lost during {x['call']}, which ran again" for x in losses)
    tracker.set_tags({"bhfl.worker_losses": text[:5000]})  # (MLflow's limit on a tag value is larger)
    return {"runtime/worker_losses": float(len(losses))}
