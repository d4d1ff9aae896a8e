"""Experiment reports: per-evaluation MLflow metrics, and the final artefacts of a run.

``log_evaluation`` runs after every evaluation (``eval.every`` and the final one):
each server's run gets ``eval/<test_set>/<metric>`` and its client distributions
``dist/<subtree|all>/<metric>_<stat>`` with ``step = root round``; the parent run
gets the headlines and the evaluation's wall time.

``write_report`` runs once at the end. It writes, under ``<run folder>/report/`` and
then to the parent run's artefacts (same layout):

    report.md                     the key numbers together, with the two figures (flows/tracking/report_markdown.py)
    eval/matrix.csv               node,level,test_set,metric,value (every model x test set)
    eval/distribution.csv         per model: distribution over its subtree's clients and over all clients
    eval/clients.csv              per client: each relative's model on its test split, gain vs local-only
    eval/proximity.csv            metric vs tree distance (all pairs, own path, off path)
    eval/proximity_clients.csv    per client: Spearman rho(distance, quality), path monotone
    eval/communication.csv        models and bytes per server, round, direction, kind
    eval/communication_levels.csv the same summed per level
    eval/heatmap.png, eval/proximity.png, eval/clients_histogram.png (and an SVG beside each; none with
                                  ``eval.figures: false``, which leaves the rest as it is)

Communication and evaluation time are read back from MLflow metric histories (not
in-process counters), so a resumed run reports the whole run. The trivial baseline of
the run's task (bhfl_core/analysis/trivial_baselines.py: each client's majority training
label, or a unigram model for masked LM) is computed from the data here, shown beside the
headlines in report.md and logged to the parent run as ``baseline/<kind>/<headline key>``;
``write_report`` returns its value of each headline too, for the end-of-run summary.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure

from bhfl_core.algorithm.round_tail import VIRTUAL_TIME
from bhfl_core.analysis import communication as comm
from bhfl_core.analysis import proximity
from bhfl_core.analysis import time_to_accuracy as tta
from bhfl_core.analysis.distribution import clients_csv, distribution, distribution_csv
from bhfl_core.analysis.evaluation import MATRIX_HEADER, Evaluation, matrix_lines
from bhfl_core.analysis.matrix_axes import PROXY, UNION
from bhfl_core.analysis.trivial_baselines import TrivialBaseline, headline_metrics
from bhfl_core.store.atomic import write_text_atomic
from bhfl_core.store.tables import table_csv, write_csv_atomic
from data_prep.figures import save_png
from flows.tracking import plots
from flows.tracking.baselines import trivial_baseline
from flows.tracking.privacy_report import (
    CLIENT_EPSILON_MAX,
    PrivacyRow,
    client_epsilons,
    curve_csv,
    epsilon_max,
    privacy_rows,
)
from flows.tracking.report_html import write_report_html
from flows.tracking.report_markdown import RELATION_NAMES, ReportInputs, render_markdown
from flows.tracking.tracker import Tracker
from tasks.context import RunContext

REPORT_DIR = "report"
RESULTS_MARK = "\n\n**Results**"


@dataclass(frozen=True)
class Headlines:
    """What the end of a run shows: its headline numbers, and the trivial baseline's value of those it has one of.

    ``baseline`` has ``own``'s keys (``root/union/accuracy``: the global prior's accuracy on
    the union), so a reader sees beside each number what no training would get;
    ``baseline_name`` is the baseline's kind (``majority``, ``unigram``; "" for a task without one).
    """

    own: dict[str, float]
    baseline: dict[str, float] = field(default_factory=dict)
    baseline_name: str = ""


def _num(value: float | None) -> float:
    return math.nan if value is None else value


def save_figure(fig: Figure, path: Path) -> None:
    """Write a figure as PNG and SVG beside it (``data_prep.figures.save_png``: atomic, under its draw lock)."""
    save_png(fig, path)


def log_evaluation(tracker: Tracker, ev: Evaluation, step: int, seconds: Mapping[str, float]) -> dict[str, float]:
    """Per-node metrics (server runs) and parent headlines for one evaluation, at ``step``."""
    for node in ev.tree.servers():
        if node.id in ev.models:
            tracker.log_node(node.id, ev.node_metrics(node.id), step)
    headline = ev.headline()
    tracker.log_metrics(tracker.parent_id, {**headline, **seconds}, step)
    return headline


def _communication(tracker: Tracker, ctx: RunContext) -> tuple[list[comm.CommRow], int]:
    theta = ctx.store.load_model(ctx.tree.root_id)
    if theta is None:
        raise RuntimeError(f"the root has no saved model in {ctx.store.root}; nothing to report")
    history = {
        node: {key: tracker.history(run_id, key) for key in comm.HISTORY_KEYS}
        for node, run_id in tracker.node_runs.items()
    }
    return comm.comm_rows(ctx.tree, history, theta.numel()), theta.numel()


def _time_curves(tracker: Tracker, ev: Evaluation) -> dict[str, list[tta.CurvePoint]]:
    """Root on the union, and clients' own models (mean), at every evaluation against virtual time."""
    metric = ev.task.primary
    virtual = tracker.history(tracker.parent_id, VIRTUAL_TIME)
    keys = {
        "root on union": f"root/union/{metric}",
        "client's own model (mean)": f"client_on_own_clients/{metric}_mean",
    }
    curves = {label: tta.curve(virtual, tracker.history(tracker.parent_id, key)) for label, key in keys.items()}
    return {label: points for label, points in curves.items() if points}


