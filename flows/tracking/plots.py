"""Report figures: the evaluation heatmap (models x test sets), the proximity plot, time to accuracy.

matplotlib's object-oriented API (``Figure`` objects, no pyplot state: safe in worker
threads, nothing to close); the functions return figures and the report writer saves
them. Jitter in scatter plots uses a fixed seed so the same evaluation gives the same
picture.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from bhfl_core.analysis.evaluation import Evaluation
from bhfl_core.analysis.matrix_axes import all_test_sets, client_order, dfs_order
from bhfl_core.analysis.proximity import Proximity
from bhfl_core.analysis.time_to_accuracy import CurvePoint
from bhfl_core.learning.metrics import metric_bounds
from data_prep.figures import MIN_FONT_PT

MAX_LABELS = 150  # beyond this many clients or model rows, the heatmap summarises by edge server
MAX_POINTS = 4000  # a scatter shows at most this many points (a seeded sample)
ROLE_COLOURS = {"client": "#9e9e9e", "edge": "#1f77b4", "server": "#2ca02c", "root": "#d62728"}


def _legend_below(ax: Axes) -> None:
    """The legend under the axes, never over the data (the saved figure is cropped to include it)."""
    ax.legend(fontsize=MIN_FONT_PT, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, frameon=False)


def heatmap(ev: Evaluation) -> Figure:
    """Node models (rows, tree order) x test sets (clients in tree order, subtrees, union, proxy).

    Beyond ``MAX_LABELS`` clients or rows a cell per client would be thousands of pixels
    wide (and unreadable): the figure summarises by edge server instead (``summary_heatmap``).
    """
    rows = ev.node_models()
    if len(ev.clients) > MAX_LABELS or len(rows) > MAX_LABELS:
        return summary_heatmap(ev)
    metric = ev.task.primary
    cols = all_test_sets(ev.tree)
    grid = np.array([[np.nan if (v := ev.value(m, t)) is None else v for t in cols] for m in rows], dtype=float)
    width = min(4 + 0.16 * len(cols) * MIN_FONT_PT / 6, 40)  # room for one tick label per column and row
    height = min(2.5 + 0.15 * len(rows) * MIN_FONT_PT / 6, 40)
    fig = Figure(figsize=(width, height))
    ax = fig.subplots()
    cmap = "viridis" if ev.task.better(metric) else "viridis_r"
    image = ax.imshow(grid, aspect="auto", cmap=cmap, interpolation="nearest")
    clients = client_order(ev.tree)
    ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=MIN_FONT_PT)
    ax.set_yticks(range(len(rows)), rows, fontsize=MIN_FONT_PT)
    for label, m in zip(ax.get_yticklabels(), rows):
        if not ev.tree[m].is_leaf:
            label.set_fontweight("bold")
    ax.axvline(len(clients) - 0.5, color="white", linewidth=1.5)
    # thin lines between the clients of different parents (columns), above each server (rows)
    for i in range(1, len(clients)):
        if ev.tree[clients[i]].parent != ev.tree[clients[i - 1]].parent:
            ax.axvline(i - 0.5, color="white", linewidth=0.5)
    for i, m in enumerate(rows):
        if not ev.tree[m].is_leaf:
            ax.axhline(i - 0.5, color="white", linewidth=0.5)
    return _labelled(
        fig,
        ax,
        image,
        ev,
        "",
        "test set: client test splits | subtree unions, union of all clients, proxy",
        "model (tree order: servers in bold, each followed by its subtree)",
        f"{metric.capitalize()} of each model on each test set",
    )


def _labelled(fig: Figure, ax: Axes, image: Any, ev: Evaluation, unit: str, x: str, y: str, title: str) -> Figure:
    """A heatmap's colour bar (the primary metric, which way is better, ``unit``), axis labels and title."""
    metric = ev.task.primary
    direction = "higher is better" if ev.task.better(metric) else "lower is better"
    fig.colorbar(image, ax=ax, fraction=0.03, pad=0.01).set_label(f"{metric} ({direction}){unit}")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title)
    return fig


