"""Build the experiment tree from the config and the data manifest.

root -> intermediate servers (``tree.groups``, optional) -> one edge server per
language -> that language's clients. Settings are resolved per node: the level's
settings, then ``tree.nodes.<id>`` overrides. Impossible trees (a cohort larger than
the children, proxy training without proxy data, overrides for unknown nodes) raise
``ConfigError`` naming the key.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from bhfl_core.config import ConfigError, ExperimentConfig, LevelSettings, NodeOverride
from bhfl_core.node_opt import NodeOptParams
from bhfl_core.tree import Node, NodeSettings, Role, TrainParams, Tree

ROOT_ID = "root"
_LEVEL_KEY = {Role.ROOT: "root", Role.SERVER: "server", Role.EDGE: "edge", Role.CLIENT: "client"}


@dataclass(frozen=True)
class ClientInfo:
    """What the tree needs to know about a client (from the data manifest)."""

    id: str
    language: str
    num_train: int


def edge_id(language: str) -> str:
    return f"edge-{language}"


def _resolve(config: ExperimentConfig, node_id: str, role: Role, num_children: int, has_proxy: bool) -> NodeSettings:
    level_key = f"tree.{_LEVEL_KEY[role]}"
    level: LevelSettings = getattr(config.tree, _LEVEL_KEY[role])
    override = config.tree.nodes.get(node_id, NodeOverride())
    values = {key: getattr(level, key) for key in LevelSettings.model_fields}
    origin = {key: f"{level_key}.{key}" for key in values}
    for key in override.model_fields_set:  # keys written in YAML; `cohort: null` means "all children"
        if getattr(override, key) is None and key != "cohort":
            continue
        values[key] = getattr(override, key)
        origin[key] = f"tree.nodes.{node_id}.{key}"

    cohort = values["cohort"]
    if role is Role.CLIENT:
        cohort = None
    elif isinstance(cohort, float):
        cohort = max(1, round(cohort * num_children))
    elif isinstance(cohort, int) and cohort > num_children:
        raise ConfigError(f"{origin['cohort']}: cohort of {cohort} is larger than the {num_children} children of node {node_id!r}")

    train: TrainParams | None = None
    if role is Role.CLIENT or values["proxy_train"]:
        if role is not Role.CLIENT and not has_proxy:
            raise ConfigError(f"{origin['proxy_train']}: node {node_id!r} has no proxy split to train on")
        t = values["train"]
        train = TrainParams(lr=t.lr, epochs=t.epochs, max_steps=t.max_steps, batch_size=t.batch_size,
                            optimizer=t.optimizer, weight_decay=t.weight_decay)

    def opt(direction: str) -> NodeOptParams:
        o = values[f"opt_{direction}"]
        return NodeOptParams(kind=o.kind, eta=values[f"eta_{direction}"], beta1=o.beta1, beta2=o.beta2, tau=o.tau)

    return NodeSettings(rounds=values["rounds"], cohort=cohort, opt_up=opt("up"), opt_down=opt("down"),
                        persistent=values["persistent"], train=train)


def build_tree(config: ExperimentConfig, clients: Sequence[ClientInfo], proxy_nodes: Collection[str] = (ROOT_ID,)) -> Tree:
    """The tree for ``config`` over ``clients``; ``proxy_nodes`` are the servers holding proxy data."""
    languages = config.data.source.languages
    by_language: dict[str, list[ClientInfo]] = {lang: [] for lang in languages}
    for c in clients:
        if c.language not in by_language:
            raise ConfigError(f"data: client {c.id!r} has language {c.language!r}, not in data.source.languages")
        by_language[c.language].append(c)
    empty = [lang for lang, cs in by_language.items() if not cs]
    if empty:
        raise ConfigError(f"data.source.languages: languages {empty} have no clients")

    groups = config.tree.groups or {}
    edge_parent = {lang: group for group, langs in groups.items() for lang in langs}
    nodes: dict[str, Node] = {}
    depth_edge = 2 if groups else 1

    def add(node_id: str, role: Role, depth: int, parent: str | None, children: list[str], weight: float, group: str | None) -> None:
        settings = _resolve(config, node_id, role, len(children), node_id in proxy_nodes)
        nodes[node_id] = Node(node_id, role, depth, parent, tuple(children), settings, float(weight), group)

    if config.tree.flat:
        for c in clients:
            add(c.id, Role.CLIENT, 1, ROOT_ID, [], c.num_train, c.language)
        top = [c.id for c in clients]
        add(ROOT_ID, Role.ROOT, 0, None, top, sum(c.num_train for c in clients), None)
        _check_overrides(config, nodes)
        return Tree(nodes=nodes, root_id=ROOT_ID)

    for lang in languages:
        cs = by_language[lang]
        parent = edge_parent.get(lang, ROOT_ID)
        for c in cs:
            add(c.id, Role.CLIENT, depth_edge + 1, edge_id(lang), [], c.num_train, lang)
        add(edge_id(lang), Role.EDGE, depth_edge, parent, [c.id for c in cs], sum(c.num_train for c in cs), lang)
    for group, langs in groups.items():
        add(group, Role.SERVER, 1, ROOT_ID, [edge_id(lang) for lang in langs], sum(nodes[edge_id(lang)].weight for lang in langs), group)
    top = list(groups) if groups else [edge_id(lang) for lang in languages]
    add(ROOT_ID, Role.ROOT, 0, None, top, sum(nodes[c].weight for c in top), None)

    _check_overrides(config, nodes)
    return Tree(nodes=nodes, root_id=ROOT_ID)


def _check_overrides(config: ExperimentConfig, nodes: dict[str, Node]) -> None:
    unknown = sorted(set(config.tree.nodes) - set(nodes))
    if unknown:
        servers = ", ".join(n for n, node in nodes.items() if not node.is_leaf)
        raise ConfigError(f"tree.nodes.{unknown[0]}: no such node (servers: {servers}; clients: <language>-NN)")
