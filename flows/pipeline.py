"""A pipeline as a Prefect flow: its stages run one after another, each an experiment run (a subflow).

Flow shape (what the Prefect UI shows)::

    bhfl-pipeline                   (one per pipeline run)
      global                        (bhfl-experiment subflow, named after the stage)
        prepare-data, node: root, ...
      group
      personal

Folders: ``<run_root>/<pipeline>/<stamp>/`` holds ``pipeline.yaml`` (the resolved
stage configs) and ``pipeline.json`` (status, MLflow ids, stage -> run folder and
status; flows/records/pipeline_record.py). Every stage is an ordinary run folder.

MLflow: the pipeline's run lives in an experiment named after the pipeline; each
stage's parent run is created in that experiment, nested under it (so the UI shows
pipeline -> stage -> root -> servers). The pipeline's run gets the pipeline config as
an artefact, each stage's headline metrics prefixed with the stage name
(``personal/client_on_own_clients/accuracy_mean``) and, unprefixed, the last stage's
headlines with communication and time summed over the stages, so ``bhfl compare
<pipeline>`` sets a pipeline beside single runs.

A stage whose ``model.init_from`` names an earlier stage starts from that stage's run
folder, resolved (and checked) when it starts. Resume (``resume_pipeline``, or calling
the flow again on the folder) skips finished stages, resumes the interrupted one from
its checkpoints and starts the rest, under the same MLflow pipeline run.
``orchestration=PLAIN_CALLS`` runs it all without Prefect (tests).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.settings import temporary_settings

from bhfl_core.config.base import ConfigError
from bhfl_core.config.loader import config_from_dict
from bhfl_core.config.pipeline import Pipeline, Stage, with_init_from
from bhfl_core.config.schema import ExperimentConfig, dump
from bhfl_core.store.warm_start import KEY as INIT_FROM
from bhfl_core.store.warm_start import parse_init_from
from flows import progress
from flows.experiment import resume_experiment, run_experiment
from flows.node_runtime import Orchestration
from flows.records.environment import git_commit
from flows.records.pipeline_record import (
    PIPELINE_CONFIG,
    PipelineRecord,
    StageRecord,
    read_pipeline_config,
    resumable,
    write_pipeline_config,
)
from flows.records.run_record import PipelineLink, RunRecord, default_tracking_uri, new_run_path
from flows.records.run_state import RESUME_OVERRIDABLE
from flows.records.warm_source import resolve_init_from
from flows.tracking.tracker import Tracker
from flows.training import PLAIN_CALLS, PREFECT_RUNS, thread_task_runner

__all__ = ["PLAIN_CALLS", "PREFECT_RUNS", "check_sources", "pipeline_flow", "resume_pipeline", "run_pipeline"]

# a stage's parent-run metrics that go onto the pipeline's run (prefixed with the stage's name)
_HEADLINE_PARTS = ("_on_own_clients/", "gain_vs_local/")
_HEADLINE_PREFIXES = ("root/", "proximity/share_clients")
_SUMMED = ("comm/total_bytes", "comm/total_model_equivalents", "time/total_s")


def check_sources(pipeline: Pipeline, run_dir: Path) -> Pipeline:
    """The pipeline with every run-folder ``model.init_from`` found, checked and made absolute.

    Stage references are left for their stage's start; a value that is neither an earlier
    stage nor a run folder is a ConfigError naming the stage, the key and the value.
    """
    for stage in pipeline:
        if stage.config.model.init_from is None or stage.source_stage is not None:
            continue
        where = f"stages.{stage.name}"
        try:
            config = resolve_init_from(stage.config, run_dir)
        except ConfigError as exc:
            spec = parse_init_from(stage.config.model.init_from)
            hint = (
                f" (and no stage of this pipeline is called {spec.run!r}: stages {', '.join(pipeline.names)})"
                if "/" not in spec.run
                else ""
            )
            raise ConfigError(f"{where}: {exc}{hint}") from None
        pipeline = pipeline.replace_stage(Stage(stage.name, config))
    return pipeline


def _stage_config(stage: Stage, record: PipelineRecord, run_root: Path) -> ExperimentConfig:
    """The stage's config with an earlier stage's reference replaced by its (finished) run folder."""
    if stage.source_stage is None:
        return stage.config
    source = record.stages[stage.source_stage].run_path
    config = with_init_from(stage, source)
    try:
        return resolve_init_from(config, run_root)
    except ConfigError as exc:
        raise ConfigError(f"stages.{stage.name}: {INIT_FROM} {stage.config.model.init_from!r}: {exc}") from None


def _headlines(metrics: dict[str, float]) -> dict[str, float]:
    return {
        k: v
        for k, v in metrics.items()
        if any(p in k for p in _HEADLINE_PARTS) or k.startswith(_HEADLINE_PREFIXES) or k in _SUMMED
    }


def _log_stage(tracker: Tracker, stage: str, run_id: str) -> None:
    values = _headlines(tracker.metrics(run_id))
    tracker.log_metrics(tracker.parent_id, {f"{stage}/{k}": v for k, v in values.items()}, step=0)


def _log_totals(
    tracker: Tracker, pipeline: Pipeline, record: PipelineRecord
) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Log the last stage's headlines, unprefixed, with communication and time summed over the stages.

    Returns every stage's headlines and what was logged.
    """
    per_stage = {s.name: _headlines(tracker.metrics(record.stages[s.name].run_id)) for s in pipeline}
    totals = dict(per_stage[pipeline.names[-1]])
    for key in _SUMMED:
        totals[key] = sum(m.get(key, 0.0) for m in per_stage.values())
    tracker.log_metrics(tracker.parent_id, totals, step=0)
    return per_stage, totals