def summary_heatmap(ev: Evaluation) -> Figure:
    """The heatmap of a large population, by edge server: a row per server and one for each edge server's client
    models together; a column per edge server's clients, then the subtree unions, union and proxy. A cell is the
    mean of the metric over the (model, client test split) pairs it covers. Its size depends on the tree's
    servers, not on the clients."""
    tree, metric = ev.tree, ev.task.primary
    edges = [n for n in dfs_order(tree) if not tree[n].is_leaf and any(tree[c].is_leaf for c in tree[n].children)]
    edge_of = {c: tree[c].parent or "" for c in ev.clients}
    models = ev.node_models()
    groups: list[tuple[str, list[str]]] = []  # row label, its models (servers alone; client models by edge)
    clients_by_edge: dict[str, list[str]] = {}
    for m in models:
        if tree[m].is_leaf:
            clients_by_edge.setdefault(tree[m].parent or "", []).append(m)
        else:
            groups.append((m, [m]))
    for edge in edges:
        if edge in clients_by_edge:
            groups.append((f"client models under {edge} ({len(clients_by_edge[edge])})", clients_by_edge[edge]))
    sets = [t for t in all_test_sets(tree) if not tree.nodes.get(t, None) or not tree[t].is_leaf]
    sets = [t for t in sets if t not in edge_of]
    cols = [f"clients of {e}" for e in edges] + sets
    grid = np.full((len(groups), len(cols)), np.nan)
    for r, (_, members) in enumerate(groups):
        sums, counts = np.zeros(len(edges)), np.zeros(len(edges))
        edge_index = {e: i for i, e in enumerate(edges)}
        for m in members:
            scored, values = ev.scored(m, metric)
            for c, v in zip(scored, values):
                e = edge_index.get(edge_of.get(c, ""))
                if e is not None and not np.isnan(v):
                    sums[e] += v
                    counts[e] += 1
        with np.errstate(invalid="ignore", divide="ignore"):
            grid[r, : len(edges)] = sums / counts
        for j, t in enumerate(sets):
            found = [ev.value(m, t) for m in members]
            vals = [v for v in found if v is not None]
            grid[r, len(edges) + j] = float(np.mean(vals)) if vals else np.nan
    fig = Figure(
        figsize=(min(4 + 0.16 * len(cols) * MIN_FONT_PT / 6, 40), min(2.5 + 0.15 * len(groups) * MIN_FONT_PT / 6, 40))
    )
    ax = fig.subplots()
    image = ax.imshow(
        grid, aspect="auto", cmap="viridis" if ev.task.better(metric) else "viridis_r", interpolation="nearest"
    )
    ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=MIN_FONT_PT)
    ax.set_yticks(range(len(groups)), [label for label, _ in groups], fontsize=MIN_FONT_PT)
    ax.axvline(len(edges) - 0.5, color="white", linewidth=1.5)
    return _labelled(
        fig,
        ax,
        image,
        ev,
        ", mean per cell",
        "test set: each edge server's clients (mean over their splits) | subtree unions, union, proxy",
        "model: servers, then each edge server's client models (mean)",
        f"{metric.capitalize()} by edge server ({len(ev.clients):,} clients: a cell per edge server)",
    )


def _sample(n: int, limit: int, rng: np.random.Generator) -> np.ndarray:
    """All of ``range(n)``, or a sorted sample of ``limit`` of them: a scatter of at most ``limit`` points."""
    return np.arange(n) if n <= limit else np.sort(rng.choice(n, limit, replace=False))


