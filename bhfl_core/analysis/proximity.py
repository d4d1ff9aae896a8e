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

import torch

from bhfl_core.analysis.evaluation import PROXY, UNION, Evaluation
from bhfl_core.store.tables import table_csv


@dataclass(frozen=True)
class Pair:
    model: str
    client: str
    distance: int
    on_path: bool  # the model is the client's own or one of its ancestors'
    value: float


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
    pairs: list[Pair]
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


def analyse(ev: Evaluation, metric: str | None = None) -> Proximity:
    """Distances, the metric-vs-distance curve and the hypothesis shares of an evaluation."""
    metric = metric or ev.task.primary
    sign = 1.0 if ev.task.better(metric) else -1.0
    tree = ev.tree
    models = ev.node_models()
    pairs: list[Pair] = []
    for client in ev.clients:
        own_path = {client, *tree.ancestors(client)}
        for model in models:
            value = ev.value(model, client, metric)
            if value is not None and not math.isnan(value):
                pairs.append(Pair(model, client, tree.distance(model, client), model in own_path, value))

    curve: list[CurvePoint] = []
    for relation, keep in (
        ("all", lambda p: True),
        ("path", lambda p: p.on_path),
        ("off_path", lambda p: not p.on_path),
    ):
        by_d: dict[int, list[float]] = {}
        for p in pairs:
            if keep(p):
                by_d.setdefault(p.distance, []).append(p.value)
        for d in sorted(by_d):
            vals = sorted(by_d[d])
            mid = len(vals) // 2
            median = vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2
            curve.append(CurvePoint(relation, d, len(vals), sum(vals) / len(vals), median))

    by_client: dict[str, list[Pair]] = {}
    for p in pairs:
        by_client.setdefault(p.client, []).append(p)
    clients: list[ClientProximity] = []
    steps: dict[int, list[bool]] = {}
    for client in ev.clients:
        mine = by_client.get(client, [])
        distances = [float(p.distance) for p in mine]
        rho = spearman(distances, [sign * p.value for p in mine]) if len(set(distances)) > 1 else float("nan")
        path = sorted((p for p in mine if p.on_path), key=lambda p: p.distance)
        chain = [sign * p.value for p in path]
        holds = all(a >= b for a, b in itertools.pairwise(chain)) if len(chain) > 1 else None
        for lower, (a, b) in zip(path, itertools.pairwise(chain)):
            steps.setdefault(lower.distance, []).append(a >= b)
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
        curve,
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
