"""Report figures: the evaluation heatmap (models x test sets), the proximity plot, time to accuracy.

matplotlib's object-oriented API (``Figure`` objects, no pyplot state: safe in worker
threads, nothing to close); the functions return figures and the report writer saves
them. Jitter in scatter plots uses a fixed seed so the same evaluation gives the same
picture.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from bhfl_core.analysis.evaluation import Evaluation, all_test_sets, client_order
from bhfl_core.analysis.proximity import Proximity
from bhfl_core.analysis.time_to_accuracy import CurvePoint
from data_prep.figures import MIN_FONT_PT

MAX_LABELS = 150  # beyond this many rows / columns, client tick labels are left out
ROLE_COLOURS = {"client": "#9e9e9e", "edge": "#1f77b4", "server": "#2ca02c", "root": "#d62728"}


def _legend_below(ax: Axes) -> None:
    """The legend under the axes, never over the data (the saved figure is cropped to include it)."""
    ax.legend(fontsize=MIN_FONT_PT, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, frameon=False)


def heatmap(ev: Evaluation) -> Figure:
    """Node models (rows, tree order) x test sets (clients in tree order, subtrees, union, proxy)."""
    metric = ev.task.primary
    rows = ev.node_models()
    cols = all_test_sets(ev.tree)
    grid = np.array([[np.nan if (v := ev.value(m, t)) is None else v for t in cols] for m in rows], dtype=float)
    width = min(4 + 0.16 * len(cols) * MIN_FONT_PT / 6, 40)  # room for one tick label per column and row
    height = min(2.5 + 0.15 * len(rows) * MIN_FONT_PT / 6, 40)
    fig = Figure(figsize=(width, height))
    ax = fig.subplots()
    cmap = "viridis" if ev.task.better(metric) else "viridis_r"
    image = ax.imshow(grid, aspect="auto", cmap=cmap, interpolation="nearest")
    # large trees: label only servers and the union columns (client names would overprint)
    clients = client_order(ev.tree)
    client_set = set(clients)
    xs = [i for i, c in enumerate(cols) if len(cols) <= MAX_LABELS or c not in client_set]
    ys = [i for i, m in enumerate(rows) if len(rows) <= MAX_LABELS or not ev.tree[m].is_leaf]
    ax.set_xticks(xs, [cols[i] for i in xs], rotation=90, fontsize=MIN_FONT_PT)
    ax.set_yticks(ys, [rows[i] for i in ys], fontsize=MIN_FONT_PT)
    for label, i in zip(ax.get_yticklabels(), ys):
        if not ev.tree[rows[i]].is_leaf:
            label.set_fontweight("bold")
    ax.axvline(len(clients) - 0.5, color="white", linewidth=1.5)
    # thin lines between the clients of different parents (columns), above each server (rows)
    for i in range(1, len(clients)):
        if ev.tree[clients[i]].parent != ev.tree[clients[i - 1]].parent:
            ax.axvline(i - 0.5, color="white", linewidth=0.5)
    for i, m in enumerate(rows):
        if not ev.tree[m].is_leaf:
            ax.axhline(i - 0.5, color="white", linewidth=0.5)
    direction = "higher is better" if ev.task.better(metric) else "lower is better"
    fig.colorbar(image, ax=ax, fraction=0.03, pad=0.01).set_label(f"{metric} ({direction})")
    ax.set_xlabel("test set: client test splits | subtree unions, union of all clients, proxy")
    ax.set_ylabel("model (tree order: servers in bold, each followed by its subtree)")
    ax.set_title(f"{metric.capitalize()} of each model on each test set")
    return fig


def proximity_plot(ev: Evaluation, prox: Proximity) -> Figure:
    """Left: metric vs tree distance on clients' tests. Right: union/proxy metric vs model depth."""
    rng = np.random.default_rng(0)
    fig = Figure(figsize=(13, 4.8))
    left, right = fig.subplots(1, 2)
    for role, colour in ROLE_COLOURS.items():
        pts = [p for p in prox.pairs if ev.tree[p.model].role.value == role]
        if pts:
            x = np.array([p.distance for p in pts], dtype=float) + rng.uniform(-0.18, 0.18, len(pts))
            left.scatter(x, [p.value for p in pts], s=7, alpha=0.35, color=colour, label=f"{role} model")
    for relation, style in (("all", "-k"), ("path", "--m")):
        curve = [c for c in prox.curve if c.relation == relation]
        label = "mean, all pairs" if relation == "all" else "mean, own model and ancestors"
        left.plot([c.distance for c in curve], [c.mean for c in curve], style, marker="o", linewidth=2, label=label)
    left.set_xlabel("tree distance between the model's node and the client (edges)")
    left.set_ylabel(f"{prox.metric} on the client's test split")
    left.set_title("On each client's test split: closer models score better?", fontsize=10)
    _legend_below(left)
    max_d = max((p.distance for p in prox.pairs), default=0)
    left.set_xticks(range(max_d + 1))

    for (test_set, g), colour in zip(prox.globals.items(), ("#ff7f0e", "#17becf")):
        models = [m for m in ev.node_models() if ev.value(m, test_set) is not None]
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
