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
``orchestration=PLAIN_CALLS`` runs it all without Prefect (tests). ``bhfl serve
PIPELINE.yaml`` serves ``pipeline_deployment``: each scheduled run calls the flow with
the resolved pipeline and makes a new pipeline folder.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import flow

from bhfl_core.config.base import ConfigError
from bhfl_core.config.loader import config_from_dict
from bhfl_core.config.pipeline import Pipeline, Stage, pipeline_from_dict, with_init_from
from bhfl_core.config.schema import ExperimentConfig, dump
from bhfl_core.store.warm_start import KEY as INIT_FROM
from flows import lifecycle, progress
from flows.experiment import run_or_resume
from flows.launch import Launch
from flows.lifecycle import Attempt, finish_or_fail
from flows.orchestration import PLAIN_CALLS, PREFECT_RUNS
from flows.orchestration_protocol import Invocation, Orchestration
from flows.records.environment import git_commit
from flows.records.pipeline_record import (
    PIPELINE_CONFIG,
    PipelineRecord,
    StageRecord,
    read_pipeline_config,
    write_pipeline_config,
)
from flows.records.run_record import PipelineLink, RunRecord, new_run_path
from flows.records.warm_source import check_sources, resolve_init_from
from flows.tracking.tracker import Tracker

__all__ = [
    "PLAIN_CALLS",
    "PREFECT_RUNS",
    "PipelineJob",
    "check_sources",
    "pipeline_deployment",
    "pipeline_flow",
    "resume_pipeline",
    "run_pipeline",
    "serve_pipeline",
]

# a stage's parent-run metrics that go onto the pipeline's run (prefixed with the stage's name)
_HEADLINE_PARTS = ("_on_own_clients/", "gain_vs_local/")
_HEADLINE_PREFIXES = ("root/", "proximity/share_clients", "baseline/")  # baseline/: the trivial baselines
_SUMMED = ("comm/total_bytes", "comm/total_model_equivalents", "time/total_s")


def _stage_config(stage: Stage, record: PipelineRecord, launch: Launch) -> ExperimentConfig:
    """The stage's config with an earlier stage's reference replaced by its (finished) run folder."""
    if stage.source_stage is None:
        return stage.config
    source = record.stages[stage.source_stage].run_path
    config = with_init_from(stage, source)
    try:
        return resolve_init_from(config, launch.run_root)
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
    stage: Stage, path: Path, record: PipelineRecord, folder: Path, launch: Launch, overrides: Sequence[str]
) -> None:
    """Run (or resume) one stage in its run folder ``path``."""
    link = PipelineLink(path=str(folder), stage=stage.name, experiment=record.name, run_id=record.run_id)
    config = functools.partial(_stage_config, stage, record, launch)
    run_or_resume(link, "stage", path, launch, config, overrides)


def _open_run(tracker: Tracker, pipeline: Pipeline, record: PipelineRecord, folder: Path) -> None:
    """Create the pipeline's MLflow run (first attempt) or reopen it (a resume)."""
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
        seeds = {s.config.seed for s in pipeline}
        if len(seeds) == 1:  # as its stages' runs carry it: `tags.bhfl.seed = '0'` finds the pipeline too
            tags["bhfl.seed"] = str(seeds.pop())
        description = f"Pipeline `{pipeline.name}`: stages " + " -> ".join(pipeline.names) + "."
        stages = {s.name: dump(s.config) for s in pipeline}
        record.run_id = tracker.start_pipeline(
            pipeline.name, {"stages": stages}, tags, description, run_key=record.run_key
        )
        record.experiment_id = tracker.experiment_id
        record.write(folder)
    config = (folder / PIPELINE_CONFIG).read_text(encoding="utf-8")
    tracker.log_text(config, PIPELINE_CONFIG)  # every attempt: a kill may have cut it


