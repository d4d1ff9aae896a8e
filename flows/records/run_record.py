"""``run.json``: what a run folder says about its run (status, MLflow ids, resumes).

Written atomically (temporary file + rename) at every change of status, so a run
killed at any moment leaves a readable record: ``bhfl runs`` and ``bhfl resume``
start from it. A record saying ``running`` whose process is gone is a run that was
killed (SIGKILL, power loss, OOM killer); one stopped by a signal it could act on
(Ctrl-C, SIGTERM, SIGHUP) says ``interrupted`` itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from signal import Signals
from typing import ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bhfl_core.store.atomic import write_text_atomic
from flows.services.stop_signals import signal_behind

RECORD_FILE = "run.json"
LOGGED_FILES = "run_files"  # RunRecord.logged: the parent run's config, data report and package list
Status = Literal["running", "finished", "failed", "interrupted"]


def new_run_path(run_root: Path, name: str) -> Path:
    """``<run_root>/<name>/<UTC timestamp>``: where a new run of ``name`` writes."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S-%f")[:-3]
    return run_root / name / stamp


def fresh_run_path(run_root: Path, name: str, taken: set[str]) -> Path:
    """A new run folder for ``name`` not in ``taken`` (a sweep's points start within a millisecond: the stamp's)."""
    while True:
        path = new_run_path(run_root, name)
        if str(path) not in taken and not path.exists():
            taken.add(str(path))
            return path
        time.sleep(0.002)


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
    """What the records of a run, a sweep and a pipeline share: who runs it, its status, its MLflow store,
    its attempts; read and written the same way (``FILE`` in the job's folder, atomically).

    A job's lifecycle (flows/lifecycle.py) moves every kind of record through the same
    states: written ``running`` when the job starts, ``resumed`` when an attempt continues
    it, ``ended`` (finished, or failed with its error) when the attempt ends.
    """

    model_config = ConfigDict(extra="ignore")
    FILE: ClassVar[str] = RECORD_FILE
    CONFIG: ClassVar[str] = "config.yaml"  # what the job runs, beside its record (bhfl_core/store/run_layout.py)
    NOUN: ClassVar[str] = "run"  # how messages name the job: run, sweep, pipeline

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

    @classmethod
    def read(cls, folder: Path) -> Self | None:
        """The record in ``folder``, None if it has none; RunStateError (naming the file) if it is damaged."""
        path = folder / cls.FILE
        if not path.exists():
            return None
        try:
            return cls.model_validate_json(path.read_text(encoding="utf-8"))
        except (ValidationError, UnicodeDecodeError) as exc:  # a truncated or hand-edited record: no traceback
            why = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
            raise RunStateError(f"{path}: damaged {cls.NOUN} record ({why})") from None

    def write(self, folder: Path) -> None:
        self.updated = time.time()
        write_text_atomic(folder / self.FILE, json.dumps(self.model_dump(), indent=2))

    def process_alive(self) -> bool:
        """Whether the process that last ran this job is still running (same host only)."""
        return process_alive(self.host, self.pid)

    @property
    def effective_status(self) -> str:
        """``running`` only while its process lives; a dead ``running`` job was interrupted."""
        if self.status == "running" and not self.process_alive():
            return "interrupted"
        return self.status

    @classmethod
    def holds(cls, folder: Path) -> bool:
        """Whether ``folder`` is a job folder of this kind (its record and its config)."""
        return (folder / cls.FILE).is_file() and (folder / cls.CONFIG).is_file()

    @classmethod
    def find(cls, spec: str, run_dir: Path) -> Path | None:
        """The job folder ``spec`` names (a path, or ``<name>/<stamp>`` under ``run_dir``), else None."""
        return next((c.resolve() for c in (Path(spec), run_dir / spec) if cls.holds(c)), None)

    @classmethod
    def find_all(cls, run_dir: Path) -> list[Path]:
        """The job folders of this kind under ``run_dir`` (``<name>/<stamp>/``), oldest first; one whose record
        is damaged first (a listing shows it as unreadable, the others as they are)."""
        found = [p.parent for p in run_dir.glob(f"*/*/{cls.FILE}") if cls.holds(p.parent)]
        return sorted(found, key=cls.started_at)

    @classmethod
    def started_at(cls, folder: Path) -> float:
        """When the job in ``folder`` started; 0 if its record is damaged (so one damaged record cannot stop a
        listing or a lookup among all the others)."""
        try:
            return (cls.read(folder) or cls(name="")).started
        except RunStateError:
            return 0.0

    @classmethod
    def run_ids(cls, folders: list[Path], field: str = "run_id") -> dict[Path, str]:
        """Each folder's MLflow run id (the record's ``field``); a damaged record has none here (it is named
        as unreadable where it is listed, and looking up another job by its id must still work)."""
        ids = {}
        for folder in folders:
            with contextlib.suppress(RunStateError):
                if (record := cls.read(folder)) is not None:
                    ids[folder] = str(getattr(record, field))
        return ids

    @classmethod
    def found(cls, folder: Path) -> Self:
        """The record in ``folder`` (RunStateError: no job of this kind there)."""
        record = cls.read(folder)
        if record is None:
            raise RunStateError(f"{folder} is not a {cls.NOUN} folder (no {cls.FILE})")
        return record

    @classmethod
    def resumable(cls, folder: Path) -> Self:
        """The record of a job that can be resumed now (RunStateError: no such job there, or ``check_resumable``)."""
        record = cls.found(folder)
        record.check_resumable(folder)
        return record

    def check_resumable(self, folder: Path) -> None:
        """RunStateError if the job in ``folder`` still runs: two processes must not write one job."""
        if self.effective_status == "running":
            raise RunStateError(
                f"{self.NOUN} {folder} is still running (process {self.pid}); wait for it or stop it first"
            )

    def resumed(self, counted: bool = True) -> Self:
        """The record as an attempt that continues the job sees it: running in this process (``counted``: a resume)."""
        resumes = self.resumes + int(counted)
        return self.model_copy(update={"status": "running", "pid": os.getpid(), "error": "", "resumes": resumes})

    def ended(self, error: BaseException | None = None) -> Self:
        """The record once the attempt ended: finished; interrupted if ``error`` is a stop (Ctrl-C, SIGTERM,
        SIGHUP: flows/services/stop_signals.py); else failed with ``error``'s type and text."""
        if error is None:
            return self.model_copy(update={"status": "finished", "error": ""})
        if (signum := signal_behind(error)) is not None:
            return self.model_copy(update={"status": "interrupted", "error": f"stopped by {Signals(signum).name}"})
        return self.model_copy(update={"status": "failed", "error": failure_text(error)})

    @classmethod
    def end_abandoned(cls, folder: Path, error: BaseException) -> None:
        """The record in ``folder`` ended by ``error`` where its own attempt could not say so: a sweep's point.

        A point runs in a thread of the sweep's process; a stop is raised in the main
        thread only, so the point's attempt never unwinds to write its end (its thread dies
        with the process) and its record would say ``running`` under a dead pid. Written
        only while it is this process's and still running: a job that ended by itself
        keeps what it wrote.
        """
        with contextlib.suppress(RunStateError, OSError):  # stopped before its folder or record existed
            record = cls.read(folder)
            if record is not None and record.status == "running" and record.pid == os.getpid():
                record.ended(error).write(folder)

    @property
    def mlflow_status(self) -> str:
        """The status its MLflow runs end with: FINISHED, KILLED (interrupted) or FAILED."""
        return {"finished": "FINISHED", "interrupted": "KILLED"}.get(self.status, "FAILED")


