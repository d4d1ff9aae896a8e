"""Build the experiment tree from the config and the data manifest.

root -> intermediate servers (``tree.groups``, optional, nested to any depth) ->
edge servers -> clients. Clients are grouped by the edge server the data manifest
assigns them (by default one edge per language, ``edge-<lang>``; or several per
language, or k-means clusters: see ``data.clustering``); ``tree.groups`` maps each
intermediate server to the languages (or clusters) whose edge servers it holds, or
to its sub-groups. Settings are resolved per node: the level's settings, for an
intermediate server then ``tree.levels.<depth>``, then ``tree.nodes.<id>``
overrides. Impossible trees (a cohort larger than the children, proxy training
without proxy data, overrides for unknown nodes) raise ``ConfigError`` naming the key.

Selectors (residual rules' ``from`` / ``to``, ``data.proxy.servers``) name a node id,
a level (``root``, ``server``, ``edge``, ``client``) or a depth (``depth:2``, root = 0):
``selectors.py``. A node's NODEOPTs and aggregation settings (privacy, secure
aggregation, compression) are resolved in ``aggregation_settings.py``, the residual
rules wired in ``residual_wiring.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from bhfl_core.algorithm.asynchrony import AsyncParams, StalenessParams
from bhfl_core.algorithm.node_opt import is_tuned
from bhfl_core.algorithm.privacy_params import DpSgdParams
from bhfl_core.algorithm.tree import Node, NodeSettings, Role, TrainParams, Tree
from bhfl_core.config.adapter_settings import own_b, product_steps, rank_cap
from bhfl_core.config.aggregation_settings import aggregate_params, check_dp_sgd, node_opt
from bhfl_core.config.base import ConfigError
from bhfl_core.config.data import KMeansClustering, LanguageClustering
from bhfl_core.config.downlink_settings import downlink_params
from bhfl_core.config.layering import check_mode_keys, layered
from bhfl_core.config.privacy_plan import plan_privacy
from bhfl_core.config.residual_wiring import wire_residuals
from bhfl_core.config.schema import ExperimentConfig
from bhfl_core.config.selectors import DEPTH_SELECTOR, holds_proxy
from bhfl_core.config.step_normalised_starts import check_step_normalised_starts
from bhfl_core.config.tree_schema import TrainSettings

ROOT_ID = "root"


@dataclass(frozen=True)
class ClientInfo:
    """What the tree needs to know about a client (from the data manifest).

    ``edge`` / ``cluster``: the client's edge server and that edge's cluster (what
    ``tree.groups`` refers to); unset, they are ``edge-<language>`` and the language.
    """

    id: str
    language: str
    num_train: int
    edge: str | None = None
    cluster: str | None = None

    @property
    def edge_id(self) -> str:
        return self.edge or edge_id(self.language)

    @property
    def cluster_name(self) -> str:
        return self.cluster or self.language


def edge_id(cluster: str) -> str:
    """The edge server of a language (or k-means cluster) that has one edge server."""
    return f"edge-{cluster}"


def client_ids(language: str, count: int) -> list[str]:
    width = max(2, len(str(count - 1)))
    return [f"{language}-{i:0{width}d}" for i in range(count)]


def language_edges(language: str, count: int, edges: int) -> list[str]:
    """The edge server of each of a language's ``count`` clients (in id order).

    One edge: ``edge-<lang>`` for all. Several: contiguous, near-equal blocks of
    clients, ``edge-<lang>-0``, ``edge-<lang>-1``, ... (deterministic, no draw).
    """
    if edges == 1:
        return [edge_id(language)] * count
    return [f"edge-{language}-{i * edges // count}" for i in range(count)]


def placeholder_clients(config: ExperimentConfig) -> list[ClientInfo]:
    """The clients the config will produce, before any data exists (for validating the tree).

    K-means assignments depend on the data; placeholders spread clients round-robin
    over the clusters, so checks that depend on cluster sizes are repeated when the
    tree is built from the real manifest.
    """
    data = config.data
    out: list[ClientInfo] = []
    for lang in data.source.languages:
        ids = client_ids(lang, data.clients_per_language)
        if isinstance(data.clustering, LanguageClustering):
            edges = language_edges(lang, len(ids), data.clustering.edges_per_language)
            out += [ClientInfo(cid, lang, 1, edge, lang) for cid, edge in zip(ids, edges)]
        else:
            out += [ClientInfo(cid, lang, 1) for cid in ids]
    if isinstance(data.clustering, KMeansClustering):
        k = data.clustering.clusters
        out = [replace(c, edge=edge_id(f"c{i % k}"), cluster=f"c{i % k}") for i, c in enumerate(out)]
    return out


def _resolve(config: ExperimentConfig, node_id: str, role: Role, depth: int, num_children: int) -> NodeSettings:
    """A node's settings: its merged keys (``layered``) checked against each other and its place in the tree."""
    values, origin = layered(config, node_id, role, depth)
    cohort, poisson_rate = _cohort(values, origin, node_id, role, num_children)
    has_data = role is Role.CLIENT or holds_proxy(config, node_id, role, depth)
    proxy_async = values["proxy_train"] == "async"
    if proxy_async and role is Role.CLIENT:
        raise ConfigError(f"{origin['proxy_train']}: 'async' proxy training is for servers; {node_id!r} is a client")
    if values["proxy_train"] and role is Role.CLIENT:  # it would be read as nothing: a client always TRAINs
        raise ConfigError(
            f"{origin['proxy_train']}: proxy training is for servers (a TRAIN on a proxy split); {node_id!r} is a "
            "client, which trains on its own data every round anyway"
        )
    train: TrainParams | None = None
    if role is Role.CLIENT or values["proxy_train"]:
        if not has_data:
            raise ConfigError(
                f"{origin['proxy_train']}: node {node_id!r} has no proxy split to train on "
                f"(data.proxy.servers is {config.data.proxy.servers}, "
                f"data.proxy.train_per_language is {config.data.proxy.train_per_language})"
            )
        train = _train_params(values["train"])
        tuned = next((origin[f"opt_{d}"] for d in ("down", "up") if is_tuned(values[f"opt_{d}"].kind)), None)
        check_dp_sgd(values["train"], origin["train"], node_id, role, config.data.task, tuned)
        _check_proximal_step(values["train"], origin["train"], node_id, "FedProx's mu")
    _check_down_step_used(values, origin, node_id, role)
    _check_tuned_eta(values, origin, node_id)
    asynchronous = None
    if values["mode"] == "async":
        if role is Role.CLIENT:
            raise ConfigError(f"{origin['mode']}: a client has no children; only servers run asynchronously")
        st = values["staleness"]
        asynchronous = AsyncParams(values["concurrency"], values["buffer"], StalenessParams(st.kind, st.a, st.b))
    personal = values["personal"]
    if personal is not None and role is not Role.CLIENT:
        raise ConfigError(f"{origin['personal']}: only clients keep a personal (Ditto) model; {node_id!r} is a server")
    if personal is not None:  # Opacus sets .grad itself: Ditto's lambda (v - w) would be dropped, not privatised
        check_dp_sgd(personal, origin["personal"], node_id, role, config.data.task, proximal="Ditto's lambda")
        _check_proximal_step(personal, origin["personal"], node_id, "Ditto's lambda (mu)")

    aggregate = aggregate_params(
        config, node_id, role, values, origin, _expected(cohort, poisson_rate, num_children), num_children
    )
    return NodeSettings(
        rounds=values["rounds"],
        cohort=cohort,
        poisson_rate=poisson_rate,
        opt_up=node_opt(values, origin, "up", node_id, has_data),
        opt_down=node_opt(values, origin, "down", node_id, has_data),
        persistent=values["persistent"],
        train=train,
        proxy_async=proxy_async,
        holdout=values["holdout"],
        personal=_train_params(personal) if personal is not None else None,
        asynchronous=asynchronous,
        dropout=config.tree.clock.dropout_p if role is Role.CLIENT else 0.0,
        aggregate=aggregate,
        downlink=downlink_params(values, origin, node_id, role, aggregate),
        tempo=config.tree.client.train.epochs if config.tree.tempo and role is Role.ROOT else None,
        evaluated=role is not Role.CLIENT or _client_state_read(config),
        rank=rank_cap(config, values["adapter_rank"], origin["adapter_rank"]),
        own_b=own_b(config, role),
    )


