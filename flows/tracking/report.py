"""Experiment reports: per-evaluation MLflow metrics, and the final artefacts of a run.

``log_evaluation`` runs after every evaluation (``eval.every`` and the final one):
each server's run gets ``eval/<test_set>/<metric>`` and its client distributions
``dist/<subtree|all>/<metric>_<stat>`` with ``step = root round``; the parent run
gets the headlines and the evaluation's wall time.

``write_report`` runs once at the end. It writes, under ``<run folder>/report/`` and
then to the parent run's artefacts (same layout):

    report.md                     the key numbers together, with the two figures
    eval/matrix.csv               node,level,test_set,metric,value (every model x test set)
    eval/distribution.csv         per model: distribution over its subtree's clients and over all clients
    eval/clients.csv              per client: each relative's model on its test split, gain vs local-only
    eval/proximity.csv            metric vs tree distance (all pairs, own path, off path)
    eval/proximity_clients.csv    per client: Spearman rho(distance, quality), path monotone
    eval/communication.csv        models and bytes per server, round, direction, kind
    eval/communication_levels.csv the same summed per level
    eval/heatmap.png, eval/proximity.png (and an SVG beside each)

Communication and evaluation time are read back from MLflow metric histories (not
in-process counters), so a resumed run reports the whole run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.figure import Figure

from bhfl_core.algorithm.engine import VIRTUAL_TIME
from bhfl_core.analysis import communication as comm
from bhfl_core.analysis import proximity
from bhfl_core.analysis import time_to_accuracy as tta
from bhfl_core.analysis.evaluation import (
    PROXY,
    UNION,
    Evaluation,
    clients_csv,
    distribution,
    distribution_csv,
    matrix_csv,
)
from bhfl_core.store.atomic import write_text_atomic
from bhfl_core.store.tables import table_csv
from data_prep.figures import save_png
from flows.tracking import plots
from flows.tracking.privacy_report import CLIENT_EPSILON_MAX, client_epsilons, client_lines, epsilon_max, privacy_rows
from flows.tracking.privacy_report import HEADERS as PRIVACY_HEADERS
from flows.tracking.report_html import write_report_html
from flows.tracking.tracker import Tracker
from tasks import faults
from tasks.context import RunContext

REPORT_DIR = "report"
RESULTS_MARK = "\n\n**Results**"
RELATION_NAMES = {
    "client": "client's own model",
    "personal": "client's personal model (Ditto)",
    "edge": "its parent server",
    "server": "its intermediate server",
    "root": "root",
    "adapted": "locally adapted model",
    "local_only": "local-only model",
}


def _relation_names(ev: Evaluation) -> dict[str, str]:
    """RELATION_NAMES, with ``server-d<depth>`` after ``server`` where clients have several intermediate servers."""
    deep = {rel for c in ev.clients for rel, _ in ev.relatives(c) if rel.startswith("server-d")}
    out: dict[str, str] = {}
    for relation, name in RELATION_NAMES.items():
        out[relation] = name
        if relation == "server":
            for depth in sorted(int(r.removeprefix("server-d")) for r in deep):
                out[f"server-d{depth}"] = f"its intermediate server at depth {depth}"
    return out


def _num(value: float | None) -> float:
    return math.nan if value is None else value


def save_figure(fig: Figure, path: Path) -> None:
    """Write a figure as PNG and SVG beside it (``data_prep.figures.save_png``: atomic, under its draw lock)."""
    save_png(fig, path)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(v: object) -> str:
        if isinstance(v, float):
            return "–" if math.isnan(v) else f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


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


def write_report(
    tracker: Tracker, ctx: RunContext, ev: Evaluation, timings: Mapping[str, float], step: int | None = None
) -> dict[str, float]:
    """Write the run's report files, log them and the summary metrics to the parent run; return headlines.

    ``step``: the evaluation's step (default: the last root round; a forced re-evaluation's is later).
    """
    folder = ctx.run_path / REPORT_DIR
    final_step = ctx.tree.root.settings.rounds if step is None else step
    prox = proximity.analyse(ev)
    comm_rows, num_params = _communication(tracker, ctx)
    levels = comm.summarise(ctx.tree, comm_rows)
    totals = comm.totals(comm_rows)

    files = {
        "eval/matrix.csv": matrix_csv(ev.rows),
        "eval/distribution.csv": distribution_csv(ev.distribution_rows()),
        "eval/clients.csv": clients_csv(ev.client_rows()),
        "eval/proximity.csv": proximity.curve_csv(prox),
        "eval/proximity_clients.csv": proximity.clients_csv(prox),
        "eval/communication.csv": comm.rows_csv(comm_rows),
        "eval/communication_levels.csv": comm.summary_csv(levels),
    }
    for name, text in files.items():
        write_text_atomic(folder / name, text)
    save_figure(plots.heatmap(ev), folder / "eval" / "heatmap.png")
    save_figure(plots.proximity_plot(ev, prox), folder / "eval" / "proximity.png")
    curves = _time_curves(tracker, ev)
    if curves:
        write_text_atomic(folder / "eval" / "time_to_accuracy.csv", _curves_csv(curves))
        save_figure(plots.time_to_accuracy_plot(curves, ev.task.primary), folder / "eval" / "time_to_accuracy.png")
    dp_rows = privacy_rows(tracker, ctx.tree)
    dp_clients = client_epsilons(ctx.tree, ctx.store)
    privacy = {**epsilon_max(dp_rows), **({CLIENT_EPSILON_MAX: max(dp_clients.values())} if dp_clients else {})}
    headline = {
        **ev.headline(),
        **privacy,
        **{k: v for k, v in proximity.headline(prox).items() if "share_clients" in k},
        "comm/total_model_equivalents": totals["comm/total_model_equivalents"],
    }
    write_text_atomic(
        folder / "report.md", render_markdown(tracker, ctx, ev, prox, levels, totals, num_params, timings)
    )
    write_report_html(folder / "report.md", f"{ctx.config.name}: report")  # the same, figures inline (MLflow UI)

    tracker.log_artifacts(folder)
    faults.hit("report")
    # (the evaluation's headlines are at this step already: log_evaluation)
    tracker.log_metrics(tracker.parent_id, {**proximity.headline(prox), **totals, **privacy}, final_step)
    tracker.set_tags({"bhfl.task": ev.task.task, "bhfl.model_params": str(num_params), "bhfl.report": "report.html"})
    tracker.share_headline_view([*headline, "time/total_s"])
    _describe_runs(tracker, ctx, ev, prox, totals)
    return headline


def _describe_runs(
    tracker: Tracker, ctx: RunContext, ev: Evaluation, prox: proximity.Proximity, totals: Mapping[str, float]
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


def render_markdown(
    tracker: Tracker,
    ctx: RunContext,
    ev: Evaluation,
    prox: proximity.Proximity,
    levels: Sequence[comm.LevelSummary],
    totals: Mapping[str, float],
    num_params: int,
    timings: Mapping[str, float],
) -> str:
    cfg, tree, metric = ctx.config, ctx.tree, ev.task.primary
    better = "higher" if ev.task.better(metric) else "lower"
    h = ev.headline()
    out = [
        f"# {cfg.name}: evaluation report",
        "",
        f"MLflow run `{tracker.parent_id}` · seed {cfg.seed} · task {ev.task.task} · "
        f"{len(tree.clients())} clients, {len(tree.servers())} servers, {tree.root.settings.rounds} root rounds · "
        f"model {cfg.model.name} ({num_params:,} trainable parameters) · data `{ctx.manifest.fingerprint}`",
        "",
        f"## Each client's test split ({metric}, {better} is better)",
        "",
        "Every client's own test split, scored with each model that belongs to the client; "
        "mean / median / best and worst 10% over clients.",
        "",
    ]
    rows = []
    for relation, relation_name in _relation_names(ev).items():
        scored = [ev.value(m, c) for c in ev.clients for rel, m in ev.relatives(c) if rel == relation]
        values = [v for v in scored if v is not None]
        if values:
            d = distribution(values, ev.task.better(metric))
            g = h.get(f"gain_vs_local/{relation}/{metric}_mean", math.nan)
            share = h.get(f"gain_vs_local/{relation}/{metric}_share_better", math.nan)
            rows.append([relation_name, d.n, d.mean, d.median, d.best10, d.worst10, g, share])
    out += [
        markdown_table(
            [
                "model",
                "clients",
                "mean",
                "median",
                "best 10%",
                "worst 10%",
                "gain vs local-only",
                "share better than local-only",
            ],
            rows,
        ),
        "",
    ]
    out += [
        f"Root model: {h.get(f'root/union/{metric}', math.nan):.4f} on the union of all client tests, "
        f"{h.get(f'root/proxy/{metric}', math.nan):.4f} on the proxy test split.",
        "",
    ]

    out += [
        f"## Every server ({metric})",
        "",
        "Distribution over the clients of the server's subtree, and the server on the union and proxy tests.",
        "",
    ]
    rows = []
    for node in tree.servers():
        if node.id in ev.models:
            d = distribution(ev.per_client(node.id, ev.population(node.id)), ev.task.better(metric))
            sub = ev.value(node.id, UNION if node.parent is None else f"subtree:{node.id}")
            rows.append(
                [
                    node.id,
                    node.depth,
                    d.n,
                    d.mean,
                    d.median,
                    d.best10,
                    d.worst10,
                    d.variance,
                    sub,
                    ev.value(node.id, UNION),
                    ev.value(node.id, PROXY),
                ]
            )
    rows.sort(key=lambda r: (r[1], r[0]))
    out += [
        markdown_table(
            [
                "server",
                "level",
                "clients",
                "mean",
                "median",
                "best 10%",
                "worst 10%",
                "variance",
                "subtree union",
                "union",
                "proxy",
            ],
            rows,
        ),
        "",
    ]

    out += [
        "## Proximity: is a closer model better?",
        "",
        f"{metric} of every node model on every client's test split, against the tree distance between the "
        "model's node and the client (0 = the client's own model). 'path' keeps the client's own model and its "
        "ancestors.",
        "",
    ]
    dist_rows: dict[int, dict[str, proximity.CurvePoint]] = {}
    for c in prox.curve:
        dist_rows.setdefault(c.distance, {})[c.relation] = c
    table = []

    def cell(by: dict[str, proximity.CurvePoint], rel: str) -> tuple[float, int]:
        return (by[rel].mean, by[rel].n) if rel in by else (math.nan, 0)

    for distance, by in sorted(dist_rows.items()):
        (a, na), (p, np_), (o, no) = cell(by, "all"), cell(by, "path"), cell(by, "off_path")
        table.append([distance, a, na, p, np_, o, no])
    out += [
        markdown_table(["distance", "mean (all)", "pairs", "mean (path)", "pairs", "mean (off path)", "pairs"], table),
        "",
    ]
    out += [
        f"- Hypothesis on clients' data holds for **{prox.share_rank:.0%}** of clients by rank (Spearman "
        f"correlation of distance and quality < 0) and for **{prox.share_path:.0%}** along the path "
        "(own model ≥ parent ≥ … ≥ root). Step by step along the path: "
        + ", ".join(f"distance {d} ≥ {d + 1} for {share:.0%} of {n} clients" for d, n, share in prox.path_steps)
        + "."
    ]
    for test_set, by_test in prox.globals.items():
        out.append(
            f"- On `{test_set}`: rank correlation of depth and quality {by_test.rho_depth:+.2f} (negative = better "
            f"towards the root); quality never falls going up for {by_test.path_share:.0%} of client paths; "
            "mean by depth " + ", ".join(f"{d}: {v:.3f}" for d, _, v in by_test.by_depth) + "."
        )
    out += [
        "",
        "![proximity](eval/proximity.png)",
        "",
        "Vector copy for a paper: [eval/proximity.svg](eval/proximity.svg).",
        "",
        "## Heatmap",
        "",
        "Rows: node models in tree order; columns: client test splits (same order), subtree unions, "
        "the union of all clients, the proxy test.",
        "",
        "![heatmap](eval/heatmap.png)",
        "",
        "Vector copy: [eval/heatmap.svg](eval/heatmap.svg).",
        "",
    ]

    out += [
        "## Communication",
        "",
        f"One model = {num_params:,} float32 values = {comm.human_bytes(num_params * comm.BYTES_PER_VALUE)}. "
        "Level = depth of the server that sends to / receives from its children (residuals: sent by it); "
        "compressed updates (`aggregate.compress`) count their payloads' bytes.",
        "",
    ]
    out += [
        markdown_table(
            ["level", "servers", "direction", "kind", "server rounds", "models", "bytes", "models per round"],
            [
                [
                    s.level,
                    s.servers,
                    s.direction,
                    s.kind,
                    s.server_rounds,
                    f"{s.models:g}",
                    comm.human_bytes(s.bytes),
                    f"{s.models_per_round:.2f}",
                ]
                for s in levels
            ],
        ),
        "",
    ]
    out += [
        f"Total: **{totals['comm/total_model_equivalents']:g} model-equivalents, "
        f"{comm.human_bytes(totals['comm/total_bytes'])}** (down {comm.human_bytes(totals['comm/down_bytes'])}, "
        f"up {comm.human_bytes(totals['comm/up_bytes'])}, of which residuals "
        f"{comm.human_bytes(totals['comm/residual_bytes'])}).",
        "",
    ]

    curves = _time_curves(tracker, ev)
    if curves:
        populations = list(curves)
        evaluated = sorted({p.step for points in curves.values() for p in points})
        at = {label: {p.step: p for p in points} for label, points in curves.items()}
        time_rows = [
            [step, f"{next(at[lb][step].virtual_s for lb in populations if step in at[lb]):.1f}"]
            + [f"{at[lb][step].value:.3f}" if step in at[lb] else "" for lb in populations]
            for step in evaluated
        ]
        out += [
            f"## Quality against virtual time ({metric})",
            "",
            "At every evaluation (`eval.every`), against the root's virtual clock (client steps over their "
            "speed, `tree.clock`; a synchronous round waits for its slowest child). `eval/time_to_accuracy.csv`, "
            "`eval/time_to_accuracy.png`; `bhfl compare --target X` gives the time to reach X.",
            "",
            markdown_table(["root round", "virtual s", *populations], time_rows),
            "",
        ]
    dp_rows = privacy_rows(tracker, tree)
    dp_clients = client_epsilons(tree, ctx.store)
    if dp_rows or dp_clients:
        out += ["## Differential privacy", "", *client_lines(dp_clients, tree)]
    if dp_rows:
        out += [
            "Client-level DP-FedAvg at these servers (docs/privacy.md): epsilon spent by their clients at the "
            "end (replace-one neighbours, cohorts sampled without replacement), the last round's clip, the noise "
            "std on the mean update, and the share of updates clipped.",
            "",
            markdown_table(PRIVACY_HEADERS, [row.cells() for row in dp_rows]),
            "",
        ]
    out += [
        "## Cost",
        "",
        f"Training {timings.get('time/training_only_s', math.nan):.1f} s; evaluation of every node on every "
        f"test set {timings.get('time/eval_total_s', math.nan):.1f} s in all "
        f"({timings.get('time/eval_share', math.nan):.1%} of training)"
        + (
            f"; per-client baselines {timings['time/baselines_total_s']:.1f} s"
            if "time/baselines_total_s" in timings
            else ""
        )
        + f"; total run {timings.get('time/total_s', math.nan):.0f} s.",
        "",
    ]
    out += [
        "Files: `eval/matrix.csv`, `eval/distribution.csv`, `eval/clients.csv`, `eval/proximity.csv`, "
        "`eval/proximity_clients.csv`, `eval/communication.csv`, `eval/communication_levels.csv` "
        "(docs/evaluation.md explains each).",
        "",
    ]
    return "\n".join(out)
