"""The experiment as a Prefect flow: prepare data -> train the tree -> evaluate -> report.

Flow shape (what the Prefect UI shows)::

    bhfl-experiment                      (one per experiment run)
      prepare-data                       (subflow, flows/data.py: a task per step; cached on disk by fingerprint)
      node: root                         (subflow tree, flows/training.py)
      evaluate-models x workers          (task per worker, each scores a list of node models; flows/evaluation.py)

An experiment run is a job of the one lifecycle (flows/lifecycle.py): ``ExperimentJob``
writes its folder (``config.yaml``, ``run.json``) before the flow starts, the flow's body
is flows/run_attempt.py, and ``resume_experiment`` continues it. Where the work runs:
this process runs the flows, the server rounds and MLflow logging; client training,
proxy training and evaluation run on the run's executor (tasks/executor.py: a Dask
cluster of worker processes, local or remote, or this process).
``run_experiment(..., orchestration=PLAIN_CALLS)`` runs the very same code without
Prefect (flows/orchestration.py). The run folder (``run.json``, ``config.yaml``,
``data.json``, ``state/``) is what every node execution rebuilds its runtime from.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from prefect import flow

from bhfl_core.config.adapter_caveats import exact_caveats
from bhfl_core.config.schema import ExperimentConfig, dump
from bhfl_core.learning.adapter_check import check_adapter
from bhfl_core.store.atomic import write_text_atomic
from bhfl_core.store.run_layout import CONFIG_FILE
from flows import lifecycle, progress
from flows.launch import Launch
from flows.lifecycle import Attempt
from flows.orchestration import PLAIN_CALLS, PREFECT_RUNS
from flows.orchestration_protocol import Invocation, Orchestration
from flows.records.run_record import PipelineLink, RunRecord, new_run_path
from flows.records.run_state import RunStateError, check_saved_tree, load_run, resume_config
from flows.records.warm_source import resolve_init_from
from flows.run_attempt import run_attempt
from flows.run_tracking import parent_run_name
from flows.tracking.prefect_summary import prefect_tags

__all__ = [
    "PLAIN_CALLS",
    "PREFECT_RUNS",
    "ExperimentJob",
    "experiment_flow",
    "parent_run_name",
    "resume_experiment",
    "run_experiment",
]


@flow(name="bhfl-experiment", validate_parameters=False, flow_run_name=lifecycle.served_run_name)
def experiment_flow(
    config: ExperimentConfig | dict[str, Any],
    run_root: str,
    tracking_uri: str,
    run_path: str | None = None,
    cluster: str | None = None,
    force_eval: bool = False,
) -> dict[str, Any]:
    """Run one experiment end to end (or finish an interrupted one); returns where its results are.

    ``run_path``: the run folder, its record written by the job (flows/lifecycle.py; a
    resumed run's says so); None (a scheduled deployment run) makes a new run folder under
    ``run_root`` here. ``cluster``: the address of a local cluster already started for
    this run (the CLI starts it while Prefect starts); None starts one here when
    ``runtime.executor`` is ``local``. ``config`` is validated here only when it comes as
    plain data (a deployment run); ``bhfl run`` passes the config it validated.
    ``force_eval``: evaluate a finished run again (``resume_experiment``).
    """
    cfg = config if isinstance(config, ExperimentConfig) else ExperimentConfig.model_validate(config)
    launch = Launch(Path(run_root).resolve(), tracking_uri, PREFECT_RUNS, cluster)
    path = Path(run_path).resolve() if run_path else None
    if path is None or RunRecord.read(path) is None:  # not written yet (a deployment run): a new run
        cfg = resolve_init_from(cfg, launch.run_root)  # a warm start's source, checked before anything is written
        path = path or new_run_path(launch.run_root, cfg.name)
        ExperimentJob(cfg).create(launch, path)
    return run_attempt(cfg, launch, path, force_eval)


@dataclass(frozen=True)
class ExperimentJob:
    """An experiment run as a job of the lifecycle (flows/lifecycle.py): its config, where its MLflow parent run
    nests (``link``: a pipeline's or sweep's), and whether the attempt only evaluates it again (``force_eval``)."""

    config: ExperimentConfig
    link: PipelineLink | None = None
    force_eval: bool = False

    @property
    def counted(self) -> bool:
        return not self.force_eval  # a forced re-evaluation is no resume

    def create(self, launch: Launch, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(folder / CONFIG_FILE, yaml.safe_dump(dump(self.config), sort_keys=False))
        RunRecord(name=self.config.name, tracking_uri=launch.tracking_uri, pipeline=self.link).write(folder)

    def with_overrides(self, folder: Path, overrides: Sequence[str]) -> ExperimentJob:
        return replace(self, config=resume_config(folder, self.config, overrides))

    def invocation(self, launch: Launch, attempt: Attempt) -> Invocation[dict[str, Any]]:
        """The flow run is named after the config and the minute it started (or ``attempt.name``), marked
        ``resume`` or ``re-evaluate``, and tagged with the config's name, hash and seed."""
        action = "re-evaluate " if self.force_eval else "resume " if attempt.resume else ""
        name = action + (attempt.name or f"{self.config.name} {lifecycle.stamp()}")
        parameters = {
            "config": self.config,
            "run_root": str(launch.run_root),
            "tracking_uri": launch.tracking_uri,
            "run_path": str(attempt.folder),
            "cluster": launch.cluster,
            "force_eval": self.force_eval,
        }
        body = functools.partial(run_attempt, self.config, launch, attempt.folder, self.force_eval)
        return Invocation(experiment_flow, parameters, body, name, prefect_tags(self.config))


def start_run(
    config: ExperimentConfig,
    launch: Launch,
    run_path: Path | None = None,
    link: PipelineLink | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """A new run of ``config`` under ``launch`` (in ``run_path``, default a new ``<run_root>/<name>/<stamp>``).

    A ``model.init_from`` source and the adapter options (``check_adapter``: a ``SettingError``
    naming the key) are checked before anything is written or started; the adapter warnings (``check_adapter``,
    ``exact_caveats``) become progress notes.
    """
    config = resolve_init_from(config, launch.run_root)
    for warning in (*check_adapter(config.model, config.data.task), *exact_caveats(config)):
        progress.note(f"warning: {warning}")
    launch.run_root.mkdir(parents=True, exist_ok=True)
    path = (run_path or new_run_path(launch.run_root, config.name)).resolve()
    return lifecycle.run(ExperimentJob(config, link), launch, path, name)


def run_or_resume(
    link: PipelineLink,
    part: str,
    path: Path,
    launch: Launch,
    config: Callable[[], ExperimentConfig],
    overrides: Sequence[str] = (),
) -> None:
    """A sweep's point or a pipeline's stage (``part``: ``point``, ``stage``) in its run folder ``path``: resumed
    from its checkpoints where it started before, else started from ``config()``.

    Its flow run is named after it (``link.stage``); its progress notes start ``<part> <name>:``
    (the CLI's reporters follow them, flows/cli/sweep.py and pipeline.py).
    """
    who = f"{part} {link.stage}"
    if RunRecord.read(path) is not None:  # started before: continue it from its checkpoints
        progress.note(f"{who}: resuming {path}")
        resume_experiment(path, launch.orchestration, overrides, cluster=launch.cluster, flow_run_name=link.stage)
        return
    cfg = config()
    progress.note(f"{who}: {cfg.name} in {path}")
    start_run(cfg, launch, path, link, link.stage)


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
    (default: the run folder's timestamp). A ``model.init_from`` source and the adapter options are
    checked (ConfigError) before anything is written or started (``start_run``). Progress goes to the
    ``bhfl.progress`` logger (flows/progress.py).
    """
    launch = Launch.of(run_root, tracking_uri, orchestration, cluster)
    return start_run(config, launch, run_path, link, flow_run_name)


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
    if force_eval and record.status != "finished":
        raise RunStateError(f"run {run_path} is not finished: `bhfl resume` finishes it, evaluation included")
    check_saved_tree(run_path, config)
    job = ExperimentJob(config, force_eval=force_eval)
    return lifecycle.resume(job, run_path, record, orchestration, overrides, cluster, flow_run_name)
