"""One shape for every command that runs a job: ``bhfl run`` (an experiment or a pipeline), ``bhfl sweep``
and ``bhfl resume RUN|SWEEP|PIPELINE``.

A new job: its configs are checked before anything starts (one paragraph, exit 2); the
hub is probed (seconds), and adapter options that name modules are matched against the
model's module tree built without weights (bhfl_core/learning/adapter_check.py); then
the command's Prefect server (and, for one experiment on ``runtime.executor: local``,
its workers) boot in the background while the full
preflight runs, the MLflow store opens and the job's flow module is imported; the job
runs with its Prefect flow run's address printed and its progress shown; the command
ends with the kind's summary. A resume is the same without the checks a new job needs:
its folder must hold a job that can be resumed (a finished one has nothing to resume:
exit 0).

What differs between the kinds is a ``JobKind`` (flows/cli/run.py, sweep.py,
pipeline.py): its flow (to link its flow run) and the module that defines it, its
progress reporter, how failures are told, and its summary. The jobs themselves go
through the one lifecycle (flows/lifecycle.py). Heavy imports stay inside the functions.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from flows.cli.shell import (
    console,
    fail,
    guarded,
    hub_check,
    local_cluster,
    prefect_api,
    preflight,
    tracking_store_ready,
)
from tasks import collector

if TYPE_CHECKING:
    from bhfl_core.config.schema import ExperimentConfig
    from flows.launch import Launch
    from flows.progress import RichReporter
    from flows.records.run_record import ProcessRecord

Result = dict[str, Any]
T = TypeVar("T")  # what a resume reads of its job before it starts: a sweep's or a pipeline's saved config
Guard = Callable[[Callable[[], Result], Path | None, bool], Result]


@dataclass(frozen=True)
class JobKind:
    """How one kind of job shows at the terminal."""

    flow: tuple[str, str]  # its Prefect flow and the parameter naming its folder (flows/cli/prefect_link.py)
    module: str  # the module of its flow: imported while the Prefect server boots (seconds of CPU otherwise after)
    reporter: Callable[[], RichReporter]  # its progress on stderr
    summary: Callable[[Result, Path], None]  # its results on stdout
    guard: Guard = guarded  # failures as one paragraph and an exit code


def command_seconds() -> float:
    """Seconds since this command's process started: what the summaries' "done in" says, imports, the Prefect
    server and the workers included (the run's own ``time/total_s`` counts from its flow's start, 10-50 s less),
    so it agrees with the user's clock."""
    import psutil

    return time.time() - psutil.Process().create_time()


def start_forkserver(configs: Sequence[ExperimentConfig]) -> None:
    """Local workers' imports (torch, transformers) start now, beside the command's, if any job will want them."""
    from tasks.local_cluster import likely_cpu_workers, start_forkserver

    if any(c.runtime.executor == "local" and likely_cpu_workers(c.runtime) for c in configs):
        start_forkserver()


def _distinct(configs: Mapping[str, ExperimentConfig]) -> dict[str, ExperimentConfig]:
    """One config per (data, model), what the hub and data checks look at, under what a failed check says
    before its message: the first name sharing it (``"sweep point 'x,seed=0' (and 2 more): "``), or nothing
    when every config shares it (the mistake is the job's, not one experiment's)."""
    from bhfl_core.config.schema import dump

    groups: dict[str, list[tuple[str, ExperimentConfig]]] = {}
    for name, config in configs.items():
        data = dump(config)
        groups.setdefault(repr((data["data"], data["model"])), []).append((name, config))
    if len(groups) == 1:
        ((_, config), *_) = next(iter(groups.values()))
        return {"": config}
    named: dict[str, ExperimentConfig] = {}
    for (name, config), *others in groups.values():
        named[f"{name} (and {len(others)} more): " if others else f"{name}: "] = config
    return named


def _adapter_check(cfg: ExperimentConfig, where: str = "") -> None:
    """An adapter option naming modules (``model.adapter.target_modules``, ...) that no module of the model matches?
    Checked on the model built without weights (bhfl_core/learning/adapter_check.py), before Prefect, the run
    folder and the data: one line naming the key (after ``where``: which of a job's experiments), exit 2. (Its
    warnings are the run's to note: ``start_run``.)"""
    from bhfl_core.learning.adapter_check import names_modules

    if not names_modules(cfg.model.adapter):  # torch and transformers (~3 s) only where an option names modules
        return
    from bhfl_core.config.base import ConfigError
    from bhfl_core.learning.adapter_check import check_adapter

    try:
        check_adapter(cfg.model, cfg.data.task)
    except ConfigError as exc:
        fail(f"{where}{exc}")


