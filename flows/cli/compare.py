"""``bhfl compare``: several experiment runs side by side, read from the MLflow store.

A reference is a parent run id (full, or a unique prefix of at least 8 characters: every
id printed is the full one), or an experiment name (its latest finished run; with
``--all`` every finished run of it). ``--by-config`` aggregates seeds instead
(``compare_by_config``): an experiment name then stands for all its finished runs,
grouped by config without the seed (bhfl_core/analysis/seeds.py), one row per config
with mean ± std and the 95% interval, and ``--baseline`` adds paired differences
against one config. ``--json`` gives the same as JSON (``rows_json``, ``by_config_json``).
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mlflow import MlflowClient
from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from bhfl_core.algorithm.engine import VIRTUAL_TIME
from bhfl_core.analysis import seeds
from bhfl_core.analysis import time_to_accuracy as tta
from bhfl_core.learning.metrics import metric_bounds, task_metrics
from bhfl_core.store.tables import table_csv

_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
_ID_PREFIX = re.compile(r"^[0-9a-f]{8,31}$")  # flows/records/listing.py MIN_ID_PREFIX


class CompareError(ValueError):
    """A reference that names no run or experiment in the store; the message says which."""


def _checked(run: Run, ref: str) -> Run:
    """``run`` if it is an experiment (or pipeline) run; a node's run is an error naming where to look."""
    parent = run.data.tags.get(MLFLOW_PARENT_RUN_ID)
    if parent and "bhfl.pipeline_stage" not in run.data.tags:  # a stage's run is an experiment run
        node = run.data.tags.get("bhfl.node", run.info.run_name)
        raise CompareError(
            f"{ref}: this is the run of node {node!r}; compare experiment runs, "
            f"e.g. its top-level run (follow the parent runs up from {parent})"
        )
    return run


def _by_id(client: MlflowClient, ref: str) -> Run | None:
    """The run whose id is ``ref``, or the one run whose id starts with ``ref`` (8+ hex digits); else None."""
    if _RUN_ID.match(ref):
        try:
            return _checked(client.get_run(ref), ref)
        except MlflowException:
            return None
    if not _ID_PREFIX.match(ref):
        return None
    experiments = [e.experiment_id for e in client.search_experiments(max_results=50_000)]
    found = client.search_runs(experiments, f"attributes.run_id LIKE '{ref}%'", max_results=11) if experiments else []
    if len(found) > 1:
        ids = ", ".join(r.info.run_id for r in found[:10])
        count = str(len(found)) if len(found) <= 10 else "more than 10"
        raise CompareError(f"{ref}: the start of {count} run ids ({ids}); give more characters of the one you mean")
    return _checked(found[0], ref) if found else None


def resolve(client: MlflowClient, ref: str) -> Run:
    """The experiment run a reference names (a run id or a unique prefix of one, or an experiment's latest
    finished run)."""
    if _RUN_ID.match(ref) and (run := _by_id(client, ref)) is not None:
        return run
    experiment = client.get_experiment_by_name(ref)
    if experiment is None:
        if (run := _by_id(client, ref)) is not None:
            return run
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
    m, tags = run.data.metrics, run.data.tags
    task = task_metrics(tags.get("bhfl.task", "classification"))
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
        # not table columns; in --json: where the run's files are, its MLflow status
        "run_path": tags.get("bhfl.run_path") or tags.get("bhfl.pipeline_path") or tags.get("bhfl.sweep_path"),
        "status": run.info.status.lower(),
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


def compare(
    client: MlflowClient, refs: Sequence[str], target: float | None = None, every: bool = False
) -> list[dict[str, object]]:
    """One row per reference; ``every``: an experiment name gives all its finished runs, oldest first."""
    runs: list[Run] = []
    for ref in refs:
        if every and client.get_experiment_by_name(ref) is not None:
            runs += sorted(_experiment_runs(client, ref), key=lambda r: (r.info.start_time or 0, r.info.run_id))
        else:
            runs.append(resolve(client, ref))
    return [row(client, run, target) for run in runs]


def _number(value: object) -> object:
    """A JSON value: NaN (a number the run lacks) is null."""
    return None if isinstance(value, float) and math.isnan(value) else value


JSON_KEYS = ("run_path", "status")


def rows_json(rows: Sequence[dict[str, object]], target: float | None = None) -> list[dict[str, object]]:
    """``bhfl compare --json``: one object per run, the table's columns (full precision, null: none) and
    ``run_path``, ``status`` (README, "The CLI")."""
    keys = (*columns(target), *JSON_KEYS)
    out = [{k: _number(r.get(k)) for k in keys} for r in rows]
    for r in out:  # a param (text) in MLflow; a number here, null where the run has none
        rounds = str(r["root_rounds"] or "")
        r["root_rounds"] = int(rounds) if rounds.isdigit() else None
    return out


