"""Communication accounting: models and bytes moved per level, round and direction.

The engine records, for every server round, how many models it sent to its sampled
children (``comm/down_models``), received from them (``comm/up_models``), sent as
down-residuals to descendants (``comm/res_down_models``) and passed up as
up-residuals to ancestors (``comm/res_up_models``). Every model is the flat float32
vector of the trainable parameters, so ``bytes = models x parameters x 4``; one
*model-equivalent* is one such vector.

The input is each server's per-round history (round -> count), as persisted (the
node runs' MLflow metric histories), so a resumed run accounts for the whole run.
Rows are attributed to the level (depth) of the server that logged them: its
traffic with its children, and the residuals it sent. A server whose children send
compressed updates (``aggregate.compress``) also logs ``comm/up_bytes``, the payloads'
actual size, which then replaces ``models x parameters x 4`` for its up rows; one that
compresses its broadcasts (``compress_down``) logs ``comm/down_bytes`` for its down rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bhfl_core.algorithm.tree import Tree
from bhfl_core.store.tables import table_csv

BYTES_PER_VALUE = 4  # float32 flat vectors
KEYS: dict[str, tuple[str, str]] = {  # metric -> (direction, kind)
    "comm/down_models": ("down", "regular"),
    "comm/up_models": ("up", "regular"),
    "comm/res_down_models": ("down", "residual"),
    "comm/res_up_models": ("up", "residual"),
}

MEASURED_BYTES = {"comm/up_models": "comm/up_bytes", "comm/down_models": "comm/down_bytes"}
"""Counts whose bytes a server logs itself when they are not ``models x parameters x 4``: the payloads
of compressed updates (``algorithm/compression.py``), for a server whose children compress, and of
compressed broadcasts (``algorithm/downlink.py``), for a server with ``compress_down``."""
HISTORY_KEYS = (*KEYS, *MEASURED_BYTES.values())

History = Mapping[str, Mapping[str, Mapping[int, float]]]  # node -> metric key -> round (step) -> models


@dataclass(frozen=True)
class CommRow:
    level: int
    node: str
    round: int  # the node's own round (its MLflow step)
    direction: str  # 'down' or 'up'
    kind: str  # 'regular' or 'residual'
    models: float
    bytes: float


def comm_rows(tree: Tree, history: History, num_params: int) -> list[CommRow]:
    """One row per (server, round, direction, kind) with a count, in tree-level order."""
    if num_params <= 0:
        raise ValueError(f"num_params must be positive, got {num_params}")
    rows: list[CommRow] = []
    for node_id in sorted(history, key=lambda n: (tree[n].depth, n)):
        for key, (direction, kind) in KEYS.items():
            measured = history[node_id].get(MEASURED_BYTES.get(key, ""), {})
            for step, models in sorted(history[node_id].get(key, {}).items()):
                if not models:
                    continue  # rounds that moved nothing of this kind (e.g. no residual rule) add no row
                size = measured.get(step, float(models) * num_params * BYTES_PER_VALUE)
                rows.append(CommRow(tree[node_id].depth, node_id, step, direction, kind, float(models), float(size)))
    return rows


@dataclass(frozen=True)
class LevelSummary:
    level: int
    servers: str  # the role(s) of the servers at this level, e.g. 'edge'
    direction: str
    kind: str
    server_rounds: int  # (server, round) pairs at this level that logged counts
    models: float
    bytes: float

    @property
    def models_per_round(self) -> float:
        return self.models / self.server_rounds if self.server_rounds else 0.0


def summarise(tree: Tree, rows: Sequence[CommRow]) -> list[LevelSummary]:
    """Totals per (level, direction, kind)."""
    groups: dict[tuple[int, str, str], list[CommRow]] = {}
    for r in rows:
        groups.setdefault((r.level, r.direction, r.kind), []).append(r)
    out: list[LevelSummary] = []
    order = {"down": 0, "up": 1}
    for (level, direction, kind), items in sorted(groups.items(), key=lambda kv: (kv[0][0], order[kv[0][1]], kv[0][2])):
        roles = "/".join(sorted({tree[r.node].role.value for r in items}))
        out.append(
            LevelSummary(
                level,
                roles,
                direction,
                kind,
                len({(r.node, r.round) for r in items}),
                sum(r.models for r in items),
                sum(r.bytes for r in items),
            )
        )
    return out


def totals(rows: Sequence[CommRow]) -> dict[str, float]:
    """Experiment totals: all traffic, and split by direction and by kind (parent-run metrics)."""
    out = {"comm/total_model_equivalents": sum(r.models for r in rows), "comm/total_bytes": sum(r.bytes for r in rows)}
    for direction in ("down", "up"):
        out[f"comm/{direction}_bytes"] = sum(r.bytes for r in rows if r.direction == direction)
    out["comm/residual_bytes"] = sum(r.bytes for r in rows if r.kind == "residual")
    return out


def rows_csv(rows: Sequence[CommRow]) -> str:
    return table_csv(
        ["level", "node", "round", "direction", "kind", "models", "bytes"],
        ([r.level, r.node, r.round, r.direction, r.kind, f"{r.models:g}", f"{r.bytes:.0f}"] for r in rows),
    )


def summary_csv(summary: Sequence[LevelSummary]) -> str:
    return table_csv(
        ["level", "servers", "direction", "kind", "server_rounds", "models", "bytes", "models_per_round"],
        (
            [
                s.level,
                s.servers,
                s.direction,
                s.kind,
                s.server_rounds,
                f"{s.models:g}",
                f"{s.bytes:.0f}",
                f"{s.models_per_round:.4f}",
            ]
            for s in summary
        ),
    )


def human_bytes(n: float) -> str:
    """Decimal units (1 MB = 10^6 bytes)."""
    units = ("B", "KB", "MB", "GB", "TB")
    i = 0
    while abs(n) >= 1000 and i < len(units) - 1:
        n /= 1000
        i += 1
    return f"{n:.0f} B" if i == 0 else f"{n:.2f} {units[i]}"
