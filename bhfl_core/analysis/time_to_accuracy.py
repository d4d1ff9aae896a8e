"""Quality against virtual time: the curve from a run's evaluations, and the time to reach a target.

Every evaluation (``eval.every`` root rounds, and the final one) is logged at its root
round together with the root's virtual time then (``time/virtual_s``: the virtual
clock of ``bhfl_core/algorithm/virtual_clock.py``, synchronous rounds waiting for their
slowest child). Joining the two by round gives the curve; asynchronous and synchronous
runs of the same workload compare on it, since both count time the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bhfl_core.store.tables import table_csv


@dataclass(frozen=True)
class CurvePoint:
    step: int  # root round (asynchronous root: buffer flush)
    virtual_s: float
    value: float


def round_label(step: int, rounds: int) -> str:
    """The root round an evaluation logged at ``step`` followed, as the report and the progress notes say it.

    A step past the run's ``rounds`` is the n-th forced re-evaluation of the finished run
    (``bhfl resume --force-eval``, logged at ``rounds + n``): a 3-round run's first one was
    called "root round 4", a round the run never had.
    """
    return str(step) if step <= rounds else f"{rounds}, re-evaluation {step - rounds} (MLflow step {step})"


def curve(virtual: Mapping[int, float], values: Mapping[int, float]) -> list[CurvePoint]:
    """The evaluations that have both a virtual time and a value, in step order."""
    return [CurvePoint(step, virtual[step], values[step]) for step in sorted(values) if step in virtual]


def time_to_target(points: Sequence[CurvePoint], target: float, higher_is_better: bool = True) -> float | None:
    """Virtual time of the first evaluation at or beyond ``target`` (None: never reached)."""
    for p in points:
        if (p.value >= target) if higher_is_better else (p.value <= target):
            return p.virtual_s
    return None


def curve_csv(points: Sequence[CurvePoint], metric: str) -> str:
    return table_csv(["step", "virtual_s", metric], ([p.step, f"{p.virtual_s:.6f}", f"{p.value:.6f}"] for p in points))