def _curves_csv(curves: Mapping[str, Sequence[tta.CurvePoint]]) -> str:
    return table_csv(
        ["population", "step", "virtual_s", "value"],
        ([label, p.step, f"{p.virtual_s:.6f}", f"{p.value:.6f}"] for label, points in curves.items() for p in points),
    )


def _write_tables(
    folder: Path,
    ev: Evaluation,
    prox: proximity.Proximity,
    rows: Sequence[comm.CommRow],
    levels: Sequence[comm.LevelSummary],
) -> None:
    """The CSV tables under ``folder``."""
    write_csv_atomic(folder / "eval" / "matrix.csv", MATRIX_HEADER, matrix_lines(ev.rows()))  # streamed: it is large
    files = {
        "eval/distribution.csv": distribution_csv(ev.distribution_rows()),
        "eval/clients.csv": clients_csv(ev.client_rows()),
        "eval/proximity.csv": proximity.curve_csv(prox),
        "eval/proximity_clients.csv": proximity.clients_csv(prox),
        "eval/communication.csv": comm.rows_csv(rows),
        "eval/communication_levels.csv": comm.summary_csv(levels),
    }
    for name, text in files.items():
        write_text_atomic(folder / name, text)


def _draw_figures(
    folder: Path,
    ev: Evaluation,
    prox: proximity.Proximity,
    curves: Mapping[str, Sequence[tta.CurvePoint]],
    dp_rows: Sequence[PrivacyRow],
) -> None:
    """The report's figures under ``folder``: the heatmap, proximity and clients' histogram; quality against
    virtual time and the DP servers' epsilon where there are any. The same numbers are in the CSV tables."""
    save_figure(plots.heatmap(ev), folder / "eval" / "heatmap.png")
    save_figure(plots.proximity_plot(ev, prox), folder / "eval" / "proximity.png")
    save_figure(plots.clients_histogram(ev), folder / "eval" / "clients_histogram.png")
    if curves:
        save_figure(plots.time_to_accuracy_plot(curves, ev.task.primary), folder / "eval" / "time_to_accuracy.png")
    if dp_rows:
        budgets = {r.node: r.budget for r in dp_rows if r.budget is not None}
        save_figure(plots.epsilon_plot({r.node: r.curve for r in dp_rows}, budgets), folder / "eval" / "privacy.png")


