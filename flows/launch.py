"""Where a job runs and what it reports to: one frozen value, fixed when the job starts.

A job (an experiment, a sweep, a pipeline) and every job it starts (a sweep's points, a
pipeline's stages) need the same five facts: the folder of run folders, the data cache
(``<run_root>/cache`` or ``$BHFL_DATA_CACHE``: data_prep/cache_folder.py), the MLflow store,
the orchestration, and the address of a worker cluster already started for it. They
travel together as a ``Launch`` rather than one argument each through every signature;
a job that starts its own cluster passes its points ``launch.on(address)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from data_prep.cache_folder import data_cache_folder
from flows.orchestration import PREFECT_RUNS
from flows.orchestration_protocol import Orchestration
from flows.records.run_record import ProcessRecord, default_tracking_uri


@dataclass(frozen=True)
class Launch:
    """A job's run identities: ``run_root`` (``<run_root>/<name>/<stamp>`` folders), ``tracking_uri``,
    ``orchestration``, ``cluster`` (a local cluster's address already started for it; None: the job finds or
    starts its executor from its config) and ``data_cache`` (read from the environment when the launch is made,
    unless given)."""

    run_root: Path
    tracking_uri: str
    orchestration: Orchestration = PREFECT_RUNS
    cluster: str | None = None
    # the job is the only one in its process: it may set the process's torch threads (a sweep's points
    # run as threads of one process, and their sweep sets them once: ``for_points``)
    sole: bool = True
    # None when made: filled in by __post_init__ (from the environment), so a launch always holds one
    data_cache: Path = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.data_cache is None:
            object.__setattr__(self, "data_cache", data_cache_folder(self.run_root))

    @classmethod
    def of(
        cls,
        run_root: Path,
        tracking_uri: str | None = None,
        orchestration: Orchestration = PREFECT_RUNS,
        cluster: str | None = None,
    ) -> Launch:
        """A new job's launch: ``run_root`` made absolute, the MLflow store defaulting to ``<run_root>/mlflow.db``."""
        root = run_root.resolve()
        return cls(root, tracking_uri or default_tracking_uri(root), orchestration, cluster)

    @classmethod
    def at(
        cls, folder: Path, record: ProcessRecord, orchestration: Orchestration, cluster: str | None = None
    ) -> Launch:
        """The launch of the job in ``folder`` (``<run_root>/<name>/<stamp>``), its record written: its MLflow store."""
        return cls(folder.parents[1], record.tracking_uri, orchestration, cluster)

    def under(self, run_root: Path) -> Launch:
        """The same launch with its run folders (and, unless ``$BHFL_DATA_CACHE`` names one, its data cache) under
        ``run_root``: where a sweep's points and a pipeline's stages go, beside the job's own folder."""
        return replace(self, run_root=run_root, data_cache=data_cache_folder(run_root))

    def on(self, cluster: str | None) -> Launch:
        """The same launch with its jobs' workers at ``cluster``."""
        return replace(self, cluster=cluster)

    def for_points(self, cluster: str | None) -> Launch:
        """The launch of a sweep's points: at ``cluster``, and sharing their process (``sole`` False)."""
        return replace(self, cluster=cluster, sole=False)
