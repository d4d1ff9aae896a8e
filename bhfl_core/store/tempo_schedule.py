"""Tempo's epoch schedule in the run folder (``state/tempo.json``), keyed by root round.

The maths is ``bhfl_core/algorithm/tempo.py``; this file only keeps its results, so a
resumed run uses exactly the epochs the interrupted one chose.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from bhfl_core.store.atomic import write_text_atomic

SCHEDULE_FILE = "tempo.json"


def schedule_path(state_dir: Path) -> Path:
    return state_dir / SCHEDULE_FILE


def read_schedule(path: Path) -> dict[int, dict[str, dict[str, float]]]:
    """Root round (0-based, the round the epochs are used in) -> {"epochs": ..., "omega": ...}."""
    if not path.exists():
        return {}
    raw = json.loads(path.read_text())
    return {int(k): v for k, v in raw.items()}


def epochs_for(path: Path, root_round: int | None, edge_id: str, c: int) -> int:
    """The epochs of ``edge_id``'s clients in root round ``root_round``; ``c`` for round 0 or no entry."""
    if not root_round:
        return c
    entry = read_schedule(path).get(root_round, {})
    return int(entry.get("epochs", {}).get(edge_id, c))


def record_round(path: Path, root_round: int, omegas: Mapping[str, float], epochs: Mapping[str, int]) -> None:
    """Store the epochs (and the omegas they came from) used in root round ``root_round``, atomically."""
    schedule = read_schedule(path)
    schedule[root_round] = {"epochs": dict(epochs), "omega": dict(omegas)}
    ordered = {str(k): schedule[k] for k in sorted(schedule)}
    write_text_atomic(path, json.dumps(ordered, indent=1, sort_keys=False) + "\n")