def proximity_plot(ev: Evaluation, prox: Proximity) -> Figure:
    """Left: metric vs tree distance on clients' tests. Right: union/proxy metric vs model depth.

    The scatters show at most ``MAX_POINTS`` points each (a seeded sample, said in the
    title); the mean lines are over every pair and model.
    """
    rng = np.random.default_rng(0)
    fig = Figure(figsize=(13, 4.8))
    left, right = fig.subplots(1, 2)
    pairs = prox.pairs
    shown = _sample(len(pairs), MAX_POINTS, rng)
    role = np.array([ev.tree[m].role.value for m in pairs.models])[pairs.model[shown]] if len(pairs) else np.array([])
    for name, colour in ROLE_COLOURS.items():
        pick = shown[role == name]
        if len(pick):
            x = pairs.distance[pick].astype(float) + rng.uniform(-0.18, 0.18, len(pick))
            left.scatter(x, pairs.value[pick], s=7, alpha=0.35, color=colour, label=f"{name} model")
    for relation, style in (("all", "-k"), ("path", "--m")):
        curve = [c for c in prox.curve if c.relation == relation]
        label = "mean, all pairs" if relation == "all" else "mean, own model and ancestors"
        left.plot([c.distance for c in curve], [c.mean for c in curve], style, marker="o", linewidth=2, label=label)
    left.set_xlabel("tree distance between the model's node and the client (edges)")
    left.set_ylabel(f"{prox.metric} on the client's test split")
    sampled = f" ({len(shown):,} of {len(pairs):,} pairs shown)" if len(shown) < len(pairs) else ""
    left.set_title(f"On each client's test split: closer models score better?{sampled}", fontsize=10)
    _legend_below(left)
    max_d = int(pairs.distance.max()) if len(pairs) else 0
    left.set_xticks(range(max_d + 1))

    for (test_set, g), colour in zip(prox.globals.items(), ("#ff7f0e", "#17becf")):
        models = [m for m in ev.node_models() if ev.value(m, test_set) is not None]
        models = [models[i] for i in _sample(len(models), MAX_POINTS, rng)]
        x = np.array([ev.tree[m].depth for m in models], dtype=float) + rng.uniform(-0.12, 0.12, len(models))
        right.scatter(x, [ev.value(m, test_set) for m in models], s=9, alpha=0.4, color=colour)
        right.plot(
            [d for d, _, _ in g.by_depth],
            [v for _, _, v in g.by_depth],
            "-o",
            color=colour,
            linewidth=2,
            label=f"{test_set}: rank corr(depth, quality) {g.rho_depth:+.2f}, paths {g.path_share:.0%}",
        )
    right.set_xlabel("depth of the model's node (root = 0)")
    right.set_ylabel(prox.metric)
    right.set_title("On the global test sets: better towards the root?", fontsize=10)
    right.set_xticks(range(max((d for g in prox.globals.values() for d, _, _ in g.by_depth), default=0) + 1))
    _legend_below(right)
    return fig


def clients_histogram(ev: Evaluation) -> Figure:
    """How the clients fare: the distribution over clients of the primary metric on each client's own test split,
    under its own model, its edge server's and the root's. Bounded whatever the number of clients."""
    metric = ev.task.primary
    fig = Figure(figsize=(6.5, 4.2))
    ax = fig.subplots()
    relations = {"client": "own model", "personal": "personal model", "edge": "edge server", "root": "root"}
    by_relation: dict[str, list[float]] = {}
    for client in ev.clients:
        for relation, model in ev.relatives(client):
            if relation in relations and (v := ev.value(model, client)) is not None and not np.isnan(v):
                by_relation.setdefault(relation, []).append(v)
    bounds = metric_bounds(metric)
    every = [v for values in by_relation.values() for v in values]
    low, high = bounds if bounds is not None else ((min(every), max(every)) if every else (0.0, 1.0))
    bins = np.linspace(low, high if high > low else low + 1, 31).tolist()
    for relation, values in by_relation.items():
        ax.hist(values, bins=bins, histtype="step", linewidth=1.5, label=f"{relations[relation]} (n={len(values):,})")
    if not by_relation:  # e.g. prepared data without client test splits
        ax.text(0.5, 0.5, "no client test split was scored", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(f"{metric} on the client's own test split")
    ax.set_ylabel("clients")
    sample = f" (a sample of {len(ev.clients):,} of {len(ev.all_clients):,})" if ev.sampled else ""
    ax.set_title(f"Clients by {metric} of the models that serve them{sample}", fontsize=10)
    if by_relation:
        _legend_below(ax)
    return fig


def time_to_accuracy_plot(curves: Mapping[str, Sequence[CurvePoint]], metric: str) -> Figure:
    """Quality at each evaluation against the root's virtual time, one line per population."""
    fig = Figure(figsize=(6.5, 4.2))
    ax = fig.subplots()
    for label, points in curves.items():
        ax.plot([p.virtual_s for p in points], [p.value for p in points], "-o", markersize=3, label=label)
    ax.set_xlabel("virtual time (s): client steps / speed, rounds wait for their slowest child")
    ax.set_ylabel(metric)
    _legend_below(ax)
    return fig


def epsilon_plot(curves: Mapping[str, Sequence[tuple[int, float]]], budgets: Mapping[str, float]) -> Figure:
    """Each DP server's epsilon after each of its rounds, with its budget (a dashed line) where it has one."""
    fig = Figure(figsize=(6.5, 4.2))
    ax = fig.subplots()
    for label, points in curves.items():
        (line,) = ax.plot(range(1, len(points) + 1), [v for _, v in points], "-o", markersize=3, label=label)
        if label in budgets:
            ax.axhline(budgets[label], color=line.get_color(), linestyle="--", linewidth=0.8)
    ax.set_xlabel("rounds (flushes) of the server")
    ax.set_ylabel("epsilon spent")
    _legend_below(ax)
    return fig
