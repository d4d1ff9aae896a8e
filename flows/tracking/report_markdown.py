"""``report.md``: the key numbers of a run together, one function per section.

``write_report`` (flows/tracking/report.py) gathers what the report shows, MLflow reads
included, into one ``ReportInputs``; the sections here only format it, so each can be
read (and changed) alone, and every table goes through the one markdown writer
(``bhfl_core.store.tables.table_markdown``) with the report's number format.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bhfl_core.analysis import communication as comm
from bhfl_core.analysis import proximity
from bhfl_core.analysis import time_to_accuracy as tta
from bhfl_core.analysis.distribution import distribution
from bhfl_core.analysis.evaluation import Evaluation
from bhfl_core.analysis.matrix_axes import PROXY, UNION
from bhfl_core.analysis.trivial_baselines import TrivialBaseline
from bhfl_core.store.tables import table_markdown
from flows.tracking.plots import MAX_LABELS
from flows.tracking.privacy_report import HEADERS as PRIVACY_HEADERS
from flows.tracking.privacy_report import PrivacyRow, client_lines
from tasks.context import RunContext

RELATION_NAMES = {
    "client": "client's own model",
    "personal": "client's personal model (Ditto)",
    "edge": "its parent server",
    "server": "its intermediate server",
    "root": "root",
    "adapted": "locally adapted model",
    "local_only": "local-only model",
}


@dataclass(frozen=True)
class ReportInputs:
    """Everything ``report.md`` shows, gathered once by ``write_report``."""

    run_id: str  # the MLflow parent run
    ctx: RunContext
    ev: Evaluation
    prox: proximity.Proximity
    levels: Sequence[comm.LevelSummary]
    totals: Mapping[str, float]
    num_params: int
    timings: Mapping[str, float]
    curves: Mapping[str, Sequence[tta.CurvePoint]]  # quality against virtual time (empty: none evaluated)
    dp_rows: Sequence[PrivacyRow]  # the DP servers
    dp_clients: Mapping[str, float]  # DP-SGD clients' epsilons
    baseline: TrivialBaseline | None  # None: the task has no trivial baseline

    @property
    def metric(self) -> str:
        return self.ev.task.primary


def _fmt(value: object) -> object:
    """The report's number format: 4 significant digits, a dash where there is no number."""
    if isinstance(value, float):
        return "–" if math.isnan(value) else f"{value:.4g}"
    return "–" if value is None else value


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    return table_markdown(header, ([_fmt(v) for v in row] for row in rows))


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


def _title(r: ReportInputs) -> list[str]:
    cfg, tree = r.ctx.config, r.ctx.tree
    return [
        f"# {cfg.name}: evaluation report",
        "",
        f"MLflow run `{r.run_id}` · seed {cfg.seed} · task {r.ev.task.task} · "
        f"{len(tree.clients())} clients, {len(tree.servers())} servers, {tree.root.settings.rounds} root rounds · "
        f"model {cfg.model.name} ({r.num_params:,} trainable parameters) · data `{r.ctx.manifest.fingerprint}`",
        "",
        *([] if cfg.eval.figures else ["No figures (`eval.figures: false`): their numbers are in `eval/*.csv`.", ""]),
    ]


def _clients(r: ReportInputs) -> list[str]:
    """Each relation's model on its clients' tests (the headlines), the trivial baseline's row, the root line."""
    ev, metric = r.ev, r.metric
    better, h = ev.task.better(metric), ev.headline()
    rows: list[list[object]] = []
    for relation, relation_name in _relation_names(ev).items():
        scored = [ev.value(m, c) for c in ev.clients for rel, m in ev.relatives(c) if rel == relation]
        values = [v for v in scored if v is not None]
        if values:
            of = round(len(values) * len(ev.all_clients) / len(ev.clients))
            d = distribution(values, better, of, ev.task.bounds.get(metric))
            g = h.get(f"gain_vs_local/{relation}/{metric}_mean", math.nan)
            share = h.get(f"gain_vs_local/{relation}/{metric}_share_better", math.nan)
            mean: object = f"{d.mean:.4f} [{d.mean_low:.4f}, {d.mean_high:.4f}]" if ev.sampled else d.mean
            rows.append([relation_name, d.n, mean, d.median, d.best10, d.worst10, g, share])
    if r.baseline is not None:
        d = distribution(r.baseline.per_client(ev.clients, metric), better)
        rows.append(
            [f"trivial baseline: {r.baseline.kind.own}", d.n, d.mean, d.median, d.best10, d.worst10, math.nan, math.nan]
        )
    header = ["model", "clients", "mean", "median", "best 10%", "worst 10%", "gain vs local-only"]
    return [
        f"## Each client's test split ({metric}, {'higher' if better else 'lower'} is better)",
        "",
        "Every client's own test split, scored with each model that belongs to the client; "
        "mean / median / best and worst 10% over clients."
        + (
            f" Over a seeded sample of {len(ev.clients):,} of the {len(ev.all_clients):,} clients (`eval.clients`): "
            "the mean's 95% interval over all clients in brackets."
            if ev.sampled
            else ""
        ),
        "",
        _table([*header, "share better than local-only"], rows),
        "",
        f"Root model: {h.get(f'root/union/{metric}', math.nan):.4f} on the union of all client tests, "
        f"{h.get(f'root/proxy/{metric}', math.nan):.4f} on the proxy test split.",
        "",
        *_baseline_line(r),
    ]