def _run_stages(
    pipeline: Pipeline, record: PipelineRecord, folder: Path, launch: Launch, overrides: Sequence[str], tracker: Tracker
) -> None:
    """Every stage in order: finished ones kept, the interrupted one resumed, the rest started."""
    for stage in pipeline:
        entry = record.stages.setdefault(stage.name, StageRecord())
        path = Path(entry.run_path) if entry.run_path else new_run_path(launch.run_root, stage.config.name)
        stage_record = RunRecord.read(path)
        if stage_record is None or stage_record.status != "finished":
            entry.run_path, entry.status = str(path), "running"
            record.write(folder)
            _run_stage(stage, path, record, folder, launch, overrides)
            stage_record = RunRecord.read(path)
            assert stage_record is not None
        else:
            progress.note(f"stage {stage.name}: finished before, not run again ({path})")
        entry.status, entry.run_id = "finished", stage_record.parent_run_id
        if not entry.logged:
            _log_stage(tracker, stage.name, entry.run_id)
            entry.logged = True
        record.write(folder)


def _pipeline(folder: Path, launch: Launch, overrides: Sequence[str] = ()) -> dict[str, Any]:
    pipeline = read_pipeline_config(folder)
    record = PipelineRecord.found(folder)
    tracker = Tracker(record.tracking_uri, resumed=record.resumes > 0)
    _open_run(tracker, pipeline, record, folder)

    def work() -> tuple[dict[str, dict[str, float]], dict[str, float]]:
        _run_stages(pipeline, record, folder, launch, overrides, tracker)
        totals = _log_totals(tracker, pipeline, record)
        tracker.finish("FINISHED")
        return totals

    def end(error: BaseException | None) -> None:
        ended = record.ended(error)
        if error is not None:
            for entry in ended.stages.values():
                if entry.status == "running":
                    entry.status = ended.status  # failed, or interrupted (a stop)
        ended.write(folder)
        if error is not None:
            tracker.finish(ended.mlflow_status)

    metrics, totals = finish_or_fail(work, end)
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
    }


@flow(name="bhfl-pipeline", validate_parameters=False, flow_run_name=lifecycle.served_run_name)
def pipeline_flow(
    pipeline_path: str | None = None,
    overrides: list[str] | None = None,
    pipeline: dict[str, Any] | None = None,
    run_root: str | None = None,
    tracking_uri: str | None = None,
) -> dict[str, Any]:
    """Run the pipeline in ``pipeline_path`` (its ``pipeline.yaml`` and ``pipeline.json``), or finish it.

    Without ``pipeline_path`` (a scheduled deployment run, ``bhfl serve PIPELINE.yaml``) a
    new pipeline folder is made under ``run_root`` from ``pipeline`` (a resolved pipeline,
    ``Pipeline.dump``), its run-folder warm starts checked again first (a source deleted
    since the deployment was registered fails the run before anything is written). Each
    stage is a ``bhfl-experiment`` subflow named after the stage.
    """
    if pipeline_path is None:
        if pipeline is None or run_root is None:
            raise ConfigError("bhfl-pipeline: give pipeline_path, or pipeline and run_root (a new pipeline)")
        new = Launch.of(Path(run_root), tracking_uri)
        resolved = check_sources(pipeline_from_dict(pipeline, source="bhfl-pipeline parameters"), new.run_root)
        pipeline_path = str(new_run_path(new.run_root, resolved.name))
        PipelineJob(resolved).create(new, Path(pipeline_path))
    folder = Path(pipeline_path).resolve()
    launch = Launch.at(folder, PipelineRecord.found(folder), PREFECT_RUNS)
    return _pipeline(folder, launch, overrides or ())


