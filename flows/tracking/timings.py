"""The run's time figures: phase durations and what evaluation costs against training."""

from __future__ import annotations

from collections.abc import Mapping

from flows.tracking.tracker import Tracker


def evaluation_cost(
    tracker: Tracker, timings: Mapping[str, float], final_step: int, train_started: float
) -> dict[str, float]:
    """Evaluation seconds over training seconds, from the persisted per-evaluation times.

    Intermediate evaluations (``eval.every``) run inside the training phase, so those this
    attempt ran (logged after ``train_started``, epoch seconds; a resumed run's earlier
    attempts ran the others) are taken out of its ``time/train_s`` before dividing.
    """
    points = tracker.points(tracker.parent_id, "time/eval_s")
    evals = tracker.history(tracker.parent_id, "time/eval_s")
    intermediate = sum(m.value for m in points if m.step != final_step and m.timestamp >= train_started * 1000)
    total = sum(evals.values())
    training = timings.get("time/train_s", float("nan")) - intermediate
    out = {
        "time/eval_total_s": total,
        "time/training_only_s": training,
        "time/eval_share": total / training if training > 0 else float("nan"),
    }
    baselines = tracker.history(tracker.parent_id, "time/baselines_s")
    if baselines:
        out["time/baselines_total_s"] = sum(baselines.values())
    return out