def _baseline_line(r: ReportInputs) -> list[str]:
    """What the trivial baseline is, and its value on the union and the proxy test (none without one)."""
    if r.baseline is None:
        return []
    kind, scores, metric = r.baseline.kind, r.baseline.scores, r.metric
    return [
        f"Trivial baseline, no training (docs/evaluation.md): {kind.own} on its test split (the table's last row); "
        f"{kind.union}: {scores[UNION][metric]:.4f} on the union; "
        f"{kind.proxy}: {scores[PROXY][metric]:.4f} on the proxy test split.",
        "",
    ]


def _servers(r: ReportInputs) -> list[str]:
    ev, metric = r.ev, r.metric
    rows: list[list[object]] = []
    for node in sorted(r.ctx.tree.servers(), key=lambda n: (n.depth, n.id)):
        if node.id in ev.models:
            d = distribution(ev.per_client(node.id, ev.population(node.id)), ev.task.better(metric))
            sub = ev.value(node.id, UNION if node.parent is None else f"subtree:{node.id}")
            spread = [d.n, d.mean, d.median, d.best10, d.worst10, d.variance]
            rows.append([node.id, node.depth, *spread, sub, ev.value(node.id, UNION), ev.value(node.id, PROXY)])
    header = ["server", "level", "clients", "mean", "median", "best 10%", "worst 10%", "variance"]
    return [
        f"## Every server ({metric})",
        "",
        "Distribution over the clients of the server's subtree, and the server on the union and proxy tests.",
        "",
        _table([*header, "subtree union", "union", "proxy"], rows),
        "",
    ]


def _proximity(r: ReportInputs) -> list[str]:
    prox = r.prox
    by_distance: dict[int, dict[str, proximity.CurvePoint]] = {}
    for c in prox.curve:
        by_distance.setdefault(c.distance, {})[c.relation] = c
    rows: list[list[object]] = []
    for distance, by in sorted(by_distance.items()):
        rows.append([distance])
        for relation in ("all", "path", "off_path"):
            rows[-1] += [by[relation].mean, by[relation].n] if relation in by else [math.nan, 0]
    steps = ", ".join(f"distance {d} ≥ {d + 1} for {share:.0%} of {n} clients" for d, n, share in prox.path_steps)
    lines = [
        "## Proximity: is a closer model better?",
        "",
        f"{r.metric} of every node model on every client's test split, against the tree distance between the "
        "model's node and the client (0 = the client's own model). 'path' keeps the client's own model and its "
        "ancestors.",
        "",
        _table(["distance", "mean (all)", "pairs", "mean (path)", "pairs", "mean (off path)", "pairs"], rows),
        "",
        f"- Hypothesis on clients' data holds for **{prox.share_rank:.0%}** of clients by rank (Spearman "
        f"correlation of distance and quality < 0) and for **{prox.share_path:.0%}** along the path "
        f"(own model ≥ parent ≥ … ≥ root). Step by step along the path: {steps}.",
    ]
    for test_set, by_test in prox.globals.items():
        lines.append(
            f"- On `{test_set}`: rank correlation of depth and quality {by_test.rho_depth:+.2f} (negative = better "
            f"towards the root); quality never falls going up for {by_test.path_share:.0%} of client paths; "
            "mean by depth " + ", ".join(f"{d}: {v:.3f}" for d, _, v in by_test.by_depth) + "."
        )
    figure = [
        "![proximity](eval/proximity.png)",
        "",
        "Vector copy for a paper: [eval/proximity.svg](eval/proximity.svg).",
        "",
    ]
    return [*lines, "", *_drawn(r, figure)]


def _drawn(r: ReportInputs, lines: list[str]) -> list[str]:
    """``lines`` (a figure and what links it) if the run draws its figures (``eval.figures``), else none."""
    return lines if r.ctx.config.eval.figures else []


def _heatmap(r: ReportInputs) -> list[str]:
    ev = r.ev
    if len(ev.clients) > MAX_LABELS or len(ev.node_models()) > MAX_LABELS:
        what = (
            f"{len(ev.clients):,} clients are too many for a cell each: rows are the servers, then each edge "
            "server's client models together; columns each edge server's clients, then the subtree unions, the "
            "union of all clients, the proxy test; a cell is the mean over the (model, client) pairs it covers."
        )
    else:
        what = (
            "Rows: node models in tree order; columns: client test splits (same order), subtree unions, "
            "the union of all clients, the proxy test."
        )
    figure = [
        "![heatmap](eval/heatmap.png)",
        "",
        "Vector copy: [eval/heatmap.svg](eval/heatmap.svg). How the clients fare under their own model, edge server "
        "and root: [eval/clients_histogram.png](eval/clients_histogram.png).",
        "",
    ]
    return ["## Heatmap", "", what, "", *_drawn(r, figure)]


