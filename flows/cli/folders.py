"""``bhfl runs``, ``bhfl sync`` and ``bhfl export``: what a run folder holds, read without running anything.

``runs`` lists runs and pipelines with their status and what a resume would redo (from
the records and the checkpoint headers: no torch, Prefect or MLflow imported); ``sync``
delivers the tracking calls a run kept for its tracking server; ``export`` writes a
node's model with its tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from flows.cli.job_lines import print_header
from flows.cli.options import DEFAULT_RUN_DIR, JsonOption, RunDirOption, RunSpecArgument, runs_folder_of
from flows.cli.shell import console, fail, out, prepare_environment, print_json

if TYPE_CHECKING:
    from flows.records.listing import RunSummary


def sync(
    run_spec: RunSpecArgument,
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    wait: Annotated[
        float | None,
        typer.Option(
            "--wait",
            metavar="SECONDS",
            min=0,
            show_default="$BHFL_TRACKING_WAIT_S, else 120",
            help="How long to wait for the tracking server to answer.",
        ),
    ] = None,
) -> None:
    """Deliver the MLflow tracking calls a run kept because its tracking server was down (exit 3 if some are left)."""
    run_dir = runs_folder_of(run_spec, run_dir)
    prepare_environment(run_dir, verbose=False, create=False)  # reads only: makes no folder
    from flows.cli.sync import sync_run
    from flows.records.listing import resolve_run
    from flows.records.run_state import RunStateError

    try:
        sync_run(resolve_run(run_spec, run_dir), wait)
    except RunStateError as exc:  # no such run, or its run.json damaged (that was a traceback)
        fail(str(exc))


def export(
    run_spec: RunSpecArgument,
    to: Annotated[Path, typer.Option("--to", metavar="DIR", help="A new folder for the model and its tokenizer.")],
    node: Annotated[str, typer.Option("--node", metavar="NODE", help="Whose model: a server or a client id.")] = "root",
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            metavar="FORMAT",
            help="merged: a plain transformers model (LoRA adapters merged in); adapter (LoRA runs): the adapters "
            "alone, peft's layout (PeftModel.from_pretrained, load_adapter).",
        ),
    ] = "merged",
    personal: Annotated[
        bool, typer.Option("--personal", help="The client's personal model (a Ditto run) instead of its federated one.")
    ] = False,
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
) -> None:
    """Write a node's final model in save_pretrained layout with its tokenizer (merged, or its LoRA adapters)."""
    run_dir = runs_folder_of(run_spec, run_dir)
    prepare_environment(run_dir, verbose=False, create=False)  # reads only: makes no folder
    from bhfl_core.config.base import ConfigError
    from flows.cli.export import export_model
    from flows.records.listing import resolve_run
    from flows.records.run_record import RunRecord
    from flows.records.run_state import RunStateError

    if fmt not in ("merged", "adapter"):
        fail(f"--format: {fmt!r} is not a format; give merged or adapter")
    try:
        path = resolve_run(run_spec, run_dir)
        written = export_model(path, node, to, "adapter" if fmt == "adapter" else "merged", personal=personal)
    except (RunStateError, ConfigError) as exc:
        fail(str(exc))
    record = RunRecord.read(path)
    status = record.effective_status if record is not None else "of unknown status"
    if status != "finished":  # the last model the node saved, not the one the run would end with
        console.print(
            f"note: {path} is {status}: this is {node}'s last saved model, not its final one "
            f"(`bhfl resume {path}` finishes the run)",
            markup=False,
            highlight=False,
        )
    whose = f"{node}'s personal" if personal else f"{node}'s"
    what, how = ("adapters", "PeftModel.from_pretrained") if fmt == "adapter" else ("model", "from_pretrained")
    out.print(f"{whose} {what} and tokenizer: {written}  (load with {how})", highlight=False, soft_wrap=True)


