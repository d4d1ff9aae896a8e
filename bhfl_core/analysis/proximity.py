"""Proximity analysis: does a model's quality follow its closeness in the tree?

The hypothesis of the seeds (ALGORITHMS.md, "Evaluation at every level"): on a
client's own test data, a model is better the closer its node is to the client in
the tree; on the proxy test split and the union of all client tests it is better the
closer its node is to the root. Definitions (docs/evaluation.md):

- *quality* is the task's primary metric with its sign set so that higher is better
  (accuracy as is; perplexity negated).
- A *pair* is a node model ``m`` (a server's model or a persistent client's model)
  and a client ``c`` whose test split it was scored on; its distance is the number
  of tree edges between ``m``'s node and ``c`` (0 for the client's own model).
- Per client, the hypothesis **holds by rank** when the Spearman rank correlation
  between distance and quality over that client's pairs is negative, and **holds on
  the path** when quality never improves along the client's path to the root
  (its own model, its parent, ..., the root: ``q_0 >= q_1 >= ... >= q_root``).
- On ``union`` and ``proxy`` it holds by rank when the Spearman correlation between a
  model's depth and its quality over all node models is negative, and on a client's
  path when quality never falls going up (``q_0 <= q_1 <= ... <= q_root``).

Shares count clients where the statistic is defined (two or more distinct distances
for the rank test, two or more models on the path).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from bhfl_core.analysis.evaluation import Evaluation
from bhfl_core.analysis.matrix_axes import PROXY, UNION
from bhfl_core.store.tables import table_csv


@dataclass(frozen=True)
class Pairs:
    """Every (node model, client) pair scored, as columns: ``models[model[i]]`` scored on ``clients[client[i]]``.

    Linear in what was scored (servers x clients plus each client model's plan), never
    models x clients: a persistent population of 10,000 is ~10^6 pairs, ~20 MB here.
    """

    models: list[str]
    clients: list[str]
    model: np.ndarray  # int32 index into models
    client: np.ndarray  # int32 index into clients
    distance: np.ndarray  # int32 tree edges between the model's node and the client
    on_path: np.ndarray  # bool: the model is the client's own or one of its ancestors'
    value: np.ndarray  # float64 metric (as is, not signed)

    def __len__(self) -> int:
        return len(self.value)


@dataclass(frozen=True)
class CurvePoint:
    relation: str  # 'all' pairs, 'path' (ancestors and own model) or 'off_path'
    distance: int
    n: int
    mean: float
    median: float


@dataclass(frozen=True)
class ClientProximity:
    client: str
    models: int
    rho: float  # Spearman(distance, quality); NaN when undefined
    path_holds: bool | None  # None when the path has fewer than two models


@dataclass(frozen=True)
class GlobalProximity:
    test_set: str
    rho_depth: float  # Spearman(depth, quality) over node models
    path_share: float  # share of clients whose path improves (never worsens) towards the root
    by_depth: list[tuple[int, int, float]]  # (depth, models, mean metric)


@dataclass(frozen=True)
class Proximity:
    metric: str
    higher_is_better: bool
    pairs: Pairs
    curve: list[CurvePoint]
    clients: list[ClientProximity]
    share_rank: float
    share_path: float
    path_steps: list[tuple[int, int, float]]  # (distance d, clients, share with quality(d) >= quality(d + 1))
    globals: dict[str, GlobalProximity]


def average_ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank (as scipy.stats.rankdata)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson correlation of average ranks); NaN if either side is constant."""
    if len(x) != len(y):
        raise ValueError("x and y differ in length")
    if len(x) < 2:
        return float("nan")
    rx = torch.tensor(average_ranks(x), dtype=torch.float64)
    ry = torch.tensor(average_ranks(y), dtype=torch.float64)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = float(rx.norm() * ry.norm())
    return float((rx * ry).sum()) / denom if denom > 0 else float("nan")


def _share(flags: Sequence[bool | None]) -> float:
    defined = [f for f in flags if f is not None]
    return sum(defined) / len(defined) if defined else float("nan")


def _pairs(ev: Evaluation, metric: str) -> Pairs:
    """The pairs of the node models, model by model over the clients each was scored on."""
    tree = ev.tree
    models = ev.node_models()
    clients = ev.clients
    index = {c: i for i, c in enumerate(clients)}
    depth = {c: tree[c].depth for c in clients}
    columns: dict[str, list[float]] = {"distance": [], "on_path": [], "value": []}
    model_column: list[int] = []
    client_column: list[int] = []
    for m, model in enumerate(models):
        node = tree[model]
        scored, values = ev.scored(model, metric)
        keep = [(c, v) for c, v in zip(scored, values) if c in index and not math.isnan(v)]
        if node.is_leaf:  # a client's model: distance 2 x the levels up to the common ancestor
            lineage = {a: i for i, a in enumerate([model, *tree.ancestors(model)])}
            for c, _ in keep:
                up = next(a for a in [c, *tree.ancestors(c)] if a in lineage)
                columns["distance"].append(lineage[up] + depth[c] - tree[up].depth)
                columns["on_path"].append(c == model)
        else:  # a server: the client's depth below it if under it, else through their common ancestor
            below = set(tree.leaves_under(model))
            ancestors = {a: i for i, a in enumerate([model, *tree.ancestors(model)])}
            for c, _ in keep:
                if c in below:
                    columns["distance"].append(depth[c] - node.depth)
                    columns["on_path"].append(True)
                else:
                    up = next(a for a in tree.ancestors(c) if a in ancestors)
                    columns["distance"].append(ancestors[up] + depth[c] - tree[up].depth)
                    columns["on_path"].append(False)
        model_column += [m] * len(keep)
        client_column += [index[c] for c, _ in keep]
        columns["value"] += [v for _, v in keep]
    model_ids, client_ids = np.array(model_column, dtype=np.int32), np.array(client_column, dtype=np.int32)
    order = np.lexsort((model_ids, client_ids))  # by client, then model: every mean below sums in this order
    return Pairs(
        models,
        clients,
        model_ids[order],
        client_ids[order],
        np.array(columns["distance"], dtype=np.int32)[order],
        np.array(columns["on_path"], dtype=bool)[order],
        np.array(columns["value"], dtype=np.float64)[order],
    )


def _curve(pairs: Pairs) -> list[CurvePoint]:
    """Mean and median of the metric per distance: all pairs, the own path, the rest."""
    curve: list[CurvePoint] = []
    for relation, keep in (("all", None), ("path", pairs.on_path), ("off_path", ~pairs.on_path)):
        distance = pairs.distance if keep is None else pairs.distance[keep]
        value = pairs.value if keep is None else pairs.value[keep]
        for d in sorted(set(distance.tolist())):
            vals = value[distance == d].tolist()  # in pair order: the mean sums as it always has
            ordered = sorted(vals)
            mid = len(ordered) // 2
            median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
            curve.append(CurvePoint(relation, d, len(vals), sum(vals) / len(vals), median))
    return curve


def analyse(ev: Evaluation, metric: str | None = None) -> Proximity:
    """Distances, the metric-vs-distance curve and the hypothesis shares of an evaluation."""
    metric = metric or ev.task.primary
    sign = 1.0 if ev.task.better(metric) else -1.0
    tree = ev.tree
    models = ev.node_models()
    pairs = _pairs(ev, metric)

    bounds = np.searchsorted(pairs.client, np.arange(len(ev.clients) + 1))  # pairs are by client, then model
    clients: list[ClientProximity] = []
    steps: dict[int, list[bool]] = {}
    for i, client in enumerate(ev.clients):
        mine = np.arange(bounds[i], bounds[i + 1])
        distances = pairs.distance[mine].astype(float).tolist()
        values = (sign * pairs.value[mine]).tolist()
        rho = spearman(distances, values) if len(set(distances)) > 1 else float("nan")
        path = sorted((int(pairs.distance[j]), sign * float(pairs.value[j])) for j in mine if pairs.on_path[j])
        chain = [v for _, v in path]
        holds = all(a >= b for a, b in itertools.pairwise(chain)) if len(chain) > 1 else None
        for (lower, _), (a, b) in zip(path, itertools.pairwise(chain)):
            steps.setdefault(lower, []).append(a >= b)
        clients.append(ClientProximity(client, len(mine), rho, holds))

    globals_: dict[str, GlobalProximity] = {}
    for test_set in (UNION, PROXY):
        depth_values = [(tree[m].depth, ev.value(m, test_set, metric)) for m in models]
        scored = [(d, v) for d, v in depth_values if v is not None and not math.isnan(v)]
        rho = spearman([float(d) for d, _ in scored], [sign * v for _, v in scored]) if scored else float("nan")
        depths: dict[int, list[float]] = {}
        for d, v in scored:
            depths.setdefault(d, []).append(v)
        flags: list[bool | None] = []
        for client in ev.clients:
            up = [m for m in [client, *tree.ancestors(client)] if ev.value(m, test_set, metric) is not None]
            chain = [sign * float(ev.value(m, test_set, metric)) for m in up]  # type: ignore[arg-type]
            flags.append(all(a <= b for a, b in itertools.pairwise(chain)) if len(chain) > 1 else None)
        globals_[test_set] = GlobalProximity(
            test_set, rho, _share(flags), [(d, len(v), sum(v) / len(v)) for d, v in sorted(depths.items())]
        )

    return Proximity(
        metric,
        sign > 0,
        pairs,
        _curve(pairs),
        clients,
        _share([None if math.isnan(c.rho) else c.rho < 0 for c in clients]),
        _share([c.path_holds for c in clients]),
        [(d, len(flags), _share(flags)) for d, flags in sorted(steps.items())],
        globals_,
    )


def headline(p: Proximity) -> dict[str, float]:
    """Parent-run metrics of the proximity analysis."""
    out = {
        "proximity/share_clients_rank": p.share_rank,
        "proximity/share_clients_path": p.share_path,
    }
    rhos = [c.rho for c in p.clients if not math.isnan(c.rho)]
    if rhos:
        out["proximity/mean_rho"] = sum(rhos) / len(rhos)
    for d, _, share in p.path_steps:
        out[f"proximity/share_path_step_{d}"] = share
    for point in p.curve:
        if point.relation == "all":
            out[f"proximity/{p.metric}_at_distance_{point.distance}"] = point.mean
    for test_set, g in p.globals.items():
        out[f"proximity/{test_set}_rho_depth"] = g.rho_depth
        out[f"proximity/{test_set}_share_paths"] = g.path_share
    return out


def curve_csv(p: Proximity) -> str:
    return table_csv(
        ["relation", "distance", "pairs", "mean", "median"],
        ([c.relation, c.distance, c.n, f"{c.mean:.6f}", f"{c.median:.6f}"] for c in p.curve),
    )


def clients_csv(p: Proximity) -> str:
    return table_csv(
        ["client", "models", "rho", "path_holds"],
        ([c.client, c.models, f"{c.rho:.6f}", None if c.path_holds is None else int(c.path_holds)] for c in p.clients),
    )