def _communication(r: ReportInputs) -> list[str]:
    totals, size = r.totals, comm.human_bytes
    rows = [
        [
            s.level,
            s.servers,
            s.direction,
            s.kind,
            s.server_rounds,
            f"{s.models:g}",
            size(s.bytes),
            f"{s.models_per_round:.2f}",
        ]
        for s in r.levels
    ]
    header = ["level", "servers", "direction", "kind", "server rounds", "models", "bytes", "models per round"]
    return [
        "## Communication",
        "",
        f"One model = {r.num_params:,} float32 values = {size(r.num_params * comm.BYTES_PER_VALUE)}. "
        "Level = depth of the server that sends to / receives from its children (residuals: sent by it); "
        "compressed updates (`aggregate.compress`) and broadcasts (`compress_down`) count their payloads' bytes.",
        "",
        _table(header, rows),
        "",
        f"Total: **{totals['comm/total_model_equivalents']:g} model-equivalents, "
        f"{size(totals['comm/total_bytes'])}** (down {size(totals['comm/down_bytes'])}, "
        f"up {size(totals['comm/up_bytes'])}, of which residuals {size(totals['comm/residual_bytes'])}).",
        "",
    ]


def _time_to_accuracy(r: ReportInputs) -> list[str]:
    """Each population's value at every evaluation against the root's virtual clock (none without curves)."""
    if not r.curves:
        return []
    populations = list(r.curves)
    evaluated = sorted({p.step for points in r.curves.values() for p in points})
    at = {label: {p.step: p for p in points} for label, points in r.curves.items()}
    rounds = r.ctx.tree.root.settings.rounds  # a step past it: a forced re-evaluation, not a round
    rows = [
        [tta.round_label(step, rounds), f"{next(at[lb][step].virtual_s for lb in populations if step in at[lb]):.1f}"]
        + [f"{at[lb][step].value:.3f}" if step in at[lb] else "" for lb in populations]
        for step in evaluated
    ]
    return [
        f"## Quality against virtual time ({r.metric})",
        "",
        "At every evaluation (`eval.every`), against the root's virtual clock (client steps over their "
        "speed, `tree.clock`; a synchronous round waits for its slowest child). `eval/time_to_accuracy.csv`"
        + (", `eval/time_to_accuracy.png`" if r.ctx.config.eval.figures else "")
        + "; `bhfl compare --target X` gives the time to reach X.",
        "",
        _table(["root round", "virtual s", *populations], rows),
        "",
    ]


def _privacy(r: ReportInputs) -> list[str]:
    """The DP-SGD clients' paragraph and the DP servers' table (none without DP)."""
    lines = ["## Differential privacy", "", *client_lines(dict(r.dp_clients), r.ctx.tree)]
    if r.dp_rows:
        lines += [
            "Client-level DP-FedAvg at these servers (docs/privacy.md): epsilon spent by their clients at the "
            "end (fixed cohorts: replace-one neighbours; Poisson cohorts: add/remove-one), the last round's clip, "
            "the noise std on the mean update, the share of updates clipped, and the plan: the most rounds the "
            "server could run in this run, their epsilon, and the budget (`max_epsilon`, else `target_epsilon`); "
            "with `eval.privacy_audit`, the epsilon the canary clients' traces imply (an estimate, docs/privacy.md "
            '"Empirical audit").',
            "",
            _table(PRIVACY_HEADERS, [row.cells() for row in r.dp_rows]),
            "",
            *_drawn(r, ["![epsilon per round](eval/privacy.png)", ""]),
            "Epsilon after each round, per server: `eval/privacy_epsilon.csv` (and `privacy/epsilon` in each "
            "server's MLflow run).",
            "",
        ]
    return lines if r.dp_rows or r.dp_clients else []


def _cost(r: ReportInputs) -> list[str]:
    t = r.timings
    baselines = f"; per-client baselines {t['time/baselines_total_s']:.1f} s" if "time/baselines_total_s" in t else ""
    return [
        "## Cost",
        "",
        f"Training {t.get('time/training_only_s', math.nan):.1f} s; evaluation of every node on every "
        f"test set {t.get('time/eval_total_s', math.nan):.1f} s in all "
        f"({t.get('time/eval_share', math.nan):.1%} of training){baselines}; "
        f"total run {t.get('time/total_s', math.nan):.0f} s.",
        "",
        "Files: `eval/matrix.csv`, `eval/distribution.csv`, `eval/clients.csv`, `eval/proximity.csv`, "
        "`eval/proximity_clients.csv`, `eval/communication.csv`, `eval/communication_levels.csv` "
        "(docs/evaluation.md explains each).",
        "",
    ]


def render_markdown(r: ReportInputs) -> str:
    """The whole ``report.md``: its sections in reading order."""
    sections = [
        _title(r),
        _clients(r),
        _servers(r),
        _proximity(r),
        _heatmap(r),
        _communication(r),
        _time_to_accuracy(r),
        _privacy(r),
        _cost(r),
    ]
    return "\n".join(line for section in sections for line in section)