def run_job(
    kind: JobKind,
    folder: Path,
    run_dir: Path,
    verbose: bool,
    work: Callable[[Launch], Result],
    announce: str,
    configs: Mapping[str, ExperimentConfig] | None = None,
    tracking_uri: str | None = None,
    cluster: ExperimentConfig | None = None,
) -> None:
    """Run ``work(launch)`` for the job in ``folder`` (the shape: module docstring).

    ``launch``: the run dir, the MLflow store (``tracking_uri`` or the run dir's), Prefect,
    and the address of the workers started beside Prefect for ``cluster`` (one
    experiment's config). ``configs``: a new job's configs, each under what a failed check
    names it by (``"sweep point 'x,seed=0'"``, ``"stage 'global'"``), checked before Prefect starts and
    beside it; none for a resume, which opens no MLflow store here: it takes its launch from
    its record.
    """
    checked = _distinct(configs or {})
    for where, config in checked.items():
        hub_check(config, run_dir, where)
        _adapter_check(config, where)
    from bhfl_core.config.base import ConfigError

    try:
        with prefect_api(run_dir, full=False, resume=folder) as api, _cluster(cluster, folder) as starting:
            for where, config in checked.items():
                preflight(config, run_dir, where)
            console.print(announce, highlight=False)
            uri = None
            if configs:  # the store opens and the flow's code loads while Prefect finishes starting
                uri = tracking_store_ready(run_dir, tracking_uri, api, kind.module)
            else:
                importlib.import_module(kind.module)
                api()
            from flows.cli.prefect_link import flow_run_link

            def job() -> Result:
                from flows.launch import Launch

                return work(Launch.of(run_dir, uri, cluster=starting.address() if starting is not None else None))

            link = flow_run_link(console, api.own, folder.resolve(), kind.flow, new=bool(configs))
            with link, kind.reporter().attached():
                collector.resume()  # the libraries are imported: frozen, and the collector on (tasks/collector.py)
                result = kind.guard(job, folder, verbose)
    except ConfigError as exc:
        fail(str(exc))
    kind.summary(result, run_dir)


@contextlib.contextmanager
def _cluster(config: ExperimentConfig | None, folder: Path) -> Iterator[Any]:
    """The experiment's local workers, booting beside Prefect (None: the job finds or starts its own)."""
    if config is None:
        yield None
        return
    with local_cluster(config, folder) as starting:
        yield starting


def check_overrides(overrides: Sequence[str], noun: str) -> None:
    """``bhfl resume --set``: only keys that do not change results, whatever the job and whether it finished;
    else one line naming the assignment (exit 2) before anything starts. (A finished job was told "nothing to
    resume" with a ``--set tree.root.rounds=5`` silently dropped; an unfinished one learnt it after Prefect's start.)"""
    from bhfl_core.config.base import ConfigError
    from flows.records.run_state import check_resume_overrides

    try:
        check_resume_overrides(overrides, noun)
    except ConfigError as exc:
        fail(str(exc))


def not_applied(overrides: Sequence[str]) -> str:
    """What a resume that runs nothing says of its ``--set``s: they change nothing (its config stays as it was)."""
    if not overrides:
        return ""
    sets = " ".join(f"--set {assignment}" for assignment in overrides)
    return f"; {sets} not applied: nothing runs, its config is unchanged"


def resumable(
    record_type: type[ProcessRecord], folder: Path, overrides: Sequence[str], read_config: Callable[[Path], T]
) -> T:
    """The saved config (``read_config``) of the job in ``folder`` if a resume has something to do; a finished
    job ends the command here (nothing of its record is touched; ``overrides`` said not to apply), one that
    cannot be resumed, or whose record or config is damaged, fails it in one line (exit 2: it was a traceback);
    before Prefect starts."""
    from flows.records.run_state import RunStateError

    try:
        if (record := record_type.read(folder)) is not None and record.status == "finished":
            console.print(
                f"[bold]bhfl[/] {record.NOUN} {folder} finished; nothing to resume" + not_applied(overrides),
                highlight=False,
            )
            raise typer.Exit(0)
        record_type.resumable(folder)
        return read_config(folder)
    except RunStateError as exc:
        fail(str(exc))
        raise  # unreachable: fail exits
