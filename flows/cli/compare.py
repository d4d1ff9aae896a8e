"""``bhfl compare``: several experiment runs side by side, read from the MLflow store.

A reference is a parent run id, or an experiment name (its latest finished run).
A pipeline (flows/pipeline.py) is one row by its name or run id: its run holds its
last stage's headlines, with communication and time summed over the stages; a stage's
run id gives that stage alone.
Every number comes from the parent run's metrics that ``flows.tracking.report`` logged at the
end of the run, so any finished run in any store can be compared, e.g. B-HFL vs
FedAvg vs HierFAVG on the same data.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from mlflow import MlflowClient
from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from bhfl_core.algorithm.engine import VIRTUAL_TIME
from bhfl_core.analysis import time_to_accuracy as tta
from bhfl_core.learning.metrics import task_metrics
from bhfl_core.store.tables import table_csv

_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


class CompareError(ValueError):
    """A reference that names no run or experiment in the store; the message says which."""


def resolve(client: MlflowClient, ref: str) -> Run:
    """The experiment run a reference names (a run id, or an experiment's latest finished run)."""
    if _RUN_ID.match(ref):
        try:
            run = client.get_run(ref)
        except MlflowException:
            run = None
        if run is not None:
            parent = run.data.tags.get(MLFLOW_PARENT_RUN_ID)
            if parent and "bhfl.pipeline_stage" not in run.data.tags:  # a stage's run is an experiment run
                node = run.data.tags.get("bhfl.node", run.info.run_name)
                raise CompareError(
                    f"{ref}: this is the run of node {node!r}; compare experiment runs, "
                    f"e.g. its top-level run (follow the parent runs up from {parent})"
                )
            return run
    experiment = client.get_experiment_by_name(ref)
    if experiment is None:
        raise CompareError(f"{ref!r} is neither a run id nor an experiment name in this MLflow store")
    runs = client.search_runs(
        [experiment.experiment_id],
        "attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=1000,
    )
    for run in runs:
        if MLFLOW_PARENT_RUN_ID not in run.data.tags:
            return run
    raise CompareError(f"experiment {ref!r} has no finished run yet")


COLUMNS = (
    "experiment",
    "run_id",
    "metric",
    "leaf_mean",
    "leaf_worst10",
    "parent_mean",
    "parent_worst10",
    "root_union",
    "root_proxy",
    "closer_is_better_share",
    "comm_model_equivalents",
    "comm_mb",
    "root_rounds",
    "virtual_s",
    "wall_s",
)
HEADERS = {
    "experiment": "experiment",
    "run_id": "run",
    "metric": "metric",
    "leaf_mean": "own model: mean",
    "leaf_worst10": "own model: worst 10%",
    "parent_mean": "parent server: mean",
    "parent_worst10": "parent server: worst 10%",
    "root_union": "root on union",
    "root_proxy": "root on proxy",
    "closer_is_better_share": "closer is better (share of clients)",
    "comm_model_equivalents": "communication (models)",
    "comm_mb": "communication (MB)",
    "root_rounds": "root rounds",
    "virtual_s": "virtual time (s)",
    "time_to_target": "virtual s to target (root on union)",
    "wall_s": "wall time (s)",
}


def row(client: MlflowClient, run: Run, target: float | None = None) -> dict[str, object]:
    """One table row: the run's headline metrics in the task's primary metric.

    ``target``: also the virtual time at which the root first reached ``target`` on the
    union of the clients' tests (NaN if it never did; evaluations every ``eval.every`` rounds).
    """
    m = run.data.metrics
    task = task_metrics(run.data.tags.get("bhfl.task", "classification"))
    metric = task.primary
    nan = math.nan
    comm_bytes = m.get("comm/total_bytes", nan)
    out: dict[str, object] = {
        "experiment": client.get_experiment(run.info.experiment_id).name,
        "run_id": run.info.run_id,
        "metric": metric,
        "leaf_mean": m.get(f"client_on_own_clients/{metric}_mean", nan),
        "leaf_worst10": m.get(f"client_on_own_clients/{metric}_worst10", nan),
        "parent_mean": m.get(f"edge_on_own_clients/{metric}_mean", nan),
        "parent_worst10": m.get(f"edge_on_own_clients/{metric}_worst10", nan),
        "root_union": m.get(f"root/union/{metric}", nan),
        "root_proxy": m.get(f"root/proxy/{metric}", nan),
        "closer_is_better_share": m.get("proximity/share_clients_rank", nan),
        "comm_model_equivalents": m.get("comm/total_model_equivalents", nan),
        "comm_mb": comm_bytes / 1e6,
        "root_rounds": run.data.params.get("tree.root.rounds", ""),
        "virtual_s": m.get(VIRTUAL_TIME, nan),
        "wall_s": m.get("time/total_s", nan),
    }
    if target is not None:
        points = tta.curve(_history(client, run, VIRTUAL_TIME), _history(client, run, f"root/union/{metric}"))
        reached = tta.time_to_target(points, target, task.better(metric))
        out["time_to_target"] = nan if reached is None else reached
    return out


def _history(client: MlflowClient, run: Run, key: str) -> dict[int, float]:
    return {m.step: m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.timestamp)}


def columns(target: float | None) -> tuple[str, ...]:
    return COLUMNS if target is None else (*COLUMNS[:-1], "time_to_target", COLUMNS[-1])


def compare(client: MlflowClient, refs: Sequence[str], target: float | None = None) -> list[dict[str, object]]:
    return [row(client, resolve(client, ref), target) for ref in refs]


def _cell(value: object, column: str) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "–"
        if column in ("comm_model_equivalents", "wall_s", "virtual_s", "time_to_target"):
            return f"{value:.0f}"
        return f"{value:.2f}" if column == "comm_mb" else f"{value:.4f}"
    if column == "run_id":
        return str(value)[:8]
    return str(value)


def to_markdown(rows: Sequence[dict[str, object]], target: float | None = None) -> str:
    cols = columns(target)
    lines = ["| " + " | ".join(HEADERS[c] for c in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(_cell(r[c], c) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def to_csv(rows: Sequence[dict[str, object]], target: float | None = None) -> str:
    """Full-precision CSV (NaN where a run lacks a number), one row per run."""
    cols = columns(target)
    return table_csv(cols, ([r.get(c) for c in cols] for r in rows))