def _cell(value: object, column: str) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "–"
        if column in ("comm_model_equivalents", "wall_s", "virtual_s", "time_to_target"):
            return f"{value:.0f}"
        return f"{value:.2f}" if column == "comm_mb" else f"{value:.4f}"
    return str(value)  # run ids in full: any printed id is one `bhfl compare` and `bhfl resume` take


def to_markdown(rows: Sequence[dict[str, object]], target: float | None = None) -> str:
    cols = columns(target)
    lines = ["| " + " | ".join(HEADERS[c] for c in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(_cell(r[c], c) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def to_csv(rows: Sequence[dict[str, object]], target: float | None = None) -> str:
    """Full-precision CSV (NaN where a run lacks a number), one row per run."""
    cols = columns(target)
    return table_csv(cols, ([r.get(c) for c in cols] for r in rows))


# ---------------------------------------------------------------- over seeds: --by-config, --baseline

HEADLINE = tuple(c for c in COLUMNS if c not in ("experiment", "run_id", "metric", "root_rounds"))
_NOT_SETTINGS = "bhfl.kind"  # tag of a pipeline's run (its params are its stages' configs)
_IN_METRIC = ("leaf_mean", "leaf_worst10", "parent_mean", "parent_worst10", "root_union", "root_proxy")
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
    elif column in _IN_METRIC:
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


def _experiment_runs(client: MlflowClient, ref: str) -> list[Run]:
    """Every finished experiment run a reference names: a run id (or prefix) alone, or all of an experiment's."""
    if _RUN_ID.match(ref):
        return [resolve(client, ref)]
    experiment = client.get_experiment_by_name(ref)
    if experiment is None:
        if (run := _by_id(client, ref)) is not None:
            return [run]
        raise CompareError(f"{ref!r} is neither a run id nor an experiment name in this MLflow store")
    runs = [
        run
        for run in client.search_runs([experiment.experiment_id], "attributes.status = 'FINISHED'", max_results=50_000)
        # experiment runs (they carry a config hash) and pipelines' runs; not node runs, not a pipeline's stages
        if ("bhfl.config_hash" in run.data.tags or run.data.tags.get(_NOT_SETTINGS) == "pipeline")
        and "bhfl.node" not in run.data.tags
        and ("bhfl.pipeline_stage" not in run.data.tags or "bhfl.sweep" in run.data.tags)  # a sweep's points count
    ]
    if not runs:
        raise CompareError(f"experiment {ref!r} has no finished run yet")
    return runs


def run_seed(run: Run) -> int:
    """The seed a run was made with: its ``bhfl.seed`` tag, else its ``seed`` param (a pipeline: its stages')."""
    tags, params = run.data.tags, run.data.params
    found = {tags["bhfl.seed"]} if "bhfl.seed" in tags else {params["seed"]} if "seed" in params else set()
    if not found:
        found = {v for k, v in params.items() if k.startswith("stages.") and k.split(".", 2)[2:] == ["seed"]}
    if len(found) != 1:
        what = f"stage seeds {sorted(found)} differ" if found else "it has no bhfl.seed tag and no seed param"
        raise CompareError(f"run {run.info.run_id}: cannot tell its seed ({what}), so it cannot be grouped by config")
    value = found.pop()
    try:
        return int(value)
    except ValueError:
        raise CompareError(f"run {run.info.run_id}: seed {value!r} is not an integer") from None


def compare_by_config(
    client: MlflowClient, refs: Sequence[str], target: float | None = None, baseline: str | None = None
) -> ByConfig:
    """The runs ``refs`` name, one group per config without the seed: statistics over seeds, paired differences.

    A config is identified by its logged params without seed, name and runtime
    (``seeds.config_identity``), so runs made from one YAML with ``--set seed=N`` fall
    into one group wherever they were made. Two runs of one config and seed (a re-run)
    would count one draw twice: the latest is kept, the others listed in ``superseded``.
    ``baseline``: a config's label, its name, or a run id of one of its runs.
    """
    found: dict[str, Run] = {}
    for ref in refs:
        for run in _experiment_runs(client, ref):
            found[run.info.run_id] = run
    kept: dict[tuple[str, int], Run] = {}
    superseded = []
    names: dict[str, set[str]] = {}  # config id -> the names its runs were made under (one, unless copies)
    for run in sorted(found.values(), key=lambda r: r.info.start_time or 0, reverse=True):
        config = seeds.config_identity(run.data.params)
        key = (config, run_seed(run))
        if key in kept:
            superseded.append(run.info.run_id)
            continue
        kept[key] = run
        names.setdefault(config, set()).add(run.data.params.get("name", run.info.run_name or ""))
    params = {config: dict(run.data.params) for (config, _), run in kept.items()}
    configs = {config: ("+".join(sorted(names[config])), params[config]) for config in names}
    rows = []
    metric: dict[str, str] = {}
    for (config, seed), run in sorted(kept.items(), key=lambda item: item[1].info.start_time or 0):
        r = row(client, run, target)
        rows.append({**r, seeds.CONFIG: config, seeds.SEED: seed})
        primary = str(r["metric"])
        if metric.setdefault(config, primary) != primary:
            raise CompareError(f"config {configs[config][0]!r}: its runs report {metric[config]} and {primary}")
    labels = seeds.labels(configs)
    metrics = headline(target)
    try:
        groups = seeds.aggregate(rows, metrics)
        if baseline is None:
            return ByConfig(rows, groups, labels, metric, superseded=superseded)
        base = _baseline(client, baseline, labels, names)
        mismatched = [labels[c] for c in metric if metric[c] != metric[base]]
        if mismatched:
            raise CompareError(
                f"--baseline {baseline}: it reports {metric[base]}, configs {mismatched} do not; "
                "paired differences need the same metric"
            )
        pairs = seeds.paired(rows, metrics, base)
    except seeds.SeedStatsError as exc:
        raise CompareError(_labelled(str(exc), labels)) from None
    return ByConfig(rows, groups, labels, metric, pairs, base, superseded)


def _labelled(message: str, labels: Mapping[str, str]) -> str:
    """An error from the statistics with config ids replaced by their labels."""
    for config, label in labels.items():
        message = message.replace(f"'{config}'", repr(label)).replace(config, label)
    return message


def _baseline(client: MlflowClient, ref: str, labels: Mapping[str, str], names: Mapping[str, set[str]]) -> str:
    """The config id ``--baseline`` names: a label, else a config name held by one config, else one of its runs."""
    exact = [c for c, label in labels.items() if label == ref]
    if exact:
        return exact[0]
    named = [c for c, held in names.items() if ref in held]
    if len(named) == 1:
        return named[0]
    if len(named) > 1:
        raise CompareError(
            f"--baseline {ref}: {len(named)} configs are named {ref!r}; name one by its label: "
            + ", ".join(repr(labels[c]) for c in named)
        )
    if _RUN_ID.match(ref) or _ID_PREFIX.match(ref):
        try:
            run = _by_id(client, ref)
            config = seeds.config_identity(run.data.params) if run is not None else ""
        except (MlflowException, CompareError):
            config = ""
        if config in labels:
            return config
    raise CompareError(
        f"--baseline {ref}: no config in the table has this label, name or run; configs: "
        + ", ".join(repr(label) for label in labels.values())
    )


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
    cols = ["config", "metric", "seeds (n)", *(HEADERS[c] for c in metrics)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    clipped = False
    for g in result.groups:
        cells, cut = _stat_row(g.metrics, metrics, result.metric[g.config], len(g.seeds), difference=False)
        clipped |= cut
        lines.append(
            "| " + " | ".join([result.labels[g.config], result.metric[g.config], _seed_list(g.seeds), *cells]) + " |"
        )
    lines += [
        "",
        "mean ± sample std over seeds [95% t-interval of the mean: mean ± t(0.975, n−1)·std/√n]; "
        "one seed: its value, no interval; (n=k): only k runs have the number.",
        *([CLIPPED_NOTE] if clipped else []),
    ]
    if result.baseline is not None:
        base = result.labels[result.baseline]
        cols = ["config", f"vs {base}: seeds paired (n)", *(HEADERS[c] for c in metrics)]
        lines += ["", "| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
        clipped = False
        for p in result.paired:
            cells, cut = _stat_row(p.metrics, metrics, result.metric[p.config], len(p.seeds), difference=True)
            clipped |= cut
            seeds_cell = _seed_list(p.seeds) if p.seeds else "no seed in common"
            lines.append("| " + " | ".join([result.labels[p.config], seeds_cell, *cells]) + " |")
        lines += [
            "",
            f"config − {base} on the same seeds: mean difference ± std of the differences [95% t-interval]; "
            f"{result.metric[result.baseline]}: an interval that excludes 0 is a difference these seeds support.",
            *([CLIPPED_NOTE] if clipped else []),
        ]
    return "\n".join(lines)


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