def _check_down_step_used(values: dict[str, Any], origin: dict[str, str], node_id: str, role: Role) -> None:
    """A down step other than adoption (``eta_down`` below or above 1, another ``opt_down``) where it would be read
    as nothing: at the root (no parent sends it a model) and at a non-persistent node (it starts every execution
    from its parent's model and keeps none of its own to mix with)."""
    if values["persistent"] and role is not Role.ROOT:
        return
    used = {"eta_down": values["eta_down"] != 1.0, "opt_down": values["opt_down"].kind != "fedavg"}
    key = next((k for k, differs in used.items() if differs), None)
    if key is None:
        return
    shown = values[key] if key == "eta_down" else values[key].kind
    why = (
        "the root has no parent: no model comes down to it"
        if role is Role.ROOT
        else f"{node_id!r} is not persistent ({origin['persistent']}: false): it starts every execution from its "
        "parent's model and keeps none of its own to aggregate with"
    )
    raise ConfigError(
        f"{origin[key]}: {why}, so {key} {shown} would never be used; "
        + (
            "drop the key"
            if role is Role.ROOT
            else "make it persistent for partial aggregation on the way down, or drop the key"
        )
    )


def _check_proximal_step(train: TrainSettings, key: str, node_id: str, term: str) -> None:
    """Refuse SGD whose proximal pull or weight decay alone oversteps: ``lr·mu >= 1`` or ``lr·weight_decay >= 1``.

    One SGD step multiplies the distance to the anchor by ``1 - lr·mu`` (to zero: by
    ``1 - lr·weight_decay``), besides the loss's gradient: at ``>= 1`` the step lands on or
    past it, flipping sides each step, and from 2 on the distance grows every step.
    FedNova's normaliser, ``sum_k (1 - lr·mu)^k`` (``fednova_norm.py``), would weight
    gradients by alternating signs or vanish. AdamW scales its steps itself (and decouples
    its decay): ``lr·mu`` says nothing there.
    """
    if train.optimizer != "sgd":
        return
    pulls = (
        ("mu", train.mu, term, "the model they are pulled towards"),
        ("weight_decay", train.weight_decay, "weight decay", "zero"),
    )
    for name, coefficient, label, towards in pulls:
        if (alpha := train.lr * coefficient) >= 1:
            raise ConfigError(
                f"{key}.{name}: {label} {coefficient} with sgd at lr {train.lr} makes lr·{name} = {alpha:g} >= 1: "
                f"every step would move the parameters of {node_id!r} onto or past {towards} (each step multiplies "
                f"their distance to it by 1 - lr·{name}; from 2 on the distance grows), so TRAIN oscillates or "
                f"diverges; lower {name} or lr so that lr·{name} < 1"
            )


