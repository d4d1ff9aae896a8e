"""Selectors: how the config names nodes of the tree.

A selector (residual rules' ``from`` / ``to``, ``data.proxy.servers``) names a node
id, a level (``root``, ``server``, ``edge``, ``client``) or a depth (``depth:2``,
root = 0). Settings resolution (``topology.py``) and residual wiring
(``residual_wiring.py``) both ask which nodes a selector names.
"""

from __future__ import annotations

from bhfl_core.algorithm.tree import Node, Role, Tree
from bhfl_core.config.base import ConfigError
from bhfl_core.config.schema import ExperimentConfig

LEVEL_KEY = {Role.ROOT: "root", Role.SERVER: "server", Role.EDGE: "edge", Role.CLIENT: "client"}
DEPTH_SELECTOR = "depth:"  # ``depth:2``: every node at depth 2 (root = 0)


def selects(selector: str, node_id: str, role: Role, depth: int) -> bool:
    """Whether a selector (node id, level name, or ``depth:N``) names this node."""
    return (
        node_id == selector
        or LEVEL_KEY[role] == selector
        or (selector.startswith(DEPTH_SELECTOR) and selector[len(DEPTH_SELECTOR) :] == str(depth))
    )


def holds_proxy(config: ExperimentConfig, node_id: str, role: Role, depth: int) -> bool:
    proxy = config.data.proxy
    return proxy.train_per_language > 0 and any(selects(s, node_id, role, depth) for s in proxy.servers)


def matches(selector: str, node: Node) -> bool:
    return selects(selector, node.id, node.role, node.depth)


def lookup(tree: Tree, selector: str, key: str) -> list[Node]:
    found = [n for n in tree if matches(selector, n)]
    if not found:
        raise ConfigError(
            f"{key}: {selector!r} matches no node (a level: root, server, edge, client; a depth: depth:N; or a node id)"
        )
    return found
