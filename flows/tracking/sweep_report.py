"""A sweep's report: its configs over seeds, paired differences against its baseline, metrics against swept keys.

Written into ``<sweep folder>/report/`` once the sweep's points have run (also after a
resume, over every finished point) and logged as artefacts of the sweep's MLflow run:

- ``report.md``: one row per config (mean ± std [95% interval], seeds), the same table
  as ``bhfl compare --by-config``; with ``baseline:`` in the sweep file, the paired
  differences of every config against it on the seeds both ran;
- ``seeds.csv`` / ``paired.csv``: the same at full precision;
- ``seeds_<key>.png``: each quality metric against each swept key (a key with two or
  more values), a line per combination of the other keys (flows/tracking/seed_plots.py).

The numbers come from the MLflow store (the points' headline metrics, as ``bhfl
compare`` reads them), so the report and the command agree by construction.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from mlflow import MlflowClient

from bhfl_core.analysis import seeds
from bhfl_core.analysis.comparison import HEADERS, by_config_csv, by_config_markdown, column_bounds, paired_csv
from bhfl_core.config.sweep import Sweep, config_label
from bhfl_core.store.atomic import write_text_atomic
from flows.records.sweep_record import SweepRecord
from flows.tracking.report_html import write_report_html
from flows.tracking.run_comparison import compare_by_config
from flows.tracking.seed_plots import save_metric_plots

REPORT_DIR = "report"
PLOTTED = ("leaf_mean", "leaf_worst10", "parent_mean", "parent_worst10", "root_union", "root_proxy")


def write_sweep_report(folder: Path, sweep: Sweep, record: SweepRecord) -> Path | None:
    """Write the report of the sweep's finished points into ``folder/report``; its ``report.md`` (None: none)."""
    finished = [p for p in sweep if record.points[p.label].status == "finished" and record.points[p.label].run_id]
    if not finished:
        return None
    client = MlflowClient(record.tracking_uri)
    run_of = {record.points[p.label].run_id: p for p in finished}
    baseline = None
    if sweep.baseline is not None:
        baseline = next((r for r, p in run_of.items() if config_label(p.label) == sweep.baseline), None)
    result = compare_by_config(client, list(run_of), baseline=baseline)
    # the sweep's own names for its configs (variant and grid values), not labels guessed from the params
    named = {str(row[seeds.CONFIG]): config_label(run_of[str(row[seeds.RUN])].label) for row in result.rows}
    result = replace(result, labels={c: named.get(c) or label for c, label in result.labels.items()})
    out = folder / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "seeds.csv", by_config_csv(result))
    if result.baseline is not None:
        write_text_atomic(out / "paired.csv", paired_csv(result))

    # what each config sets of the swept keys (the seed is what varies inside a config)
    settings = {
        str(row[seeds.CONFIG]): {k: str(v) for k, v in run_of[str(row[seeds.RUN])].values.items() if k != "seed"}
        for row in result.rows
    }
    keys = [k for k in dict.fromkeys(k for s in settings.values() for k in s) if _values(settings, k) > 1]
    titles = {m: HEADERS[m] for m in PLOTTED}
    metric = next(iter(result.metric.values()), "")
    bounds = {m: column_bounds(m, metric) for m in PLOTTED}  # bars stop where the tables' intervals do
    plots = save_metric_plots(result.groups, settings, keys, PLOTTED, out, titles, bounds) if keys else []

    lines = [f"# Sweep `{sweep.name}`", ""]
    lines += [
        f"{len(finished)} of {len(sweep)} experiment(s) finished, {len(result.groups)} config(s). "
        "Each number: mean ± sample std over seeds [95% t-interval of the mean]; a config with one "
        "seed has no interval. Same table: `bhfl compare <runs> --by-config`.",
        "",
        by_config_markdown(result),
    ]
    if sweep.baseline is not None and result.baseline is None:
        lines += ["", f"The baseline `{sweep.baseline}` has no finished run yet: no paired differences."]
    lines += ["", *(f"![{p.stem}]({p.name})" for p in plots)]
    report = out / "report.md"
    write_text_atomic(report, "\n".join(lines) + "\n")
    write_report_html(report, f"sweep {sweep.name}: report")
    return report


def _values(settings: dict[str, dict[str, str]], key: str) -> int:
    return len({s[key] for s in settings.values() if key in s})
