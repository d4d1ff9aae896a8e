"""What is in a run folder: status, where it stopped, and what a resume would redo.

Read from the run's ``run.json``, its config, its data manifest and the headers of its
node checkpoints only (no model, no data shard is loaded; this module imports neither
torch, Prefect, MLflow nor the data libraries), so listing many runs stays cheap. The plan walks
the tree the way EXECUTENODE does: for every node, the execution its parent's current
round asked for, and how many of its rounds are saved.

A run is named by its folder, ``<name>/<stamp>``, ``latest`` or its MLflow run id,
full or a unique prefix of at least ``MIN_ID_PREFIX`` characters (``resolve_run``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bhfl_core.algorithm.node_state import ROOT_CALLER, Caller
from bhfl_core.algorithm.tree import Node, Tree
from bhfl_core.config.topology import ROOT_ID as ROOT
from bhfl_core.config.topology import build_tree
from bhfl_core.rng import sample_cohort
from bhfl_core.store.run_layout import CONFIG_FILE, DATA_POINTER, STATE_DIR
from bhfl_core.store.state_header import read_header
from data_prep.manifest import Manifest
from flows.records.run_record import RECORD_FILE, ProcessRecord, RunRecord
from flows.records.run_state import RunStateError, load_run

if TYPE_CHECKING:
    from bhfl_core.config.schema import ExperimentConfig

MIN_ID_PREFIX = 8  # shortest MLflow run-id prefix taken for a run (a prefix of 8 hex digits: 4e9 values)
_HEX = re.compile(r"^[0-9a-f]+$")


@dataclass
class Progress:
    """Where a run stands: root rounds saved, executions under way, what is left."""

    root_done: int
    root_rounds: int
    lines: list[str] = field(default_factory=list)  # the plan, one node per line, indented by depth
    stopped_at: str = ""  # the deepest execution under way, e.g. "edge-de round 2"
    stopped_depth: int = -1
    final_eval_pending: bool = True


@dataclass(frozen=True)
class _Run:
    """What the plan needs of a run: its tree, its checkpoint headers, its seed (no data, no model)."""

    tree: Tree
    state_dir: Path  # the run's node states (their headers are read: ``state_header.py``)
    seed: int


def _open(run_path: Path, config: ExperimentConfig) -> _Run:
    # the tree as tasks/context.py RunContext builds it, without importing the data libraries it needs
    data_root = Path(json.loads((run_path / DATA_POINTER).read_text(encoding="utf-8"))["data_root"])
    tree = build_tree(config, Manifest.read(data_root).tree_clients())
    return _Run(tree, run_path / STATE_DIR, config.seed)


def _walk(ctx: _Run, node: Node, caller: Caller, out: Progress) -> str:
    """Status of ``node``'s execution for ``caller`` (done / under way / to do); lines for those under way."""
    settings = node.settings
    state = read_header(ctx.state_dir, node.id)
    started = state.exec_caller == caller.key
    done = state.rounds_done_for(caller)
    if done >= settings.rounds:
        return "done"
    if node.is_leaf:
        return "under way" if started else "to do"
    round_index = state.rounds_done  # the node's current round (cumulative over the run)
    cohort = sample_cohort(
        ctx.tree.children(node.id), settings.cohort, ctx.seed, node.id, round_index, settings.poisson_rate
    )
    at = len(out.lines)
    out.lines.append("")  # this node's line, written once its children are known
    statuses = [_walk(ctx, child, Caller(node.id, round_index), out) for child in cohort]
    if not started and all(status == "to do" for status in statuses):
        del out.lines[at:]
        return "to do"
    finished = sum(status == "done" for status in statuses)
    out.lines[at] = (
        f"{'  ' * node.depth}{node.id}: round {done + 1} of {settings.rounds}, "
        f"{finished} of {len(cohort)} children finished"
    )
    if node.depth >= out.stopped_depth:
        out.stopped_at, out.stopped_depth = f"{node.id} round {done + 1}", node.depth
    return "under way"