def _run_stage(
    stage: Stage,
    path: Path,
    record: PipelineRecord,
    folder: Path,
    orchestration: Orchestration,
    overrides: Sequence[str],
) -> None:
    """Run (or resume) one stage in its run folder ``path``."""
    run_root = folder.parents[1]
    if RunRecord.read(path) is not None:  # started before: continue it from its checkpoints
        progress.note(f"stage {stage.name}: resuming {path}")
        resume_experiment(path, orchestration, overrides=overrides, flow_run_name=stage.name)
        return
    config = _stage_config(stage, record, run_root)
    link = PipelineLink(path=str(folder), stage=stage.name, experiment=record.name, run_id=record.run_id)
    progress.note(f"stage {stage.name}: {config.name} in {path}")
    run_experiment(
        config, run_root, record.tracking_uri, orchestration, run_path=path, link=link, flow_run_name=stage.name
    )


def _pipeline(folder: Path, orchestration: Orchestration, overrides: Sequence[str] = ()) -> dict[str, Any]:
    started = time.time()
    pipeline = read_pipeline_config(folder)
    record = PipelineRecord.read(folder)
    assert record is not None, f"{folder} has no pipeline record"
    tracker = Tracker(record.tracking_uri, resumed=record.resumes > 0)
    if record.run_id:
        tracker.reopen_run(record.experiment_id, record.run_id, record.resumes)
    else:
        tags = {
            "bhfl.kind": "pipeline",
            "bhfl.pipeline_path": str(folder),
            "bhfl.git_commit": git_commit(),
            "bhfl.python": platform.python_version(),
            "bhfl.task": pipeline.stages[-1].config.data.task,
        }
        description = f"Pipeline `{pipeline.name}`: stages " + " -> ".join(pipeline.names) + "."
        stages = {s.name: dump(s.config) for s in pipeline}
        record.run_id = tracker.start_pipeline(
            pipeline.name, {"stages": stages}, tags, description, run_key=record.run_key
        )
        record.experiment_id = tracker.experiment_id
        record.write(folder)
    tracker.log_text((folder / PIPELINE_CONFIG).read_text(), PIPELINE_CONFIG)  # every attempt: a kill may have cut it
    run_root = folder.parents[1]
    try:
        for stage in pipeline:
            entry = record.stages.setdefault(stage.name, StageRecord())
            path = Path(entry.run_path) if entry.run_path else new_run_path(run_root, stage.config.name)
            stage_record = RunRecord.read(path)
            if stage_record is None or stage_record.status != "finished":
                entry.run_path, entry.status = str(path), "running"
                record.write(folder)
                _run_stage(stage, path, record, folder, orchestration, overrides)
                stage_record = RunRecord.read(path)
                assert stage_record is not None
            else:
                progress.note(f"stage {stage.name}: finished before, not run again ({path})")
            entry.status, entry.run_id = "finished", stage_record.parent_run_id
            if not entry.logged:
                _log_stage(tracker, stage.name, entry.run_id)
                entry.logged = True
            record.write(folder)
        metrics, totals = _log_totals(tracker, pipeline, record)
        tracker.finish("FINISHED")
        record.status = "finished"
        record.write(folder)
    except BaseException as exc:
        for entry in record.stages.values():
            if entry.status == "running":
                entry.status = "failed"
        record.status, record.error = "failed", f"{type(exc).__name__}: {exc}"[:2000]
        record.write(folder)
        tracker.finish("FAILED")
        raise
    return {
        "pipeline_path": str(folder),
        "name": pipeline.name,
        "tracking_uri": record.tracking_uri,
        "experiment_id": record.experiment_id,
        "run_id": record.run_id,
        "stages": {name: entry.model_dump() for name, entry in record.stages.items()},
        "tasks": {s.name: s.config.data.task for s in pipeline},
        "metrics": metrics,  # stage -> its headline metrics
        "totals": totals,  # the last stage's headlines; communication and time summed over the stages
        "resumes": record.resumes,
        "wall_time_s": time.time() - started,
    }


