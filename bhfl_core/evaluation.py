"""Turn per-(model, test set) confusion matrices into the evaluation matrix and headlines.

Test sets are every client's test split (named by client id), ``proxy`` (the proxy
test split) and ``union`` (all client test splits together: the sum of their
confusion matrices). Rows are long-format ``(node, level, test_set, metric, value)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from bhfl_core.metrics import classification_metrics
from bhfl_core.tree import Tree

UNION = "union"
PROXY = "proxy"


@dataclass(frozen=True)
class EvalRow:
    node: str
    level: int
    test_set: str
    metric: str
    value: float


Confusions = Mapping[str, Mapping[str, torch.Tensor]]  # node -> test set -> confusion


def eval_rows(tree: Tree, confusions: Confusions) -> list[EvalRow]:
    rows: list[EvalRow] = []
    client_ids = [c.id for c in tree.clients()]
    for node_id in sorted(confusions, key=lambda n: (tree[n].depth, n)):
        scores = dict(confusions[node_id])
        scores[UNION] = sum((scores[c] for c in client_ids), torch.zeros_like(scores[client_ids[0]]))
        for test_set in [*client_ids, PROXY, UNION]:
            for metric, value in classification_metrics(scores[test_set]).items():
                rows.append(EvalRow(node_id, tree[node_id].depth, test_set, metric, value))
    return rows


def matrix_csv(rows: list[EvalRow]) -> str:
    lines = ["node,level,test_set,metric,value"]
    lines += [f"{r.node},{r.level},{r.test_set},{r.metric},{r.value:.6f}" for r in rows]
    return "\n".join(lines) + "\n"


def worst_fraction_mean(values: list[float], fraction: float = 0.1) -> float:
    """Mean of the lowest ``fraction`` of values (at least one): the 'worst 10%' statistic."""
    clean = sorted(v for v in values if not math.isnan(v))
    if not clean:
        return float("nan")
    k = max(1, math.ceil(fraction * len(clean)))
    return sum(clean[:k]) / k


def headline_metrics(tree: Tree, rows: list[EvalRow], metric: str = "accuracy") -> dict[str, float]:
    """Per-client accuracy of the client's own model, its edge server's, and the root's."""
    value = {(r.node, r.test_set): r.value for r in rows if r.metric == metric}
    out: dict[str, float] = {}
    root = tree.root_id
    for name, key in ((f"root/union/{metric}", (root, UNION)), (f"root/proxy/{metric}", (root, PROXY))):
        if key in value:
            out[name] = value[key]
    clients = tree.clients()
    for label, model_of in (("client", lambda c: c.id), ("edge", lambda c: c.parent), ("root", lambda c: root)):
        per_client = [value[(model_of(c), c.id)] for c in clients if (model_of(c), c.id) in value]
        if per_client:
            out[f"{label}_on_own_clients/{metric}_mean"] = sum(per_client) / len(per_client)
            out[f"{label}_on_own_clients/{metric}_worst10"] = worst_fraction_mean(per_client)
    return out
