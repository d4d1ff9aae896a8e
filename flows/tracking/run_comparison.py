"""The runs ``bhfl compare`` and a sweep's report show, read from the MLflow store, one row each.

``resolve`` finds the experiment run a reference names (a run id, a unique prefix of
one, or an experiment's latest finished run: flows/cli/compare.py says what a user may
give), ``row`` reads its headline numbers from the metrics ``flows.tracking.report``
logged at the end of the run, so any finished run in any store can be compared, and
``compare_by_config`` groups runs by config without the seed (bhfl_core/analysis/seeds.py)
and pairs them against a baseline config. It lives in tracking, not in the CLI, because
a sweep's report (``sweep_report.py``) shows the same; the tables made of these rows are
bhfl_core/analysis/comparison.py's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

from mlflow import MlflowClient
from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from bhfl_core.algorithm.round_tail import VIRTUAL_TIME
from bhfl_core.analysis import seeds
from bhfl_core.analysis import time_to_accuracy as tta
from bhfl_core.analysis.comparison import BASELINE_COLUMNS, ByConfig, baseline_column, headline, headline_keys
from bhfl_core.analysis.trivial_baselines import trivial_kind
from bhfl_core.learning.metrics import task_metrics

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


def row(client: MlflowClient, run: Run, target: float | None = None) -> dict[str, object]:
    """One table row: the run's headline metrics in the task's primary metric.

    ``target``: also the virtual time at which the root first reached ``target`` on the
    union of the clients' tests (NaN if it never did; evaluations every ``eval.every`` rounds).
    """
    m, tags = run.data.metrics, run.data.tags
    task_name = tags.get("bhfl.task", "classification")
    task = task_metrics(task_name)
    metric = task.primary
    nan = math.nan
    comm_bytes = m.get("comm/total_bytes", nan)
    keys = headline_keys(metric)
    trivial = trivial_kind(task_name)
    out: dict[str, object] = {
        "experiment": client.get_experiment(run.info.experiment_id).name,
        "run_id": run.info.run_id,
        "metric": metric,
        **{column: m.get(key, nan) for column, key in keys.items()},
        # the trivial baseline of each of those headlines (the report's; NaN: a run that logged none)
        "baseline_kind": trivial.name if trivial is not None else "",
        **{baseline_column(c): m.get(trivial.key(k), nan) if trivial else nan for c, k in keys.items()},
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


_NOT_SETTINGS = "bhfl.kind"  # tag of a pipeline's run (its params are its stages' configs)


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
        groups = seeds.aggregate(rows, (*metrics, *BASELINE_COLUMNS))
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