def write_report(
    tracker: Tracker, ctx: RunContext, ev: Evaluation, timings: Mapping[str, float], step: int | None = None
) -> Headlines:
    """Write the run's report files, log them and the summary metrics to the parent run; return headlines.

    ``step``: the evaluation's step (default: the last root round; a forced re-evaluation's is later).
    The trivial baseline's headlines are logged (``baseline/<kind>/...``) and returned apart from
    the run's own (its run-list columns), which the summary shows them beside.
    """
    folder = ctx.run_path / REPORT_DIR
    final_step = ctx.tree.root.settings.rounds if step is None else step
    prox = proximity.analyse(ev)
    comm_rows, num_params = _communication(tracker, ctx)
    levels = comm.summarise(ctx.tree, comm_rows)
    totals = comm.totals(comm_rows)
    _write_tables(folder, ev, prox, comm_rows, levels)
    curves = _time_curves(tracker, ev)
    if curves:
        write_text_atomic(folder / "eval" / "time_to_accuracy.csv", _curves_csv(curves))
    dp_rows = privacy_rows(tracker, ctx.tree, ctx.store)
    if dp_rows:
        write_text_atomic(folder / "eval" / "privacy_epsilon.csv", curve_csv(dp_rows))
    if ctx.config.eval.figures:  # (drawing them is most of a small run's report: docs/evaluation.md)
        _draw_figures(folder, ev, prox, curves, dp_rows)
    dp_clients = client_epsilons(ctx.tree, ctx.store)
    privacy = {**epsilon_max(dp_rows), **({CLIENT_EPSILON_MAX: max(dp_clients.values())} if dp_clients else {})}
    headline = {
        **ev.headline(),
        **privacy,
        **{k: v for k, v in proximity.headline(prox).items() if "share_clients" in k},
        "comm/total_model_equivalents": totals["comm/total_model_equivalents"],
    }
    baseline = trivial_baseline(ctx)
    inputs = ReportInputs(
        tracker.parent_id, ctx, ev, prox, levels, totals, num_params, timings, curves, dp_rows, dp_clients, baseline
    )
    write_text_atomic(folder / "report.md", render_markdown(inputs))
    write_report_html(folder / "report.md", f"{ctx.config.name}: report")  # the same, figures inline (MLflow UI)

    tracker.log_artifacts(folder)
    ctx.faults.hit("report")
    # (the evaluation's headlines are at this step already: log_evaluation)
    baselines = headline_metrics(ev, baseline) if baseline is not None else {}
    tracker.log_metrics(tracker.parent_id, {**proximity.headline(prox), **totals, **privacy, **baselines}, final_step)
    tracker.set_tags({"bhfl.task": ev.task.task, "bhfl.model_params": str(num_params), "bhfl.report": "report.html"})
    tracker.share_headline_view([*headline, "time/total_s"])
    _describe_runs(tracker, ctx, ev, prox, totals, baseline)
    if baseline is None:
        return Headlines(headline)
    beside = {key: baselines[baseline.kind.key(key)] for key in headline if baseline.kind.key(key) in baselines}
    return Headlines(headline, beside, baseline.kind.name)


def _describe_runs(
    tracker: Tracker,
    ctx: RunContext,
    ev: Evaluation,
    prox: proximity.Proximity,
    totals: Mapping[str, float],
    baseline: TrivialBaseline | None,
) -> None:
    """Run descriptions with the key numbers, so the UI's run pages say what the run found."""
    metric = ev.task.primary
    h = ev.headline()
    parts = [
        f"root on union {h.get(f'root/union/{metric}', math.nan):.3f}, "
        f"on proxy {h.get(f'root/proxy/{metric}', math.nan):.3f}"
    ]
    for relation in ("client", "personal", "edge", "root", "adapted", "local_only"):
        key = f"{relation}_on_own_clients/{metric}"
        if f"{key}_mean" in h:
            parts.append(
                f"{RELATION_NAMES[relation]} on each client: mean {h[key + '_mean']:.3f}, "
                f"worst 10% {h[key + '_worst10']:.3f}"
            )
    if baseline is not None:
        own = distribution(baseline.per_client(ev.clients, metric), ev.task.better(metric))
        parts.append(
            f"trivial baseline ({baseline.kind.own}): mean {own.mean:.3f} on each client, "
            f"{baseline.scores[UNION][metric]:.3f} on union"
        )
    parts.append(f"closer is better for {prox.share_rank:.0%} of clients (rank) / {prox.share_path:.0%} (path)")
    parts.append(f"communication {comm.human_bytes(totals['comm/total_bytes'])}")
    base = tracker.note(tracker.parent_id).split(RESULTS_MARK)[0]
    tracker.describe(tracker.parent_id, f"{base}{RESULTS_MARK} ({metric}): " + "; ".join(parts) + ". See report.md.")
    for node in ctx.tree.servers():
        run_id = tracker.node_runs.get(node.id)
        if run_id is None or node.id not in ev.models:
            continue
        s = node.settings
        clients = ev.population(node.id)
        d = distribution(ev.per_client(node.id, clients), ev.task.better(metric))
        what = {"root": "Root server", "server": "Intermediate server", "edge": "Edge server"}[node.role.value]
        tracker.describe(
            run_id,
            (
                f"{what} `{node.id}` (level {node.depth}{f', {node.group}' if node.group else ''}): "
                f"{len(node.children)} children, {len(clients)} clients, {node.weight:.0f} training examples; "
                f"{s.rounds} round(s) per execution, cohort {s.cohort or 'all'}, "
                f"up {s.opt_up.kind} eta {s.opt_up.eta:g}, "
                f"down {s.opt_down.kind} eta {s.opt_down.eta:g}{', proxy training' if s.train is not None else ''}."
                f"{RESULTS_MARK} ({metric}): on its clients' tests mean {d.mean:.3f}, worst 10% {d.worst10:.3f}; "
                f"union {_num(ev.value(node.id, UNION)):.3f}; proxy {_num(ev.value(node.id, PROXY)):.3f}."
            ),
        )
