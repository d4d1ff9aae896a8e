"""A pipeline folder: ``pipeline.yaml`` (its resolved stage configs) and ``pipeline.json`` (its record).

``<run_root>/<pipeline name>/<stamp>/`` holds only these two files; each stage's run
is an ordinary run folder ``<run_root>/<stage experiment name>/<stamp>`` that the
record points at, so ``bhfl runs``, ``bhfl resume`` and the report work on a single
stage as on any run. The record is written atomically at every change (which stage
runs, which finished), so a pipeline killed at any moment can be resumed from it; a
stage's own ``run.json`` stays the truth about that stage.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from bhfl_core.config.pipeline import Pipeline, pipeline_from_dict
from bhfl_core.store.atomic import write_text_atomic
from flows.records.run_record import ProcessRecord, process_alive
from flows.records.run_state import RunStateError

PIPELINE_RECORD = "pipeline.json"
PIPELINE_CONFIG = "pipeline.yaml"
StageStatus = Literal["pending", "running", "finished", "failed"]


class StageRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    run_path: str = ""  # the stage's run folder, fixed when the stage first starts
    status: StageStatus = "pending"
    run_id: str = ""  # the stage's MLflow parent run
    logged: bool = False  # its headline metrics are on the pipeline's run


class PipelineRecord(ProcessRecord):
    run_id: str = ""  # the pipeline's MLflow run
    stages: dict[str, StageRecord] = Field(default_factory=dict)

    @classmethod
    def read(cls, folder: Path) -> PipelineRecord | None:
        path = folder / PIPELINE_RECORD
        return cls.model_validate_json(path.read_text()) if path.exists() else None

    def write(self, folder: Path) -> None:
        self.updated = time.time()
        write_text_atomic(folder / PIPELINE_RECORD, json.dumps(self.model_dump(), indent=2))

    @property
    def effective_status(self) -> str:
        """``running`` only while its process lives; a dead ``running`` pipeline was interrupted."""
        if self.status == "running" and not process_alive(self.host, self.pid):
            return "interrupted"
        return self.status


def resumable(folder: Path) -> PipelineRecord:
    """The record of a pipeline that can be resumed now (RunStateError: not a pipeline, running, finished)."""
    record = PipelineRecord.read(folder)
    if record is None:
        raise RunStateError(f"{folder} is not a pipeline folder (no {PIPELINE_RECORD})")
    if record.effective_status == "running":
        raise RunStateError(f"pipeline {folder} is still running (process {record.pid}); wait for it or stop it first")
    if record.status == "finished":
        raise RunStateError(f"pipeline {folder} finished: there is nothing to resume (`bhfl runs` lists its stages)")
    return record


def is_pipeline_folder(folder: Path) -> bool:
    return (folder / PIPELINE_RECORD).is_file() and (folder / PIPELINE_CONFIG).is_file()


def write_pipeline_config(folder: Path, pipeline: Pipeline) -> None:
    write_text_atomic(folder / PIPELINE_CONFIG, yaml.safe_dump(pipeline.dump(), sort_keys=False))


def read_pipeline_config(folder: Path) -> Pipeline:
    """The resolved pipeline of a pipeline folder (every stage's full config, validated again)."""
    return pipeline_from_dict(
        yaml.safe_load((folder / PIPELINE_CONFIG).read_text()), source=str(folder / PIPELINE_CONFIG)
    )


def find_pipeline(spec: str, run_dir: Path) -> Path | None:
    """The pipeline folder ``spec`` names (a path, or ``<name>/<stamp>`` under ``run_dir``), else None."""
    for candidate in (Path(spec), run_dir / spec):
        if is_pipeline_folder(candidate):
            return candidate.resolve()
    return None


def find_pipelines(run_dir: Path) -> list[Path]:
    """Pipeline folders under ``run_dir`` (``<name>/<stamp>/``), oldest first."""
    found = [p.parent for p in run_dir.glob(f"*/*/{PIPELINE_RECORD}") if is_pipeline_folder(p.parent)]
    return sorted(found, key=lambda p: (PipelineRecord.read(p) or PipelineRecord(name="")).started)
