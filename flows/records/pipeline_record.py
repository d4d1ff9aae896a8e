"""A pipeline folder: ``pipeline.yaml`` (its resolved stage configs) and ``pipeline.json`` (its record).

``<run_root>/<pipeline name>/<stamp>/`` holds only these two files; each stage's run
is an ordinary run folder ``<run_root>/<stage experiment name>/<stamp>`` that the
record points at, so ``bhfl runs``, ``bhfl resume`` and the report work on a single
stage as on any run. The record is written atomically at every change (which stage
runs, which finished), so a pipeline killed at any moment can be resumed from it; a
stage's own ``run.json`` stays the truth about that stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from bhfl_core.config.base import ConfigError
from bhfl_core.config.pipeline import Pipeline, pipeline_from_dict
from bhfl_core.store.atomic import write_text_atomic
from flows.records.run_record import ProcessRecord, RunStateError, unreadable_config

PIPELINE_RECORD = "pipeline.json"
PIPELINE_CONFIG = "pipeline.yaml"
StageStatus = Literal["pending", "running", "finished", "failed", "interrupted"]


class StageRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    run_path: str = ""  # the stage's run folder, fixed when the stage first starts
    status: StageStatus = "pending"
    run_id: str = ""  # the stage's MLflow parent run
    logged: bool = False  # its headline metrics are on the pipeline's run


class PipelineRecord(ProcessRecord):
    FILE: ClassVar[str] = PIPELINE_RECORD
    CONFIG: ClassVar[str] = PIPELINE_CONFIG
    NOUN: ClassVar[str] = "pipeline"

    run_id: str = ""  # the pipeline's MLflow run
    stages: dict[str, StageRecord] = Field(default_factory=dict)

    def check_resumable(self, folder: Path) -> None:
        """As for any job (not while it runs), and a finished pipeline has nothing left to resume."""
        super().check_resumable(folder)
        if self.status == "finished":
            raise RunStateError(
                f"pipeline {folder} finished: there is nothing to resume (`bhfl runs` lists its stages)"
            )


def write_pipeline_config(folder: Path, pipeline: Pipeline) -> None:
    write_text_atomic(folder / PIPELINE_CONFIG, yaml.safe_dump(pipeline.dump(), sort_keys=False))


def read_pipeline_config(folder: Path) -> Pipeline:
    """The resolved pipeline of a pipeline folder (every stage's full config, validated again).

    RunStateError (one paragraph, exit 2 at the command line) if the file is missing or
    no longer a valid pipeline, e.g. edited by hand since the pipeline started: a resume
    met it as a traceback.
    """
    path = folder / PIPELINE_CONFIG
    try:
        return pipeline_from_dict(yaml.safe_load(path.read_text(encoding="utf-8")), source=str(path))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ConfigError) as exc:
        raise unreadable_config(path, "pipeline", exc) from None
