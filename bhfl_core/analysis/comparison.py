"""What a comparison of runs shows: its columns, their bounds, and its tables (markdown, CSV, JSON).

``bhfl compare`` prints these tables and a sweep's report writes them
(flows/cli/compare.py, flows/tracking/sweep_report.py); both read the runs from MLflow
through flows/tracking/run_comparison.py, which builds the rows (one mapping per run,
column -> value) and ``ByConfig``. Nothing here reads a store: the tables are functions
of those values, so a test can build them by hand.

Two shapes: one row per run (``to_markdown``, ``to_csv``, ``rows_json``), and one row
per config over its seeds (``by_config_markdown``, ``by_config_csv``, ``paired_csv``,
``by_config_json``): mean ± std and the 95% interval (bhfl_core/analysis/seeds.py),
clipped to what the number can take (``column_bounds``) and marked where it was.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from bhfl_core.analysis import seeds
from bhfl_core.learning.metrics import metric_bounds
from bhfl_core.store.tables import table_csv, table_markdown

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


IN_METRIC = ("leaf_mean", "leaf_worst10", "parent_mean", "parent_worst10", "root_union", "root_proxy")
"""The columns in the task's primary metric: the evaluation's headlines, each with a trivial baseline."""
BASELINE_COLUMNS = tuple(f"baseline_{c}" for c in IN_METRIC)


def baseline_column(column: str) -> str:
    """Where a row keeps the trivial baseline of headline ``column`` (``baseline_root_union``)."""
    return f"baseline_{column}"


def headline_keys(metric: str) -> dict[str, str]:
    """Each model column's parent-run metric in ``metric`` (the task's primary): what a row reads from a run."""
    return {
        "leaf_mean": f"client_on_own_clients/{metric}_mean",
        "leaf_worst10": f"client_on_own_clients/{metric}_worst10",
        "parent_mean": f"edge_on_own_clients/{metric}_mean",
        "parent_worst10": f"edge_on_own_clients/{metric}_worst10",
        "root_union": f"root/union/{metric}",
        "root_proxy": f"root/proxy/{metric}",
    }


def columns(target: float | None) -> tuple[str, ...]:
    return COLUMNS if target is None else (*COLUMNS[:-1], "time_to_target", COLUMNS[-1])


def _number(value: object) -> object:
    """A JSON value: NaN (a number the run lacks) is null."""
    return None if isinstance(value, float) and math.isnan(value) else value


JSON_KEYS = ("run_path", "status")


def rows_json(rows: Sequence[dict[str, object]], target: float | None = None) -> list[dict[str, object]]:
    """``bhfl compare --json``: one object per run, the table's columns (full precision, null: none) and
    ``run_path``, ``status`` (README, "The CLI")."""
    keys = (*columns(target), *JSON_KEYS)
    out = [{k: _number(r.get(k)) for k in keys} | {"baseline": _baseline_json(r)} for r in rows]
    for r in out:  # a param (text) in MLflow; a number here, null where the run has none
        rounds = str(r["root_rounds"] or "")
        r["root_rounds"] = int(rounds) if rounds.isdigit() else None
    return out


def _baseline_json(row: Mapping[str, object]) -> dict[str, object] | None:
    """A run's trivial baseline in ``--json``: its kind and the model columns' values (null: the task has none)."""
    if not row.get("baseline_kind"):
        return None
    return {"kind": row["baseline_kind"], **{c: _number(row.get(baseline_column(c))) for c in IN_METRIC}}


def _cell(value: object, column: str) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "–"
        if column in ("comm_model_equivalents", "wall_s", "virtual_s", "time_to_target"):
            return f"{value:.0f}"
        return f"{value:.2f}" if column == "comm_mb" else f"{value:.4f}"
    return str(value)  # run ids in full: any printed id is one `bhfl compare` and `bhfl resume` take


def to_markdown(rows: Sequence[dict[str, object]], target: float | None = None) -> str:
    """One row per run, each followed by its trivial baseline's row (the model columns only), where it has one."""
    cols = columns(target)
    lines: list[list[str]] = []
    for r in rows:
        lines.append([_cell(r[c], c) for c in cols])
        if r.get("baseline_kind"):
            lines.append([_baseline_cell(r, c) for c in cols])
    table = table_markdown([HEADERS[c] for c in cols], lines)
    return table + (f"\n\n{BASELINE_NOTE}" if any(r.get("baseline_kind") for r in rows) else "")