@flow(name="bhfl-pipeline", validate_parameters=False)
def pipeline_flow(pipeline_path: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """Run the pipeline in ``pipeline_path`` (its ``pipeline.yaml`` and ``pipeline.json``), or finish it.

    Each stage is a ``bhfl-experiment`` subflow named after the stage.
    """
    return _pipeline(Path(pipeline_path), PREFECT_RUNS, overrides or ())


def _invoke(folder: Path, orchestration: Orchestration, overrides: Sequence[str], resume: bool) -> dict[str, Any]:
    if orchestration is not PREFECT_RUNS:
        return _pipeline(folder, orchestration, overrides)
    # as for an experiment (flows/experiment.py): heartbeats only help deployment runs
    with temporary_settings(updates={"flows.heartbeat_frequency": None}):
        name = f"resume {folder.name}" if resume else folder.name
        flow_ = pipeline_flow.with_options(flow_run_name=name, task_runner=thread_task_runner())
        return flow_(str(folder), list(overrides))


def run_pipeline(
    pipeline: Pipeline,
    run_root: Path,
    tracking_uri: str | None = None,
    orchestration: Orchestration = PREFECT_RUNS,
    folder: Path | None = None,
) -> dict[str, Any]:
    """Run every stage of ``pipeline`` in order (Prefect's server unless PREFECT_API_URL is set, or PLAIN_CALLS).

    Run-folder warm starts are checked (ConfigError) before anything is written;
    ``folder`` (default: a new ``<run_root>/<pipeline>/<timestamp>``) is the pipeline folder.
    """
    run_root = run_root.resolve()
    pipeline = check_sources(pipeline, run_root)
    run_root.mkdir(parents=True, exist_ok=True)
    folder = (folder or new_run_path(run_root, pipeline.name)).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    write_pipeline_config(folder, pipeline)
    record = PipelineRecord(
        name=pipeline.name,
        tracking_uri=tracking_uri or default_tracking_uri(run_root),
        stages={s.name: StageRecord() for s in pipeline},
    )
    record.write(folder)
    return _invoke(folder, orchestration, (), resume=False)


def resume_pipeline(
    folder: Path, orchestration: Orchestration = PREFECT_RUNS, overrides: Sequence[str] = ()
) -> dict[str, Any]:
    """Finish the pipeline in ``folder``: finished stages are kept, the interrupted one resumes, the rest run.

    ``overrides`` may change only ``runtime.*`` and ``eval.batch_size`` (as for ``bhfl
    resume``): of the interrupted stage and of the stages still to run.
    """
    folder = folder.resolve()
    record = resumable(folder)
    for assignment in overrides:
        if not assignment.split("=", 1)[0].strip().startswith(RESUME_OVERRIDABLE):
            raise ConfigError(
                f"--set {assignment}: a resumed pipeline keeps its config; only runtime.* and eval.batch_size "
                "may change (they do not change results). Start a new pipeline instead."
            )
    if overrides:  # the stages not started yet take the change now; the interrupted one when it resumes
        pipeline = read_pipeline_config(folder)
        for stage in pipeline:
            entry = record.stages.get(stage.name)
            if entry is None or not entry.run_path:
                config = config_from_dict(dump(stage.config), overrides, source=f"{folder}: stages.{stage.name}")
                pipeline = pipeline.replace_stage(Stage(stage.name, config, stage.source_stage))
        write_pipeline_config(folder, pipeline)
    record = record.model_copy(
        update={"status": "running", "pid": os.getpid(), "error": "", "resumes": record.resumes + 1}
    )
    record.write(folder)
    return _invoke(folder, orchestration, overrides, resume=True)