def _check_tuned_eta(values: dict[str, Any], origin: dict[str, str], node_id: str) -> None:
    """``interp`` picks its own mixing weight (``alpha``, ``node_opt.py``) and never reads ``eta_up`` / ``eta_down``:
    one set to another value than 1 beside it would be silently ignored."""
    for direction in ("up", "down"):
        eta = values[f"eta_{direction}"]
        if is_tuned(values[f"opt_{direction}"].kind) and eta != 1.0:
            raise ConfigError(
                f"{origin[f'eta_{direction}']}: {eta} would not be read: the opt_{direction} of {node_id!r} "
                f"({origin[f'opt_{direction}']}) is interp, which picks its own mixing weight (alpha) from its "
                "grid; drop the eta"
            )


def _cohort(
    values: dict[str, Any], origin: dict[str, str], node_id: str, role: Role, num_children: int
) -> tuple[int | None, float | None]:
    """A round's cohort as ``(size, None)`` (``None``: all children) or, with ``sampling: poisson``, ``(None,
    rate)``: each child's chance to be called; a fraction of the children becomes a count. A client has none, nor
    does an asynchronous server (docs/config.md ``mode``), whatever cohort it inherits: no size check there."""
    cohort, key = values["cohort"], origin["cohort"]
    if role is Role.CLIENT:  # a cohort written for a client would be read as nothing: it has no children
        if cohort is not None or values["sampling"] != "fixed":
            where = key if cohort is not None else origin["sampling"]
            raise ConfigError(
                f"{where}: {node_id!r} is a client, which has no children to sample; a cohort is a server's "
                "(set it at the level or node whose children are sampled, e.g. tree.edge.cohort)"
            )
        return None, None
    if values["sampling"] == "poisson":
        where = origin["sampling"]
        if values["mode"] == "async":
            raise ConfigError(
                f"{where}: {node_id!r} runs asynchronously (FedBuff): it calls children as others finish and "
                "draws no cohort; Poisson sampling is for synchronous rounds"
            )
        if not isinstance(cohort, float):
            raise ConfigError(
                f"{key}: with {where}: poisson the cohort is each child's chance to be called in a round, a number "
                f"in (0, 1] such as 0.1; got {cohort!r}"
            )
        return None, cohort
    if values["mode"] == "async":  # FedBuff calls children as others finish: a cohort (often inherited) is not used
        return None, None
    if isinstance(cohort, float):
        return max(1, round(cohort * num_children)), None
    if isinstance(cohort, int) and cohort > num_children:
        raise ConfigError(f"{key}: cohort of {cohort} is larger than the {num_children} children of node {node_id!r}")
    return cohort, None


