"""What is in a run folder: status, where it stopped, and what a resume would redo.

Read from the run's ``run.json`` and the headers of its node checkpoints only (no
model is loaded), so listing many runs stays cheap. The plan walks the tree the way
EXECUTENODE does: for every node, the execution its parent's current round asked for,
and how many of its rounds are saved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bhfl_core.algorithm.node_state import ROOT_CALLER, Caller
from bhfl_core.algorithm.tree import Node
from bhfl_core.config.topology import ROOT_ID as ROOT
from bhfl_core.rng import sample_cohort
from flows.records.run_record import RECORD_FILE, RunRecord
from flows.records.run_state import RunStateError, load_run
from tasks.context import CONFIG_FILE, DATA_POINTER, RunContext


@dataclass
class Progress:
    """Where a run stands: root rounds saved, executions under way, what is left."""

    root_done: int
    root_rounds: int
    lines: list[str] = field(default_factory=list)  # the plan, one node per line, indented by depth
    stopped_at: str = ""  # the deepest execution under way, e.g. "edge-de round 2"
    stopped_depth: int = -1
    final_eval_pending: bool = True


def _walk(ctx: RunContext, node: Node, caller: Caller, out: Progress) -> str:
    """Status of ``node``'s execution for ``caller`` (done / under way / to do); lines for those under way."""
    settings = node.settings
    state = ctx.store.load_header(node.id)
    started = state.exec_caller == caller.key
    done = state.rounds_done_for(caller)
    if done >= settings.rounds:
        return "done"
    if node.is_leaf:
        return "under way" if started else "to do"
    round_index = state.rounds_done  # the node's current round (cumulative over the run)
    cohort = sample_cohort(ctx.tree.children(node.id), settings.cohort, ctx.config.seed, node.id, round_index)
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


def progress(run_path: Path) -> Progress | None:
    """The run's progress from its checkpoints; None before its data was prepared."""
    if not (run_path / DATA_POINTER).exists():
        return None
    ctx = RunContext.open(run_path)
    root = ctx.tree.root
    done = ctx.store.load_header(root.id).rounds_done
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
        if p.root_done + 1 < p.root_rounds:
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


def summarize(run_path: Path) -> RunSummary:
    config, record = load_run(run_path)
    p = progress(run_path)
    status = record.effective_status
    where = f" at {p.stopped_at}" if p and p.stopped_at and status != "finished" else ""
    if status == "finished":
        detail = f"{p.root_rounds} root rounds" if p else ""
    elif status == "running":
        detail = f"process {record.pid}" + where
    else:
        detail = (where.strip() + (f": {record.error.splitlines()[0]}" if record.error else "")).strip(": ")
    return RunSummary(run_path, config.name, status, record.started, detail, redo_summary(p), record.parent_run_id)


def find_runs(run_dir: Path) -> list[Path]:
    """Run folders under ``run_dir`` (``<name>/<stamp>/``), oldest first."""
    found = [p.parent for p in run_dir.glob(f"*/*/{CONFIG_FILE}") if (p.parent / RECORD_FILE).exists()]
    return sorted(found, key=lambda p: (RunRecord.read(p) or RunRecord(name="")).started)


def resolve_run(spec: str, run_dir: Path) -> Path:
    """A run folder from what a user types: a path, ``<name>/<stamp>``, ``latest``, or an MLflow run id."""
    for candidate in (Path(spec), run_dir / spec):
        if (candidate / CONFIG_FILE).is_file():
            return candidate.resolve()
    runs = find_runs(run_dir)
    if spec == "latest" and runs:
        return runs[-1].resolve()
    for path in runs:
        record = RunRecord.read(path)
        if record is not None and spec in (record.parent_run_id, path.name):
            return path.resolve()
    raise RunStateError(
        f"no run {spec!r} under {run_dir}: give a run folder, <name>/<stamp>, `latest` or an "
        f"MLflow run id (`bhfl runs --run-dir {run_dir}` lists them)"
    )