def progress(run_path: Path, config: ExperimentConfig | None = None) -> Progress | None:
    """The run's progress from its checkpoints; None before its data was prepared.

    ``config``: the run's config, already read by the caller (else read here).
    """
    if not (run_path / DATA_POINTER).exists():
        return None
    ctx = _open(run_path, config if config is not None else load_run(run_path)[0])
    root = ctx.tree.root
    done = read_header(ctx.state_dir, root.id).rounds_done
    out = Progress(done, root.settings.rounds)
    if done < root.settings.rounds:
        _walk(ctx, root, ROOT_CALLER, out)
    record = RunRecord.read(run_path)
    out.final_eval_pending = record is None or record.status != "finished"
    return out


def redo_summary(p: Progress | None) -> str:
    """One line: what ``bhfl resume`` would do."""
    if p is None:
        return "everything (data preparation, training, evaluation)"
    if not p.final_eval_pending:
        return "nothing"
    parts = []
    if p.root_done < p.root_rounds:
        inside = p.stopped_at and not p.stopped_at.startswith(f"{ROOT} ")
        parts.append(f"root round {p.root_done + 1}" + (f" (from {p.stopped_at})" if inside else ""))
        if p.root_done + 2 == p.root_rounds:
            parts.append(f"round {p.root_rounds}")
        elif p.root_done + 2 < p.root_rounds:
            parts.append(f"rounds {p.root_done + 2}-{p.root_rounds}")
    parts.append("final evaluation")
    return "; ".join(parts)


@dataclass(frozen=True)
class RunSummary:
    path: Path
    name: str
    status: str  # finished / failed / interrupted / running
    started: float
    detail: str  # where it stopped and why
    redo: str
    mlflow_run_id: str
    plan: Progress | None = None  # None before its data was prepared


def summarize(run_path: Path) -> RunSummary:
    config, record = load_run(run_path)
    p = progress(run_path, config)
    status = record.effective_status
    where = f" at {p.stopped_at}" if p and p.stopped_at and status != "finished" else ""
    if status == "finished":
        detail = f"{p.root_rounds} root round{'s' * (p.root_rounds != 1)}" if p else ""
    elif status == "running":
        detail = f"process {record.pid}" + where
    else:
        detail = (where.strip() + (f": {record.error.splitlines()[0]}" if record.error else "")).strip(": ")
    return RunSummary(run_path, config.name, status, record.started, detail, redo_summary(p), record.parent_run_id, p)


def iso_utc(timestamp: float) -> str:
    """``started`` in ``bhfl runs --json``: ISO 8601, UTC, to the second."""
    return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="seconds")


def job_entry(kind: str, folder: Path, name: str, status: str, started: float | None, **own: Any) -> dict[str, Any]:
    """A run, sweep or pipeline of ``bhfl runs --json`` (keys: docs/cli.md): the keys every job has, then
    ``own``, the keys of its kind."""
    return {
        "kind": kind,
        "name": name,
        "folder": f"{folder.parent.name}/{folder.name}",
        "path": str(folder.resolve()),
        "status": status,
        "started": None if started is None else iso_utc(started),
        **own,
    }


def read_entry(
    kind: str, folder: Path, read: Callable[[Path], tuple[ProcessRecord, dict[str, Any]]], **empty: Any
) -> dict[str, Any]:
    """A sweep or pipeline of ``bhfl runs --json``: ``read`` gives its record and the keys of its kind; a damaged
    record (RunStateError) is an ``unreadable_entry`` with the keys ``empty``, the rest of the listing intact."""
    try:
        record, own = read(folder)
    except RunStateError as exc:
        return unreadable_entry(kind, folder, str(exc), **empty)
    return job_entry(kind, folder, record.name, record.effective_status, record.started, **own)


def unreadable_entry(kind: str, folder: Path, error: str, **empty: Any) -> dict[str, Any]:
    """A job of ``bhfl runs --json`` whose files cannot be read: named by its folder, ``status`` unreadable, why
    in ``detail``; ``empty``: the other keys of its kind, empty."""
    return job_entry(kind, folder, folder.parent.name, "unreadable", None, detail=error, **empty)