@dataclass(frozen=True)
class PipelineJob:
    """A pipeline as a job of the lifecycle (flows/lifecycle.py); ``pipeline``: a new pipeline's stages (a
    resume reads them from its folder)."""

    pipeline: Pipeline | None = None
    counted = True

    def create(self, launch: Launch, folder: Path) -> None:
        """``pipeline.yaml`` (every stage's resolved config) and ``pipeline.json`` with every stage pending."""
        assert self.pipeline is not None, "a new pipeline folder needs the pipeline"
        folder.mkdir(parents=True, exist_ok=True)
        write_pipeline_config(folder, self.pipeline)
        stages = {s.name: StageRecord() for s in self.pipeline}
        PipelineRecord(name=self.pipeline.name, tracking_uri=launch.tracking_uri, stages=stages).write(folder)

    def with_overrides(self, folder: Path, overrides: Sequence[str]) -> PipelineJob:
        """The stages not started yet take the change now; the interrupted one when it resumes."""
        record = PipelineRecord.found(folder)
        pipeline = read_pipeline_config(folder)
        for stage in pipeline:
            entry = record.stages.get(stage.name)
            if entry is None or not entry.run_path:
                config = config_from_dict(dump(stage.config), overrides, source=f"{folder}: stages.{stage.name}")
                pipeline = pipeline.replace_stage(Stage(stage.name, config, stage.source_stage))
        write_pipeline_config(folder, pipeline)
        return self

    def invocation(self, launch: Launch, attempt: Attempt) -> Invocation[dict[str, Any]]:
        parameters = {"pipeline_path": str(attempt.folder), "overrides": list(attempt.overrides)}
        body = functools.partial(_pipeline, attempt.folder, launch, attempt.overrides)
        # named as an experiment's and a served pipeline's: its name and the minute it started (it was the folder's
        # stamp, which says nothing in the Prefect UI's list)
        name = f"{PipelineRecord.found(attempt.folder).name} {lifecycle.stamp()}"
        return Invocation(pipeline_flow, parameters, body, attempt.flow_run_name(name))


def start_pipeline(pipeline: Pipeline, launch: Launch, folder: Path | None = None) -> dict[str, Any]:
    """A new pipeline under ``launch``, in ``folder`` (default: a new ``<run_root>/<pipeline>/<timestamp>``).

    Run-folder warm starts are checked (ConfigError) before anything is written.
    """
    pipeline = check_sources(pipeline, launch.run_root)
    launch.run_root.mkdir(parents=True, exist_ok=True)
    folder = (folder or new_run_path(launch.run_root, pipeline.name)).resolve()
    # the stages' run folders and data cache: beside the pipeline folder (<run_root>/<pipeline>/<stamp>)
    return lifecycle.run(PipelineJob(pipeline), launch.under(folder.parents[1]), folder)


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
    return start_pipeline(pipeline, Launch.of(run_root, tracking_uri, orchestration), folder)


def resume_pipeline(
    folder: Path, orchestration: Orchestration = PREFECT_RUNS, overrides: Sequence[str] = ()
) -> dict[str, Any]:
    """Finish the pipeline in ``folder``: finished stages are kept, the interrupted one resumes, the rest run.

    ``overrides`` may change only ``runtime.*`` and ``eval.batch_size`` (as for ``bhfl
    resume``): of the interrupted stage and of the stages still to run.
    """
    folder = folder.resolve()
    return lifecycle.resume(PipelineJob(), folder, PipelineRecord.found(folder), orchestration, overrides)


def pipeline_deployment(pipeline: Pipeline, cron: str, name: str, run_root: Path, tracking_uri: str) -> Any:
    """The deployment ``bhfl-pipeline/<name>``: every scheduled run is a new pipeline folder of the resolved stages.

    Its parameters are the resolved pipeline (every stage's full config, run-folder warm
    starts absolute), as ``bhfl serve`` does for one experiment (flows/serve.py), so each
    run computes the same stages.
    """
    from prefect.deployments.runner import EntrypointType

    return pipeline_flow.to_deployment(
        name=name,
        cron=cron,
        parameters={"pipeline": pipeline.dump(), "run_root": str(run_root), "tracking_uri": tracking_uri},
        description=f"B-HFL pipeline `{pipeline.name}` (stages "
        + " -> ".join(pipeline.names)
        + f") on a schedule: {cron}",
        tags=["bhfl", "pipeline", pipeline.name],
        enforce_parameter_schema=False,
        entrypoint_type=EntrypointType.MODULE_PATH,  # runs from any working directory
    )


def serve_pipeline(pipeline: Pipeline, cron: str, name: str, run_root: Path, tracking_uri: str) -> None:
    """Register the deployment ``bhfl-pipeline/<name>`` and serve it until interrupted."""
    from flows.serve import serve_deployment

    serve_deployment(pipeline_deployment(pipeline, cron, name, run_root, tracking_uri))