def runs(
    run_spec: Annotated[
        str | None,
        typer.Argument(
            metavar="RUN",
            help="Show one run's plan (or a pipeline's stages, a sweep's points) in detail: a run folder, "
            "<name>/<stamp>, `latest`, an MLflow run id (full or a unique prefix of 8+ characters), a pipeline or "
            "sweep folder.",
        ),
    ] = None,
    run_dir: RunDirOption = DEFAULT_RUN_DIR,
    as_json: JsonOption = False,
) -> None:
    """List runs with their status (finished, failed at node X round Y, running) and what a resume would redo;
    pipelines and sweeps first, each with its stages or points."""
    run_dir = runs_folder_of(run_spec, run_dir)
    prepare_environment(run_dir, verbose=False, create=False)  # reads only: makes no folder
    from bhfl_core.store.state_header import CheckpointError
    from flows.cli.pipeline import print_pipelines
    from flows.cli.sweep_listing import print_sweeps, sweep_entry, sweep_folders
    from flows.records.listing import find_runs, resolve_run, run_entry, summarize
    from flows.records.run_state import RunStateError

    unreadable = (RunStateError, CheckpointError)  # a run folder's files, or a node checkpoint's header

    if run_spec is not None:
        try:
            if _shown_job(run_spec, run_dir, as_json):
                return
            path = resolve_run(run_spec, run_dir)
            summary = summarize(path)
        except unreadable as exc:
            fail(str(exc))
        if as_json:
            print_json([run_entry(summary, with_plan=True)])
            return
        out.print(
            f"[bold]{summary.name}[/] {escape(str(path))}\n  status: {summary.status} {escape(summary.detail)}\n"
            f"  a resume would redo: {summary.redo}\n  MLflow run id: {summary.mlflow_run_id or '-'}",
            highlight=False,
        )
        if (plan := summary.plan) is not None:
            out.print(f"  root rounds saved: {plan.root_done} of {plan.root_rounds}", highlight=False)
            for line in plan.lines:
                out.print(f"    {line}", markup=False, highlight=False)
        return
    paths = find_runs(run_dir)
    if as_json:
        from flows.cli.pipeline import pipeline_entries

        entries = [*pipeline_entries(run_dir), *(sweep_entry(folder) for folder in sweep_folders(run_dir))]
        for path in paths:  # every run, a sweep's points and a pipeline's stages included
            try:
                entries.append(run_entry(summarize(path)))
            except unreadable as exc:
                entries.append(run_entry(None, path=path, error=str(exc)))
        print_json(entries)
        return
    pipelines = print_pipelines(out, run_dir)  # pipelines first, then sweeps, then every run (stages, not points)
    in_sweeps = print_sweeps(out, run_dir)
    paths = [path for path in paths if path.resolve() not in in_sweeps]
    if not paths and not in_sweeps and not pipelines and not sweep_folders(run_dir):  # (it said so under a sweep)
        out.print(f"no runs under {run_dir}", markup=False, highlight=False)
    for path in paths:  # one block per run: long error texts stay readable in a narrow terminal
        try:
            _print_run(path, summarize(path))
        except unreadable as exc:
            out.print(f"{path}  unreadable: {exc}", markup=False, highlight=False)
    if in_sweeps:
        out.print(
            f"({len(in_sweeps)} run{'s' * (len(in_sweeps) != 1)} of the sweeps above not listed again: "
            "`bhfl runs RUN` shows one's plan)",
            highlight=False,
        )


def _shown_job(spec: str, run_dir: Path, as_json: bool) -> bool:
    """``bhfl runs SPEC`` for a pipeline or a sweep (its folder, ``<name>/<stamp>`` or MLflow run id): shown,
    True; False when ``spec`` names neither (RunStateError: a damaged record, or an ambiguous id prefix)."""
    from flows.cli.pipeline import pipeline_entry, print_pipelines
    from flows.cli.sweep_listing import print_sweeps, sweep_entry
    from flows.records.listing import resolve_pipeline, resolve_sweep
    from flows.records.pipeline_record import PipelineRecord
    from flows.records.sweep_record import SweepRecord

    if (pipeline := resolve_pipeline(spec, run_dir)) is not None:
        PipelineRecord.found(pipeline)  # the one job asked for is damaged: an error, as a damaged run is
        if as_json:
            print_json([pipeline_entry(pipeline)])
        else:
            print_pipelines(out, run_dir, only=pipeline)
        return True
    if (sweep := resolve_sweep(spec, run_dir)) is None:
        return False
    SweepRecord.found(sweep)
    if as_json:
        print_json([sweep_entry(sweep)])
    else:
        print_sweeps(out, run_dir, only=sweep)
    return True


def _print_run(path: Path, s: RunSummary) -> None:
    """One run of the ``bhfl runs`` listing: name, status, start, MLflow run; where it stopped; what a resume redoes."""
    print_header(out, f"{s.name}/{path.name}", s.status, s.started, s.mlflow_run_id)
    if s.detail:
        out.print(f"    {s.detail}", markup=False, highlight=False)
    if s.status != "finished":
        out.print(f"    a resume would redo: {s.redo}", markup=False, highlight=False)