BASELINE_NOTE = (
    "↳ trivial baseline: what a model that learnt nothing but its training data's prior scores on the same tests "
    "(majority: each client's most frequent training label; unigram: training token frequencies; docs/evaluation.md)."
)


def _baseline_cell(row: Mapping[str, object], column: str) -> str:
    if column == "experiment":
        return f"↳ trivial baseline ({row['baseline_kind']})"
    if column == "metric":
        return str(row["metric"])
    return _cell(row.get(baseline_column(column)), column) if column in IN_METRIC else ""


def to_csv(rows: Sequence[dict[str, object]], target: float | None = None) -> str:
    """Full-precision CSV (NaN where a run lacks a number), one row per run, its trivial baseline's columns last."""
    cols = (*columns(target), "baseline_kind", *BASELINE_COLUMNS)
    return table_csv(cols, ([r.get(c) for c in cols] for r in rows))


# ---------------------------------------------------------------- over seeds: --by-config, --baseline

HEADLINE = tuple(c for c in COLUMNS if c not in ("experiment", "run_id", "metric", "root_rounds"))
_SHARE: seeds.Bounds = (0.0, 1.0)  # closer_is_better_share: a share of clients
CLIPPED = "†"  # after an interval end clipped to the column's bounds (footnote: CLIPPED_NOTE)
CLIPPED_NOTE = (
    f"{CLIPPED}: the t-interval reached past the values this number can take ([0, 1] for accuracy, macro-F1 and "
    "shares of clients, [−1, 1] for their differences) and is clipped there (too few seeds for a tighter one); "
    "its unclipped ends are in the CSV (`_lo_raw`, `_hi_raw`) and `--json` (`lo_raw`, `hi_raw`)."
)


def headline(target: float | None) -> tuple[str, ...]:
    """The numeric columns aggregated over seeds (``time_to_target`` with ``--target``)."""
    return HEADLINE if target is None else (*HEADLINE[:-1], "time_to_target", HEADLINE[-1])


def column_bounds(column: str, metric: str, difference: bool = False) -> seeds.Bounds | None:
    """The values a headline column can take, which its intervals are clipped to (None: unbounded).

    The six model columns are in the task's metric (accuracy, macro-F1: [0, 1];
    perplexity: unbounded), the share of clients is in [0, 1], communication and times
    are unbounded; ``difference``: of two such values (config − baseline), [-1, 1].
    """
    bounds = None
    if column == "closer_is_better_share":
        bounds = _SHARE
    elif column in IN_METRIC:
        bounds = metric_bounds(metric)
    return seeds.difference_bounds(bounds) if difference else bounds


@dataclass(frozen=True)
class ByConfig:
    """Runs grouped by config without the seed, their statistics, and paired differences against a baseline."""

    rows: list[dict[str, object]]  # one per run kept (the latest run of each config and seed)
    groups: list[seeds.GroupStats]
    labels: dict[str, str]  # config id -> readable label
    metric: dict[str, str]  # config id -> the task's primary metric
    paired: list[seeds.PairedStats] = field(default_factory=list)
    baseline: str | None = None  # config id
    superseded: list[str] = field(default_factory=list)  # run ids of older runs of the same config and seed


