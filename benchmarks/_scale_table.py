"""scale.py's output: the medians over repeats, the markdown table, and bhfl's memory relative to its smallest case."""

from __future__ import annotations

import math
import statistics
from typing import Any

from _scale_case import Case
from _scale_measure import Figures

# column -> (format, key of the figures); NaN / missing prints "-"
COLUMNS: dict[str, tuple[str, str]] = {
    "wall s": ("{:.1f}", "wall"),
    "start-up s": ("{:.1f}", "startup"),
    "prepare s": ("{:.1f}", "prepare"),
    "set-up s": ("{:.1f}", "setup"),
    "train s": ("{:.1f}", "train"),
    "close s": ("{:.1f}", "close"),
    "evaluate s": ("{:.1f}", "evaluate"),
    "report s": ("{:.1f}", "report"),
    "after / train": ("{:.0%}", "after_share"),
    "cl/s wall": ("{:.2f}", "cps_wall"),
    "cl/s train": ("{:.2f}", "cps_train"),
    "peak PSS MB": ("{:.0f}", "pss_mb"),
    "busy % min-max": ("{}", "busy"),
    "run MB": ("{:.1f}", "run_mb"),
    "B/client": ("{:.0f}", "bytes_per_client"),
    "data MB": ("{:.1f}", "data_mb"),
    "worker fds": ("{:.0f}", "worker_fds"),
}


def median(runs: list[Figures]) -> Figures:
    """Per figure, the median over the runs of the values that are numbers (min-max pairs: medians of each)."""
    out: Figures = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        if all(isinstance(v, tuple) for v in values):
            out[key] = tuple(statistics.median(v[i] for v in values) for i in range(2))
            continue
        known = [v for v in values if isinstance(v, int | float) and not math.isnan(v)]
        out[key] = statistics.median(known) if known else math.nan
    return out


def cell(fmt: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, tuple):
        return f"{value[0]:.0%}-{value[1]:.0%}".replace("%", "")
    return fmt.format(value)


def table(rows: list[tuple[Case, str, Figures]], persistent: bool) -> str:
    columns = {c: spec for c, spec in COLUMNS.items() if persistent or c != "worker fds"}
    head = ["population", "clients/round", "trainings", "run", *columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case, who, fig in rows:
        values = [cell(fmt, fig.get(key)) for fmt, key in columns.values()]
        start = [f"{case.population:,}", f"{case.per_round:,}", f"{round(fig['trainings']):,}", who]
        lines.append("| " + " | ".join([*start, *values]) + " |")
    return "\n".join(lines)


def memory_lines(rows: list[tuple[Case, str, Figures]]) -> list[str]:
    """bhfl's peak PSS relative to the smallest population at the same clients per round."""
    out = []
    for per_round in sorted({c.per_round for c, _, _ in rows}):
        same = sorted(
            ((c, f) for c, who, f in rows if who == "bhfl" and c.per_round == per_round), key=lambda x: x[0].population
        )
        if len(same) > 1:
            base = same[0][1]["pss_mb"]
            ratios = ", ".join(f"{c.population:,}: {f['pss_mb'] / base:.2f}x" for c, f in same)
            out.append(
                f"bhfl peak PSS at {per_round:,} clients/round, relative to {same[0][0].population:,} clients: {ratios}"
            )
    return out
