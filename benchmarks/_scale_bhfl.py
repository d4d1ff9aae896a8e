"""scale.py's bhfl side: one `bhfl run` measured, and its figures read back from what the run wrote.

The phase boundaries come from the run's record (``run.json``'s timeline) and the
run-level figures it logged to MLflow; the trainings from the edge servers' MLflow
metrics; worker busy shares from the intervals the workers wrote in the run folder
(benchmarks/scale.py's docstring says what each figure means).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from _scale_case import Case
from _scale_measure import Figures, child_env, disk_bytes, measure, phase_peaks, phases

EVALUATED = re.compile(r"^evaluated \d+ models after root round \d+")


def _mlflow_figures(record: dict[str, Any], edges: tuple[str, ...]) -> tuple[dict[str, float], float]:
    """The parent run's step-0 figures (``time/*``, ...) and the client trainings the edge servers logged."""
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(record["tracking_uri"])
        metrics = dict(client.get_run(record["parent_run_id"]).data.metrics)
        runs = record.get("node_runs", {})
        counted = sum(
            m.value for e in edges if e in runs for m in client.get_metric_history(runs[e], "Training/clients")
        )
        return metrics, float(counted)
    except Exception as exc:  # (an MLflow that cannot be read: the stderr timestamps are the fallback)
        print(f"  (MLflow figures not read: {exc})")
        return {}, math.nan


def _busy(run_path: Path, workers: list[str], span: tuple[float, float]) -> dict[str, float]:
    """Each worker's busy share of ``span``, from the intervals the workers wrote in the run folder."""
    from bhfl_core.placement import utilisation
    from tasks.worker import busy_intervals

    intervals = busy_intervals(run_path)
    return {w: utilisation({w: intervals.get(w, [])}, 1, span)[0] for w in workers}


def run_bhfl(args: argparse.Namespace, case: Case, folder: Path) -> tuple[Figures, Path]:
    run_dir = folder / "runs"
    sets = [a for o in case.overrides for a in ("--set", o)]
    cmd = [sys.executable, "-m", "flows.cli.app", "run", str(args.config), "--run-dir", str(run_dir), *sets]
    m = measure(cmd, child_env(args), args.interval)
    (run_path,) = (run_dir / case.name).iterdir()
    record = json.loads((run_path / "run.json").read_text())
    timeline = record.get("timeline") or {}
    metrics, counted = _mlflow_figures(record, case.edges)
    flow = timeline.get("flow_start", math.nan)
    eval_start = flow + metrics.get("time/setup_s", math.nan) + metrics.get("time/train_s", math.nan)
    eval_end = eval_start + metrics.get("time/final_eval_s", math.nan)
    seen = [t for t, line in m.stderr if EVALUATED.match(line)]
    line_end = seen[-1] if seen else math.nan
    if math.isnan(eval_end):
        eval_end = line_end
    bounds = {
        "start": m.started,
        "flow": flow,
        "data": timeline.get("data_ready", math.nan),
        "first": timeline.get("first_training", math.nan),
        "last": timeline.get("last_aggregate", math.nan),
        "eval_start": eval_start,
        "eval_end": eval_end,
    }
    fig = phases(bounds, m.exited, case.trainings)
    workers = [w["name"] for w in record.get("workers", [])]
    busy = _busy(run_path, workers, (bounds["first"], bounds["last"])) if workers else {}
    worker_pids = {int(w["pid"]) for w in record.get("workers", []) if str(w.get("pid", "")).isdigit()}
    data_root = Path(json.loads((run_path / "data.json").read_text())["data_root"])
    run_bytes = disk_bytes(run_path)
    fig.update(
        {
            "pss_mb": m.sampler.peak_pss_mb(),
            **phase_peaks(m.sampler, bounds, m.exited),
            "cpu_s": m.sampler.cpu_s,
            "busy": (min(busy.values()), max(busy.values())) if busy else None,
            "run_mb": run_bytes / 2**20,
            "bytes_per_client": run_bytes / case.population,
            "data_mb": disk_bytes(data_root) / 2**20,
            "worker_fds": max((m.sampler.fds.get(p, 0) for p in worker_pids), default=math.nan),
            "counted": counted,
            "eval_line_lag": line_end - eval_end,
            "utilisation": metrics.get("runtime/worker_utilisation", math.nan),
            "all_busy": metrics.get("runtime/all_workers_busy", math.nan),
        }
    )
    return fig, run_path