def run_entry(
    summary: RunSummary | None, path: Path | None = None, error: str = "", with_plan: bool = False
) -> dict[str, Any]:
    """One run of ``bhfl runs --json`` (keys: docs/cli.md); ``summary`` None: an unreadable run folder."""
    if summary is None:
        assert path is not None
        return unreadable_entry("run", path, error, redo=None, mlflow_run_id=None)
    entry = job_entry(
        "run",
        summary.path,
        summary.name,
        summary.status,
        summary.started,
        detail=summary.detail,
        redo=summary.redo,
        mlflow_run_id=summary.mlflow_run_id or None,
    )
    if with_plan:
        plan = summary.plan
        entry["plan"] = (
            None
            if plan is None
            else {"root_rounds_done": plan.root_done, "root_rounds": plan.root_rounds, "nodes": plan.lines}
        )
    return entry


def find_runs(run_dir: Path) -> list[Path]:
    """Run folders under ``run_dir`` (``<name>/<stamp>/``), oldest first."""
    found = [p.parent for p in run_dir.glob(f"*/*/{CONFIG_FILE}") if (p.parent / RECORD_FILE).exists()]
    return sorted(found, key=RunRecord.started_at)  # a damaged record first (then listed as unreadable)


def is_id_prefix(spec: str) -> bool:
    """Whether ``spec`` can be (a prefix of) an MLflow run id: 8 to 32 lowercase hex digits."""
    return MIN_ID_PREFIX <= len(spec) <= 32 and _HEX.match(spec) is not None


def _by_run_id(spec: str, ids: dict[Path, str], what: str) -> Path | None:
    """The one folder whose MLflow run id is ``spec`` or starts with it; RunStateError when several do."""
    exact = [path for path, run_id in ids.items() if run_id and run_id == spec]
    if exact:
        return exact[0].resolve()
    if not is_id_prefix(spec):
        return None
    found = [path for path, run_id in ids.items() if run_id and run_id.startswith(spec)]
    if len(found) > 1:
        raise RunStateError(
            f"{spec!r} is the start of the MLflow run ids of {len(found)} {what}s: "
            + ", ".join(f"{ids[p]} ({p})" for p in found)
            + "; give more characters of the id"
        )
    return found[0].resolve() if found else None


def resolve_run(spec: str, run_dir: Path) -> Path:
    """A run folder from what a user types: a path, ``<name>/<stamp>``, ``latest``, or an MLflow run id.

    The run id may be shortened to a unique prefix of at least ``MIN_ID_PREFIX`` characters.
    """
    for candidate in (Path(spec), run_dir / spec):
        if (candidate / CONFIG_FILE).is_file():
            return candidate.resolve()
    runs = find_runs(run_dir)
    if spec == "latest" and runs:
        return runs[-1].resolve()
    for path in runs:
        if spec == path.name:
            return path.resolve()
    if (found := _by_run_id(spec, RunRecord.run_ids(runs, "parent_run_id"), "run")) is not None:
        return found
    raise RunStateError(
        f"no run {spec!r} under {run_dir}: give a run folder, <name>/<stamp>, `latest` or an "
        f"MLflow run id, full or its first {MIN_ID_PREFIX}+ characters (`bhfl runs --run-dir {run_dir}` lists them)"
    )


def resolve_pipeline(spec: str, run_dir: Path) -> Path | None:
    """The pipeline folder ``spec`` names (a path, ``<name>/<stamp>``, or its MLflow run id or a prefix), else None."""
    from flows.records.pipeline_record import PipelineRecord

    return _resolve_job(PipelineRecord, spec, run_dir)


def resolve_sweep(spec: str, run_dir: Path) -> Path | None:
    """The sweep folder ``spec`` names (a path, ``<name>/<stamp>``, or its MLflow run id or a prefix), else None."""
    from flows.records.sweep_record import SweepRecord

    return _resolve_job(SweepRecord, spec, run_dir)


def _resolve_job(kind: Any, spec: str, run_dir: Path) -> Path | None:
    """The folder of a job of ``kind`` (a pipeline or sweep record class) that ``spec`` names, else None."""
    if (folder := kind.find(spec, run_dir)) is not None:
        return folder
    if not is_id_prefix(spec):
        return None
    return _by_run_id(spec, kind.run_ids(kind.find_all(run_dir)), kind.NOUN)
