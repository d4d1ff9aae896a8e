"""The ``prepare-data`` flow: data_prep's steps as Prefect tasks, cached on disk by fingerprint.

Flow shape (what the Prefect UI shows)::

    prepare-data
      load-pool -> partition -> proxy-split -> tokenizer -> tokenise -> assign-edges
      -> write-manifest -> partition-report

A cache hit (same fingerprint) runs no task at all and logs "no tokenisation". The
experiment flow calls this flow as a subflow; ``bhfl prepare`` runs it alone.
Steps receive their (in-process) inputs ``quote``-d, so Prefect does not walk Arrow
tables or numpy arrays looking for futures; nothing is persisted by Prefect (the
prepared folder is the result).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.settings import temporary_settings
from prefect.utilities.annotations import quote

from bhfl_core.config.schema import ExperimentConfig
from data_prep.manifest import Manifest
from data_prep.prepare import PreparedData, prepare_data
from flows import progress
from tasks.heap import release_garbage


@contextmanager
def no_heartbeats() -> Iterator[None]:
    """Flows started in the block send no heartbeats: they only detect crashed deployment runs, and off, each
    flow run ends ~1 s sooner. (Every flow this project starts itself: flows/orchestration.py, ``run_prepare``.)"""
    with temporary_settings(updates={"flows.heartbeat_frequency": None}):
        yield


def _task_step(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Run one preparation step as a Prefect task (no caching: the prepared folder is the cache).

    Its value is handed back around Prefect, not as the task's result: Prefect keeps a
    task's result record (and so the value) alive in its run states for as long as the
    command runs, and these values are the raw pool and its tokenised tables (~300 MB kept
    for the whole run at 10,000 clients).
    """
    held: list[Any] = []

    def run(*inputs: Any) -> None:
        held.append(fn(*inputs))

    run.__qualname__ = run.__name__ = getattr(fn, "__name__", name)
    step: Any = task(run, name=name, cache_policy=NO_CACHE, persist_result=False)  # type: ignore[call-overload]
    step(*[quote(a) for a in args])
    return held.pop()


@flow(name="prepare-data", validate_parameters=False)
def prepare_data_flow(config: ExperimentConfig | dict[str, Any], cache_root: str) -> dict[str, Any]:
    """Prepare (or reuse, by fingerprint) an experiment's data; returns the folder and whether it was cached.

    ``config`` is validated here only when it comes as plain data (a deployment or API
    call); in-process callers pass the config they already validated.
    """
    cfg = config if isinstance(config, ExperimentConfig) else ExperimentConfig.model_validate(config)
    logger = get_run_logger()

    def log(message: str) -> None:
        logger.info(message)
        progress.note(message)

    prepared = prepare_data(cfg, Path(cache_root), log=log, step=_task_step)
    return {"root": str(prepared.root), "cached": prepared.cached, "seconds": prepared.seconds}


def run_prepare(config: ExperimentConfig, cache_root: Path) -> PreparedData:
    """Prepare through the ``prepare-data`` flow (a subflow when called inside one).

    Progress goes to the ``bhfl.progress`` logger (flows/progress.py).
    """
    with no_heartbeats():
        out = prepare_data_flow.with_options(flow_run_name="prepare-data")(config, str(cache_root))
    if not out["cached"]:  # the preparation's tables outlive it in a reference cycle (tasks/heap.py); a hit held
        release_garbage()  # none, and a full collection of a process that froze no imports took ~1.7 s (2 cores)
    root = Path(out["root"])
    return PreparedData(root, Manifest.read(root), cached=out["cached"], seconds=out["seconds"])