def _expected(cohort: int | None, poisson_rate: float | None, num_children: int) -> float | None:
    """The contributions a round expects: its cohort's size, or the Poisson rate times the children."""
    return cohort if poisson_rate is None else poisson_rate * num_children


def _client_state_read(config: ExperimentConfig) -> bool:
    """Whether anything reads a client's saved state after training: its model (``eval.client_models``) or its
    round counter (``eval.local_only.rounds: matched``)."""
    local_only = config.eval.local_only
    return config.eval.client_models or (local_only is not None and local_only.rounds == "matched")


def _train_params(t: TrainSettings) -> TrainParams:
    return TrainParams(
        lr=t.lr,
        epochs=t.epochs,
        max_steps=t.max_steps,
        batch_size=t.batch_size,
        optimizer=t.optimizer,
        weight_decay=t.weight_decay,
        mu=t.mu,
        precision=t.precision,
        dp_sgd=DpSgdParams(t.dp_sgd.noise_multiplier, t.dp_sgd.max_grad_norm, t.dp_sgd.delta, t.dp_sgd.accountant)
        if t.dp_sgd
        else None,
    )


def build_tree(config: ExperimentConfig, clients: Sequence[ClientInfo]) -> Tree:
    """The tree for ``config`` over ``clients`` (settings resolved, residuals wired).

    Clients are grouped by their edge server; edge servers are ordered by their
    cluster's position in ``data.cluster_names()`` (languages in config order), then
    by first appearance. Node ids: clients keep theirs, edges are ``ClientInfo.edge``.
    """
    languages = config.data.source.languages
    clusters = config.data.cluster_names()
    kmeans = isinstance(config.data.clustering, KMeansClustering)
    by_language: dict[str, int] = {lang: 0 for lang in languages}
    edges: dict[str, tuple[str, list[ClientInfo]]] = {}  # edge id -> (cluster, clients)
    for c in clients:
        if c.language not in by_language:
            raise ConfigError(f"data: client {c.id!r} has language {c.language!r}, not in data.source.languages")
        by_language[c.language] += 1
        cluster, members = edges.setdefault(c.edge_id, (c.cluster_name, []))
        if c.cluster_name not in clusters:
            raise ConfigError(f"data: client {c.id!r} is in cluster {c.cluster_name!r}, not one of {clusters}")
        if cluster != c.cluster_name:
            raise ConfigError(
                f"data: edge server {c.edge_id!r} has clients in two clusters ({cluster!r}, {c.cluster_name!r})"
            )
        members.append(c)
    empty = [lang for lang, n in by_language.items() if not n]
    if empty:
        raise ConfigError(f"data.source.languages: languages {empty} have no clients")
    used = {cluster for cluster, _ in edges.values()}
    if kmeans and not config.tree.flat and len(used) < len(clusters):
        raise ConfigError(
            f"data.clustering.clusters: clusters {[c for c in clusters if c not in used]} have no clients"
        )
    order = sorted(edges, key=lambda e: clusters.index(edges[e][0]))  # stable: first appearance within a cluster

    specs = {g.name: g for g in config.tree.group_specs()}  # pre-order: a group before its sub-groups
    edge_parent = {lang: g.name for g in specs.values() if g.leaf for lang in g.members}
    nodes: dict[str, Node] = {}

    def add(
        node_id: str, role: Role, depth: int, parent: str | None, children: list[str], weight: float, group: str | None
    ) -> None:
        settings = _resolve(config, node_id, role, depth, len(children))
        nodes[node_id] = Node(node_id, role, depth, parent, tuple(children), settings, float(weight), group)

    edge_depth = {e: specs[edge_parent[c]].depth + 1 if c in edge_parent else 1 for e, (c, _) in edges.items()}
    servers = {} if config.tree.flat else {e: edge_depth[e] for e in order}
    _check_proxy_holders(config, {**servers, **{g.name: g.depth for g in specs.values()}, ROOT_ID: 0})
    if config.tree.flat:
        for c in clients:
            add(c.id, Role.CLIENT, 1, ROOT_ID, [], c.num_train, c.language)
        top = [c.id for c in clients]
        add(ROOT_ID, Role.ROOT, 0, None, top, sum(c.num_train for c in clients), None)
        return _finish(config, nodes)

    for edge in order:
        cluster, members = edges[edge]
        parent = edge_parent.get(cluster, ROOT_ID)
        depth_edge = edge_depth[edge]
        for c in members:
            add(c.id, Role.CLIENT, depth_edge + 1, edge, [], c.num_train, c.language)
        add(edge, Role.EDGE, depth_edge, parent, [c.id for c in members], sum(c.num_train for c in members), cluster)

    def add_group(name: str) -> None:  # sub-groups first: a node's weight sums its children's
        group = specs[name]
        if group.leaf:
            children = [e for lang in group.members for e in order if edges[e][0] == lang]
        else:
            for sub in group.members:
                add_group(sub)
            children = list(group.members)
        add(name, Role.SERVER, group.depth, group.parent, children, sum(nodes[c].weight for c in children), name)

    top = [g.name for g in specs.values() if g.depth == 1]
    for name in top:
        add_group(name)
    top = top or order
    add(ROOT_ID, Role.ROOT, 0, None, top, sum(nodes[c].weight for c in top), None)
    return _finish(config, nodes)