def _stat_cell(s: seeds.Summary, column: str, runs: int, bounds: seeds.Bounds | None, signed: bool = False) -> str:
    """``mean ± std [lo, hi]`` (an end clipped to ``bounds`` marked ``CLIPPED``); one value alone (no interval
    from one run); ``(n=k)`` when runs lack the metric."""
    if s.n == 0:
        return "–"

    def num(value: float, sign: bool = signed) -> str:
        text = _cell(value, column)
        return f"+{text}" if sign and value >= 0 and not math.isnan(value) else text

    text = num(s.mean)
    if s.has_interval:
        i = seeds.interval(s, bounds)
        lo, hi = num(i.lo) + CLIPPED * i.lo_clipped, num(i.hi) + CLIPPED * i.hi_clipped
        text += f" ± {num(s.std, False)} [{lo}, {hi}]"
    return text + (f" (n={s.n})" if s.n < runs else "")


def _stat_row(
    summaries: Mapping[str, seeds.Summary], metrics: Sequence[str], metric: str, runs: int, difference: bool
) -> tuple[list[str], bool]:
    """One config's cells of a by-config table, and whether any interval end in them was clipped."""
    bounds = {c: column_bounds(c, metric, difference) for c in metrics}
    cells = [_stat_cell(summaries[c], c, runs, bounds[c], signed=difference) for c in metrics]
    return cells, any(seeds.interval(summaries[c], bounds[c]).clipped for c in metrics)


def _seed_list(values: Sequence[int]) -> str:
    return ", ".join(str(s) for s in values) + f" ({len(values)})"


def by_config_markdown(result: ByConfig, target: float | None = None) -> str:
    """One row per config (mean ± std [95% interval] per headline metric), then the paired table if any."""
    metrics = headline(target)
    rows: list[list[str]] = []
    clipped = False
    for g in result.groups:
        cells, cut = _stat_row(g.metrics, metrics, result.metric[g.config], len(g.seeds), difference=False)
        clipped |= cut
        rows.append([result.labels[g.config], result.metric[g.config], _seed_list(g.seeds), *cells])
        if any(g.metrics[c].n for c in BASELINE_COLUMNS if c in g.metrics):  # its runs logged their baselines
            rows.append(["↳ trivial baseline", result.metric[g.config], "", *_baseline_stats(g, metrics, result)])
    lines = [
        table_markdown(["config", "metric", "seeds (n)", *(HEADERS[c] for c in metrics)], rows),
        "",
        "mean ± sample std over seeds [95% t-interval of the mean: mean ± t(0.975, n−1)·std/√n]; "
        "one seed: its value, no interval; (n=k): only k runs have the number.",
        *([CLIPPED_NOTE] if clipped else []),
    ]
    if result.baseline is not None:
        lines += ["", *_paired_markdown(result, metrics, result.baseline)]
    return "\n".join(lines)


def _baseline_stats(group: seeds.GroupStats, metrics: Sequence[str], result: ByConfig) -> list[str]:
    """A config's trivial-baseline cells: the model columns' baselines over its seeds, blank elsewhere."""
    metric = result.metric[group.config]
    return [
        _stat_cell(group.metrics[baseline_column(c)], c, len(group.seeds), column_bounds(c, metric))
        if c in IN_METRIC
        else ""
        for c in metrics
    ]


def _paired_markdown(result: ByConfig, metrics: Sequence[str], baseline: str) -> list[str]:
    """The paired table of ``by_config_markdown``: each config minus ``baseline`` on common seeds, and its note."""
    base = result.labels[baseline]
    rows: list[list[str]] = []
    clipped = False
    for p in result.paired:
        cells, cut = _stat_row(p.metrics, metrics, result.metric[p.config], len(p.seeds), difference=True)
        clipped |= cut
        rows.append([result.labels[p.config], _seed_list(p.seeds) if p.seeds else "no seed in common", *cells])
    return [
        table_markdown(["config", f"vs {base}: seeds paired (n)", *(HEADERS[c] for c in metrics)], rows),
        "",
        f"config − {base} on the same seeds: mean difference ± std of the differences [95% t-interval]; "
        f"{result.metric[baseline]}: an interval that excludes 0 is a difference these seeds support.",
        *([CLIPPED_NOTE] if clipped else []),
    ]


