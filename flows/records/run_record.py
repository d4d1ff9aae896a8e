"""``run.json``: what a run folder says about its run (status, MLflow ids, resumes).

Written atomically (temporary file + rename) at every change of status, so a run
killed at any moment leaves a readable record: ``bhfl runs`` and ``bhfl resume``
start from it. A record saying ``running`` whose process is gone is a run that was
killed (SIGKILL, power loss, OOM killer).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from bhfl_core.store.atomic import write_text_atomic

RECORD_FILE = "run.json"
LOGGED_FILES = "run_files"  # RunRecord.logged: the parent run's config, data report and package list
Status = Literal["running", "finished", "failed"]


def new_run_path(run_root: Path, name: str) -> Path:
    """``<run_root>/<name>/<UTC timestamp>``: where a new run of ``name`` writes."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S-%f")[:-3]
    return run_root / name / stamp


def process_alive(host: str, pid: int) -> bool:
    """Whether process ``pid`` on ``host`` still runs (same host only: another host's process counts as gone)."""
    if host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PipelineLink(BaseModel):
    """A stage run's place in its pipeline (flows/pipeline.py): where its MLflow parent run nests."""

    model_config = ConfigDict(frozen=True)

    path: str  # the pipeline folder
    stage: str
    experiment: str  # the MLflow experiment (named after the pipeline)
    run_id: str  # the pipeline's MLflow run, parent of the stage's parent run


class ProcessRecord(BaseModel):
    """What a run's and a pipeline's record share: who runs it, its status, its MLflow store, its attempts."""

    model_config = ConfigDict(extra="ignore")

    name: str
    status: Status = "running"
    pid: int = Field(default_factory=os.getpid)
    host: str = Field(default_factory=socket.gethostname)
    started: float = Field(default_factory=time.time)
    updated: float = Field(default_factory=time.time)
    tracking_uri: str = ""
    # the MLflow tag value (bhfl.run_key) of the runs this record's process creates, written
    # before it creates them: a resume finds what a killed attempt created but never recorded
    run_key: str = Field(default_factory=lambda: uuid.uuid4().hex)
    experiment_id: str = ""
    resumes: int = 0
    error: str = ""


class RunRecord(ProcessRecord):
    parent_run_id: str = ""
    node_runs: dict[str, str] = {}
    evaluated_steps: list[int] = []
    # finished re-evaluations (`bhfl resume --force-eval`): the n-th is logged at step root rounds + n
    forced_evaluations: int = 0
    # MLflow logging phases finished (LOGGED_FILES: the parent run's files): a resume redoes the rest
    logged: list[str] = []
    # Where the run's worker calls go (so any process can execute any part of the tree):
    # the Dask scheduler's address ("" for runtime.executor: inprocess) and the workers
    # the run places work on (name, device, kind, host, pid), as found when this attempt started.
    cluster: str = ""
    workers: list[dict[str, str]] = []
    # calls that ran again because their worker was lost, every attempt's (tasks/executor.py: time, worker, call)
    worker_losses: list[dict[str, str | float]] = []
    # Wall-clock moments of the latest attempt (epoch seconds): process_start,
    # imports_done, flow_start, data_ready, tracking_ready, workers_ready,
    # first_training, last_aggregate, finished.
    timeline: dict[str, float] = {}
    pipeline: PipelineLink | None = None  # a pipeline's stage: its pipeline and MLflow nesting

    @classmethod
    def read(cls, run_path: Path) -> RunRecord | None:
        path = run_path / RECORD_FILE
        if not path.exists():
            return None
        return cls.model_validate_json(path.read_text())

    def write(self, run_path: Path) -> None:
        self.updated = time.time()
        write_text_atomic(run_path / RECORD_FILE, json.dumps(self.model_dump(), indent=2))

    def process_alive(self) -> bool:
        """Whether the process that last ran this run is still running (same host only)."""
        return process_alive(self.host, self.pid)

    @property
    def effective_status(self) -> str:
        """``running`` only while its process lives; a dead ``running`` run was interrupted."""
        if self.status == "running" and not self.process_alive():
            return "interrupted"
        return self.status


def default_tracking_uri(run_root: Path) -> str:
    """The MLflow store of runs under ``run_root`` unless one is given: ``<run_root>/mlflow.db``."""
    return f"sqlite:///{(run_root / 'mlflow.db').resolve()}"