def _finish(config: ExperimentConfig, nodes: dict[str, Node]) -> Tree:
    """Check node-name references and mode-specific keys, wire residual links and compressed uplinks, check that
    FedNova's children start from what they are sent, mark LoRA's product-space steps, plan DP budgets, freeze the
    tree."""
    _check_names(config, nodes)
    check_mode_keys(config, nodes.values())
    tree = wire_residuals(config, Tree(nodes=_wire_uplinks(nodes), root_id=ROOT_ID))
    check_step_normalised_starts(config, tree)
    return plan_privacy(product_steps(config, tree))


def _wire_uplinks(nodes: dict[str, Node]) -> dict[str, Node]:
    """Each child of a compressing server gets the server's ``aggregate.compress`` as its ``uplink``.

    The child compresses (it holds the update and its error-feedback residual); the
    setting is its parent's, so one server's key covers every edge into it.
    """
    wired = dict(nodes)
    for node in nodes.values():
        compress = node.settings.aggregate.compress
        for child in node.children if compress is not None else ():
            wired[child] = replace(nodes[child], settings=replace(nodes[child].settings, uplink=compress))
    return wired


def _servers_hint(nodes: dict[str, Node]) -> str:
    servers = ", ".join(n for n, node in nodes.items() if not node.is_leaf)
    return f"servers: {servers}; clients: <language>-NN"


def _check_names(config: ExperimentConfig, nodes: dict[str, Node]) -> None:
    unknown = sorted(set(config.tree.nodes) - set(nodes))
    if unknown:
        raise ConfigError(f"tree.nodes.{unknown[0]}: no such node ({_servers_hint(nodes)})")


def _check_proxy_holders(config: ExperimentConfig, servers: dict[str, int]) -> None:
    """Every ``data.proxy.servers`` entry names a server, a server level or a depth with servers (``servers``: id ->
    depth). Checked before any node's settings, so a misnamed holder is told as such, not as the node whose
    ``proxy_train`` then finds no proxy split."""
    for i, name in enumerate(config.data.proxy.servers):
        if name in ("root", "server", "edge"):
            continue
        if name.startswith(DEPTH_SELECTOR):
            if name[len(DEPTH_SELECTOR) :] not in {str(d) for d in servers.values()}:
                depths = sorted(set(servers.values()))
                raise ConfigError(f"data.proxy.servers[{i}]: {name!r}: no server at that depth (servers: {depths})")
            continue
        if name not in servers:
            raise ConfigError(
                f"data.proxy.servers[{i}]: {name!r} is not a server, a level (root, server, edge) "
                f"or a depth (depth:N); servers: {', '.join(servers)}; clients: <language>-NN"
            )
