"""A sweep folder: ``sweep.yaml`` (its resolved point configs) and ``sweep.json`` (its record).

``<run_root>/<sweep name>/<stamp>/`` holds only these two files; each point's run is an
ordinary run folder ``<run_root>/<experiment name>/<stamp>`` that the record points at,
so ``bhfl runs``, ``bhfl resume`` and the report work on one point as on any run. The
record maps each point's label to its config hash, run folder, status and MLflow run,
and is written atomically at every change (several points run at once, so writes are
serialised by the sweep flow), so a sweep killed at any moment can be resumed from it;
a point's own ``run.json`` stays the truth about that point.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from bhfl_core.config.base import ConfigError
from bhfl_core.config.sweep import Sweep, sweep_from_dump
from bhfl_core.store.atomic import write_text_atomic
from flows.records.run_record import ProcessRecord, RunRecord, unreadable_config

SWEEP_RECORD = "sweep.json"
SWEEP_CONFIG = "sweep.yaml"
PointStatus = Literal["pending", "running", "finished", "failed", "interrupted"]


class PointRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    config_hash: str  # bhfl_core/config/sweep.py config_hash: how a resumed or re-run sweep finds this run
    values: dict[str, Any] = Field(default_factory=dict)  # what the point sweeps: key -> value
    run_path: str = ""  # the point's run folder, fixed when it first starts
    status: PointStatus = "pending"
    run_id: str = ""  # the point's MLflow parent run
    error: str = ""

    def run_finished(self) -> bool:
        """Whether the point's run folder says its run finished (its ``run.json`` is the truth)."""
        run = RunRecord.read(Path(self.run_path)) if self.run_path else None
        return run is not None and run.status == "finished"


class SweepRecord(ProcessRecord):
    FILE: ClassVar[str] = SWEEP_RECORD
    CONFIG: ClassVar[str] = SWEEP_CONFIG
    NOUN: ClassVar[str] = "sweep"

    run_id: str = ""  # the sweep's MLflow run
    parallel: int = 0  # experiments run at once in the latest attempt
    points: dict[str, PointRecord] = Field(default_factory=dict)

    def by_hash(self) -> dict[str, PointRecord]:
        return {p.config_hash: p for p in self.points.values()}


def write_sweep_config(folder: Path, sweep: Sweep) -> None:
    write_text_atomic(folder / SWEEP_CONFIG, yaml.safe_dump(sweep.dump(), sort_keys=False))


def read_sweep_config(folder: Path) -> Sweep:
    """The resolved sweep of a sweep folder (every point's full config, validated again); RunStateError (one
    paragraph, exit 2 at the command line) if the file is missing, not UTF-8 or no longer a valid sweep."""
    path = folder / SWEEP_CONFIG
    try:
        return sweep_from_dump(yaml.safe_load(path.read_text(encoding="utf-8")), source=str(path))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ConfigError) as exc:
        raise unreadable_config(path, "sweep", exc) from None