def failure_text(error: BaseException) -> str:
    """How a record keeps an error: its type and text, cut to what a JSON record and a terminal hold."""
    return f"{type(error).__name__}: {error}"[:2000]


class RunStateError(RuntimeError):
    """A job folder that cannot be resumed as asked (missing, still running, unreadable); says why."""


def unreadable_config(path: Path, noun: str, exc: BaseException) -> RunStateError:
    """Why a sweep's or a pipeline's saved config (``path``, which bhfl wrote) cannot be resumed from, and how
    to go on: one paragraph (it was a traceback for a damaged or non-UTF-8 ``sweep.yaml``)."""
    why = str(exc).removeprefix(f"{path}: ")
    return RunStateError(
        f"{path} cannot be read as the {noun} it ran ({why}). bhfl wrote it when the {noun} started: put it back "
        f"as it was to resume (a resume changes only runtime.* and eval.batch_size, with --set), or start a new "
        f"{noun} from your {noun} file"
    )


class RunRecord(ProcessRecord):
    """``run.json``: one experiment run's record (its MLflow runs, evaluations, workers, timeline)."""

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


def default_tracking_uri(run_root: Path) -> str:
    """The MLflow store of runs under ``run_root`` unless one is given: ``<run_root>/mlflow.db``."""
    return f"sqlite:///{(run_root / 'mlflow.db').resolve()}"
