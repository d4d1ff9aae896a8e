"""The learned placement's time model of a run, kept in the run folder between rounds.

``runtime.placement: learned`` predicts each client's training time from what the
workers measured (seconds ~ a + b x optimizer steps, per device kind; see
bhfl_core.placement.TimeModel). Node executions that run concurrently (parallel
subtrees) add their observations under a file lock, so none is lost.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterable
from pathlib import Path

from bhfl_core.placement import TimeModel
from bhfl_core.store.atomic import write_text_atomic

FILE = Path("state") / "placement.json"


def load_time_model(run_path: Path) -> TimeModel:
    path = run_path / FILE
    return TimeModel.from_dict(json.loads(path.read_text(encoding="utf-8"))) if path.exists() else TimeModel()


def record_timings(run_path: Path, observations: Iterable[tuple[str, int, float]]) -> None:
    """Add ``(device kind, optimizer steps, seconds)`` measurements to the run's time model."""
    observations = list(observations)
    if not observations:
        return
    path = run_path / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        model = load_time_model(run_path)
        for kind, steps, seconds in observations:
            model.observe(kind, steps, seconds)
        write_text_atomic(path, json.dumps(model.to_dict(), sort_keys=True))