_STATS = ("n", "mean", "std", "lo", "hi", "lo_raw", "hi_raw")  # per headline number in the CSVs and --json


def _stat_fields(s: seeds.Summary, bounds: seeds.Bounds | None) -> list[object]:
    i = seeds.interval(s, bounds)
    return [s.n, s.mean, s.std, i.lo, i.hi, i.lo_raw, i.hi_raw]


def by_config_csv(result: ByConfig, target: float | None = None) -> str:
    """One row per config, full precision: per headline metric its n, mean, std and 95% interval (NaN: none)."""
    metrics = headline(target)
    header = ["config", "config_id", "metric", "n_runs", "seeds", "run_ids"]
    header += [f"{c}_{stat}" for c in metrics for stat in _STATS]
    lines = (
        [
            result.labels[g.config],
            g.config,
            result.metric[g.config],
            len(g.seeds),
            " ".join(map(str, g.seeds)),
            " ".join(g.run_ids),
            *(v for c in metrics for v in _stat_fields(g.metrics[c], column_bounds(c, result.metric[g.config]))),
        ]
        for g in result.groups
    )
    return table_csv(header, lines)


def paired_csv(result: ByConfig, target: float | None = None) -> str:
    """One row per config against the baseline: per headline metric the n, mean, std and interval of the differences."""
    metrics = headline(target)
    header = ["config", "config_id", "baseline", "baseline_id", "seeds"]
    header += [f"{c}_diff_{stat}" for c in metrics for stat in _STATS]
    lines = (
        [
            result.labels[p.config],
            p.config,
            result.labels[p.baseline],
            p.baseline,
            " ".join(map(str, p.seeds)),
            *(
                v
                for c in metrics
                for v in _stat_fields(p.metrics[c], column_bounds(c, result.metric[p.config], difference=True))
            ),
        ]
        for p in result.paired
    )
    return table_csv(header, lines)


def _stat_json(s: seeds.Summary, bounds: seeds.Bounds | None) -> dict[str, object]:
    return {k: _number(v) for k, v in zip(_STATS, _stat_fields(s, bounds), strict=True)}


def _baseline_stats_json(group: seeds.GroupStats, metric: str) -> dict[str, object] | None:
    """A config's trivial baselines over its seeds in ``--json`` (null: its runs logged none)."""
    found = {c: group.metrics.get(baseline_column(c)) for c in IN_METRIC}
    if not any(s is not None and s.n for s in found.values()):
        return None
    return {c: _stat_json(s, column_bounds(c, metric)) for c, s in found.items() if s is not None}


def by_config_json(result: ByConfig, target: float | None = None) -> list[dict[str, object]]:
    """``bhfl compare --by-config --json``: one object per config (README, "The CLI").

    ``stats``: per headline metric its n, mean, sample std and 95% interval [lo, hi] over
    seeds (null: none), clipped to what the number can be (``column_bounds``), with the
    t-interval's own ends as ``lo_raw``, ``hi_raw``; ``paired`` (with ``--baseline``): the
    same of the differences against the baseline on the seeds both ran, null for the
    baseline itself.
    """
    metrics = headline(target)
    paired = {p.config: p for p in result.paired}
    out: list[dict[str, object]] = []
    for g in result.groups:
        pair = paired.get(g.config)
        out.append(
            {
                "config": result.labels[g.config],
                "config_id": g.config,
                "metric": result.metric[g.config],
                "seeds": list(g.seeds),
                "run_ids": list(g.run_ids),
                "stats": {c: _stat_json(g.metrics[c], column_bounds(c, result.metric[g.config])) for c in metrics},
                "trivial_baseline": _baseline_stats_json(g, result.metric[g.config]),
                "baseline": None if result.baseline is None else result.labels[result.baseline],
                "paired": None
                if pair is None
                else {
                    "seeds": list(pair.seeds),
                    "diff": {
                        c: _stat_json(pair.metrics[c], column_bounds(c, result.metric[g.config], difference=True))
                        for c in metrics
                    },
                },
            }
        )
    return out
