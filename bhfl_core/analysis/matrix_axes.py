"""The evaluation matrix's two axes: which models (``ModelRef``) and which test sets, in a fixed order.

Test sets are ``<client id>`` (that client's test split), ``subtree:<server>`` (the
union of the client test splits under a non-root server), ``union`` (all client test
splits: the root's subtree) and ``proxy`` (the proxy test split). Clients are in the
tree's depth-first order, so the clients of a server stay together in every table.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from bhfl_core.algorithm.tree import Tree

UNION = "union"
PROXY = "proxy"
SUBTREE = "subtree:"

ModelKind = Literal["node", "personal", "local_only", "adapted"]
_PREFIX: dict[ModelKind, str] = {"node": "", "personal": "personal:", "local_only": "local:", "adapted": "adapt:"}


def subtree_set(node_id: str) -> str:
    return f"{SUBTREE}{node_id}"


@dataclass(frozen=True)
class ModelRef:
    """A model in the matrix: the tree node it belongs to and its kind.

    ``kind`` is ``node`` (a node's own model), ``personal`` (a Ditto client's personal
    model), ``local_only`` or ``adapted`` (the per-client baselines of client ``node``).
    ``name`` is how the model is written in the matrix, MLflow metrics and reports: the
    node id, ``personal:<client>``, ``local:<client>`` or ``adapt:<client>``.
    """

    node: str
    kind: ModelKind

    def __post_init__(self) -> None:
        if self.kind not in _PREFIX:
            raise ValueError(f"unknown model kind {self.kind!r}")

    @classmethod
    def of_node(cls, node_id: str) -> ModelRef:
        return cls(node_id, "node")

    @classmethod
    def personal(cls, client_id: str) -> ModelRef:
        return cls(client_id, "personal")

    @classmethod
    def local_only(cls, client_id: str) -> ModelRef:
        return cls(client_id, "local_only")

    @classmethod
    def adapted(cls, client_id: str) -> ModelRef:
        return cls(client_id, "adapted")

    @property
    def name(self) -> str:
        return f"{_PREFIX[self.kind]}{self.node}"


def dfs_order(tree: Tree) -> list[str]:
    """Node ids in depth-first pre-order (root, first subtree, ...): clients of a server stay together."""
    out: list[str] = []
    stack = [tree.root_id]
    while stack:
        node_id = stack.pop()
        out.append(node_id)
        stack.extend(reversed(tree[node_id].children))
    return out


def client_order(tree: Tree) -> list[str]:
    return [n for n in dfs_order(tree) if tree[n].is_leaf]


def all_test_sets(tree: Tree) -> list[str]:
    """Client tests (tree order), ``subtree:<server>`` for each non-root server, ``union``, ``proxy``."""
    subtrees = [subtree_set(n) for n in dfs_order(tree) if not tree[n].is_leaf and n != tree.root_id]
    return [*client_order(tree), *subtrees, UNION, PROXY]


_KIND_RANK: dict[ModelKind, int] = {"node": 0, "personal": 1, "adapted": 2, "local_only": 3}


def model_order(tree: Tree, models: Iterable[ModelRef]) -> list[ModelRef]:
    """Node models in tree order, then personal models, adapted baselines, local-only ones (each in tree order)."""
    position = {n: i for i, n in enumerate(dfs_order(tree))}
    return sorted(models, key=lambda m: (_KIND_RANK[m.kind], position[m.node]))
