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
a level (``root``, ``server``, ``edge``, ``client``) or a depth (``depth:2``, root = 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from bhfl_core.algorithm.aggregation_rule import AggregateParams
from bhfl_core.algorithm.asynchrony import AsyncParams, StalenessParams
from bhfl_core.algorithm.compression import CompressParams
from bhfl_core.algorithm.node_opt import NodeOptParams, is_tuned
from bhfl_core.algorithm.privacy_params import AdaptiveClip, DpSgdParams, PrivacyParams, SecAggParams
from bhfl_core.algorithm.residuals import DownLink, UpLink
from bhfl_core.algorithm.tree import Node, NodeSettings, Role, TrainParams, Tree
from bhfl_core.config.base import ConfigError
from bhfl_core.config.data import KMeansClustering, LanguageClustering
from bhfl_core.config.schema import (
    AggregateSettings,
    ExperimentConfig,
    LevelSettings,
    NodeOverride,
    OptSettings,
    PrivacySettings,
    SecureAggregationSettings,
    TrainSettings,
)
from bhfl_core.rng import derive_seed

ROOT_ID = "root"
_LEVEL_KEY = {Role.ROOT: "root", Role.SERVER: "server", Role.EDGE: "edge", Role.CLIENT: "client"}
DEPTH_SELECTOR = "depth:"  # ``depth:2``: every node at depth 2 (root = 0)


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


def _selects(selector: str, node_id: str, role: Role, depth: int) -> bool:
    """Whether a selector (node id, level name, or ``depth:N``) names this node."""
    return (
        node_id == selector
        or _LEVEL_KEY[role] == selector
        or (selector.startswith(DEPTH_SELECTOR) and selector[len(DEPTH_SELECTOR) :] == str(depth))
    )


def _holds_proxy(config: ExperimentConfig, node_id: str, role: Role, depth: int) -> bool:
    proxy = config.data.proxy
    return proxy.train_per_language > 0 and any(_selects(s, node_id, role, depth) for s in proxy.servers)


def _resolve(config: ExperimentConfig, node_id: str, role: Role, depth: int, num_children: int) -> NodeSettings:
    """A node's settings: its level block, then ``tree.levels.<depth>`` (intermediate servers), ``tree.nodes``."""
    level_key = f"tree.{_LEVEL_KEY[role]}"
    level: LevelSettings = getattr(config.tree, _LEVEL_KEY[role])
    values = {key: getattr(level, key) for key in LevelSettings.model_fields}
    origin = {key: f"{level_key}.{key}" for key in values}
    layers = [(f"tree.nodes.{node_id}", config.tree.nodes.get(node_id, NodeOverride()))]
    if role is Role.SERVER and depth in config.tree.levels:
        layers.insert(0, (f"tree.levels.{depth}", config.tree.levels[depth]))
    for where, override in layers:
        for key in override.model_fields_set:  # keys written in YAML; `cohort: null` means "all children"
            if getattr(override, key) is None and key != "cohort":
                continue
            values[key] = getattr(override, key)
            origin[key] = f"{where}.{key}"

    cohort = values["cohort"]
    if role is Role.CLIENT:
        cohort = None
    elif isinstance(cohort, float):
        cohort = max(1, round(cohort * num_children))
    elif isinstance(cohort, int) and cohort > num_children:
        raise ConfigError(
            f"{origin['cohort']}: cohort of {cohort} is larger than the {num_children} children of node {node_id!r}"
        )

    has_data = role is Role.CLIENT or _holds_proxy(config, node_id, role, depth)
    train: TrainParams | None = None
    if role is Role.CLIENT or values["proxy_train"]:
        if not has_data:
            raise ConfigError(
                f"{origin['proxy_train']}: node {node_id!r} has no proxy split to train on "
                f"(data.proxy.servers is {config.data.proxy.servers}, "
                f"data.proxy.train_per_language is {config.data.proxy.train_per_language})"
            )
        train = _train_params(values["train"])
        _check_dp_sgd(values["train"], origin["train"], node_id, role)
    proxy_async = values["proxy_train"] == "async"
    if proxy_async and role is Role.CLIENT:
        raise ConfigError(f"{origin['proxy_train']}: 'async' proxy training is for servers; {node_id!r} is a client")
    asynchronous = None
    if values["mode"] == "async":
        if role is Role.CLIENT:
            raise ConfigError(f"{origin['mode']}: a client has no children; only servers run asynchronously")
        st = values["staleness"]
        asynchronous = AsyncParams(values["concurrency"], values["buffer"], StalenessParams(st.kind, st.a, st.b))
    personal = values["personal"]
    if personal is not None and role is not Role.CLIENT:
        raise ConfigError(f"{origin['personal']}: only clients keep a personal (Ditto) model; {node_id!r} is a server")

    def opt(direction: str) -> NodeOptParams:
        o = values[f"opt_{direction}"]
        if is_tuned(o.kind):
            _check_tuned(origin[f"opt_{direction}"], node_id, has_data, values["holdout"], origin["holdout"])
        return NodeOptParams(
            kind=o.kind,
            eta=values[f"eta_{direction}"],
            beta1=o.beta1,
            beta2=o.beta2,
            tau=o.tau,
            alphas=tuple(o.alphas),
        )

    return NodeSettings(
        rounds=values["rounds"],
        cohort=cohort,
        opt_up=opt("up"),
        opt_down=opt("down"),
        persistent=values["persistent"],
        train=train,
        proxy_async=proxy_async,
        holdout=values["holdout"],
        personal=_train_params(personal) if personal is not None else None,
        asynchronous=asynchronous,
        dropout=config.tree.clock.dropout_p if role is Role.CLIENT else 0.0,
        aggregate=AggregateParams(
            values["aggregate"].kind,
            _privacy(config, node_id, role, values, origin, cohort or num_children, num_children),
            _secagg(config, node_id, role, values, origin, cohort or num_children),
            _compress(node_id, role, values, origin),
        ),
        tempo=config.tree.client.train.epochs if config.tree.tempo and role is Role.ROOT else None,
        evaluated=role is not Role.CLIENT or _client_state_read(config),
    )


def _privacy(
    config: ExperimentConfig,
    node_id: str,
    role: Role,
    values: dict[str, object],
    origin: dict[str, str],
    expected: int,
    population: int,
) -> PrivacyParams | None:
    """A server's ``privacy`` settings resolved for its cohort (``expected`` of ``population`` children) and with its
    noise seed; errors name the key."""
    settings = values["privacy"]
    if settings is None:
        return None
    assert isinstance(settings, PrivacySettings)
    key = origin["privacy"]
    _check_server_fold(key, "client-level DP", node_id, role, values)
    adaptive = None
    if settings.adaptive is not None:
        a = settings.adaptive
        adaptive = AdaptiveClip(a.quantile, a.lr, a.count_noise if a.count_noise is not None else expected / 20)
    params = PrivacyParams(
        clip=settings.clip,
        noise_multiplier=settings.noise_multiplier,
        expected=expected,
        population=population,
        noise_seed=derive_seed(config.seed, "privacy", node_id),
        delta=settings.delta,
        adaptive=adaptive,
    )
    try:
        params.update_noise_multiplier  # noqa: B018  (validates the split of the budget)
    except ValueError as exc:
        raise ConfigError(f"{key}.adaptive.count_noise: {exc}") from None
    return params


def _compress(node_id: str, role: Role, values: dict[str, object], origin: dict[str, str]) -> CompressParams | None:
    """A server's ``aggregate.compress`` (what its children send it); a client has no children to compress."""
    aggregate = values["aggregate"]
    assert isinstance(aggregate, AggregateSettings)
    settings = aggregate.compress
    if settings is None:
        return None
    if role is Role.CLIENT:
        raise ConfigError(
            f"{origin['aggregate']}.compress: compression is set where updates are received (the parent); "
            f"{node_id!r} is a client and has no children"
        )
    return CompressParams(settings.kind, settings.fraction, settings.block, settings.error_feedback)


def _check_server_fold(key: str, what: str, node_id: str, role: Role, values: dict[str, object]) -> None:
    """DP and secure aggregation change how a server folds a round's cohort of children: not for clients, for
    asynchronous servers (no cohort: children arrive one by one) or for a proxy TRAIN folded like a child."""
    if role is Role.CLIENT:
        raise ConfigError(f"{key}: {what} is a server's (it folds its children's updates); {node_id!r} is a client")
    if values["mode"] == "async":
        raise ConfigError(f"{key}: {what} at an asynchronous server is not supported yet ({node_id!r} has mode: async)")
    if values["proxy_train"] == "async":
        raise ConfigError(
            f"{key}: {node_id!r} trains on its proxy split alongside its children (proxy_train: async), which "
            f"{what} would fold as one of them; use proxy_train: true (after aggregating) or false"
        )


def _secagg(
    config: ExperimentConfig, node_id: str, role: Role, values: dict[str, object], origin: dict[str, str], cohort: int
) -> SecAggParams | None:
    """A server's ``secure_aggregation`` settings resolved (threshold, mask seed); errors name the key."""
    settings = values["secure_aggregation"]
    if settings is None:
        return None
    assert isinstance(settings, SecureAggregationSettings)
    key = origin["secure_aggregation"]
    _check_server_fold(key, "secure aggregation", node_id, role, values)
    if settings.fraction_bits >= settings.bits - 1:
        raise ConfigError(
            f"{key}.fraction_bits: {settings.fraction_bits} leaves no integer part in {settings.bits} bits"
        )
    privacy = values["privacy"]
    if isinstance(privacy, PrivacySettings) and privacy.adaptive is not None:
        raise ConfigError(
            f"{key}: adaptive clipping with secure aggregation is not supported yet (the unclipped count would need "
            f"its own masked sum); set a fixed {origin['privacy']}.clip without adaptive"
        )
    threshold = settings.threshold if settings.threshold is not None else cohort // 2 + 1
    if threshold > cohort:
        raise ConfigError(f"{key}.threshold: {threshold} is more than the {cohort} children {node_id!r} calls a round")
    return SecAggParams(threshold, derive_seed(config.seed, "secagg", node_id), settings.bits, settings.fraction_bits)


def _check_dp_sgd(train: TrainSettings, key: str, node_id: str, role: Role) -> None:
    """DP-SGD protects a client's examples; what it cannot be combined with is rejected here."""
    if train.dp_sgd is None:
        return
    if role is not Role.CLIENT:
        raise ConfigError(
            f"{key}.dp_sgd: sample-level DP-SGD protects clients' private examples; {node_id!r} trains on the proxy "
            "split (use privacy: at a server for client-level DP)"
        )
    if train.mu > 0:
        raise ConfigError(
            f"{key}.dp_sgd: FedProx's term (mu: {train.mu}) would be overwritten by the DP optimizer; set mu: 0"
        )
    if train.precision != "fp32":
        raise ConfigError(f"{key}.dp_sgd: DP-SGD runs in fp32 only (precision is {train.precision!r})")


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
        dp_sgd=DpSgdParams(t.dp_sgd.noise_multiplier, t.dp_sgd.max_grad_norm, t.dp_sgd.delta) if t.dp_sgd else None,
    )


def _check_tuned(key: str, node_id: str, has_data: bool, holdout: float, holdout_key: str) -> None:
    """A tuned NODEOPT (``interp``) needs held-out rows at its node: its own data and ``holdout > 0``."""
    if not has_data:
        raise ConfigError(
            f"{key}: NODEOPT interp tunes alpha on the node's held-out data, but {node_id!r} has none "
            "(clients have their private split; servers need a proxy split: data.proxy.servers)"
        )
    if holdout <= 0:
        raise ConfigError(
            f"{key}: NODEOPT interp tunes alpha on held-out rows of {node_id!r}'s training data; "
            f"set {holdout_key} (e.g. 0.2, the share of rows kept out of TRAIN)"
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

    if config.tree.flat:
        for c in clients:
            add(c.id, Role.CLIENT, 1, ROOT_ID, [], c.num_train, c.language)
        top = [c.id for c in clients]
        add(ROOT_ID, Role.ROOT, 0, None, top, sum(c.num_train for c in clients), None)
        return _finish(config, nodes)

    for edge in order:
        cluster, members = edges[edge]
        parent = edge_parent.get(cluster, ROOT_ID)
        depth_edge = specs[parent].depth + 1 if parent in specs else 1
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
    """Check node-name references, wire residual links and compressed uplinks, freeze the tree."""
    _check_names(config, nodes)
    tree = Tree(nodes=_wire_uplinks(nodes), root_id=ROOT_ID)
    return _wire_residuals(config, tree)


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
    for i, name in enumerate(config.data.proxy.servers):
        if name in ("root", "server", "edge"):
            continue
        if name.startswith(DEPTH_SELECTOR):
            if not any(_matches(name, n) for n in nodes.values() if not n.is_leaf):
                depths = sorted({n.depth for n in nodes.values() if not n.is_leaf})
                raise ConfigError(f"data.proxy.servers[{i}]: {name!r}: no server at that depth (servers: {depths})")
            continue
        if name not in nodes or nodes[name].is_leaf:
            raise ConfigError(
                f"data.proxy.servers[{i}]: {name!r} is not a server, a level (root, server, edge) "
                f"or a depth (depth:N); {_servers_hint(nodes)}"
            )


def _matches(selector: str, node: Node) -> bool:
    return _selects(selector, node.id, node.role, node.depth)


def _lookup(tree: Tree, selector: str, key: str) -> list[Node]:
    found = [n for n in tree if _matches(selector, n)]
    if not found:
        raise ConfigError(
            f"{key}: {selector!r} matches no node (a level: root, server, edge, client; a depth: depth:N; or a node id)"
        )
    return found


def _receiver_opt(
    config: ExperimentConfig, node: Node, direction: str, opt: OptSettings | None, eta: float | None, key: str
) -> NodeOptParams:
    """A residual kind's optimiser at ``node``: the rule's settings over the node's own for that direction."""
    own: NodeOptParams = getattr(node.settings, f"opt_{direction}")
    if opt is None:
        return replace(own, eta=own.eta if eta is None else eta)
    if is_tuned(opt.kind):
        has_data = node.is_leaf or _holds_proxy(config, node.id, node.role, node.depth)
        _check_tuned(key, node.id, has_data, node.settings.holdout, f"tree.nodes.{node.id}.holdout")
    return NodeOptParams(
        kind=opt.kind,
        eta=own.eta if eta is None else eta,
        beta1=opt.beta1,
        beta2=opt.beta2,
        tau=opt.tau,
        alphas=tuple(opt.alphas),
    )


def _check_private_path(tree: Tree, source: str, target: str, key: str) -> None:
    """An up-residual must not carry children's models past a DP server's noise or a secure aggregation's masks."""
    path = [source, *tree.ancestors(source)]
    for node_id in path[: path.index(target)]:
        aggregate = tree[node_id].settings.aggregate
        via = "" if node_id == source else f" through {node_id!r}"
        if aggregate.secagg is not None:
            raise ConfigError(
                f"{key}: {source!r} would send its children's models to {target!r}{via} in the clear, past the "
                f"secure aggregation of {node_id!r}, where only their masked sum may be seen: drop the residual"
            )
        if aggregate.privacy is not None:
            raise ConfigError(
                f"{key}: {source!r} would send its children's models to {target!r}{via} unclipped and un-noised, "
                f"past the differential privacy of {node_id!r} (its privacy: settings); residuals cannot skip a DP "
                "server: drop the residual, or move the privacy settings above the residual's target"
            )


def _wire_residuals(config: ExperimentConfig, tree: Tree) -> Tree:
    """Resolve ``tree.residuals`` into per-node links (senders) and optimiser kinds (receivers)."""
    sends_up: dict[str, list[UpLink]] = {}
    sends_down: dict[str, list[DownLink]] = {}
    receives: dict[str, list[tuple[str, NodeOptParams]]] = {}

    for i, rule in enumerate(config.tree.residuals.up):
        key = f"tree.residuals.up[{i}]"
        _lookup(tree, rule.to, f"{key}.to")
        for src in _lookup(tree, rule.source, f"{key}.from"):
            if src.is_leaf:
                raise ConfigError(
                    f"{key}.from: {src.id!r} is a client; up-residuals are selected by a server among its children"
                )
            if rule.select == "loss" and not all(c.is_leaf for c in tree.children(src.id)):
                raise ConfigError(
                    f"{key}.select: 'loss' ranks clients by training loss, but the children of {src.id!r} are servers"
                )
            targets = [a for a in tree.ancestors(src.id) if _matches(rule.to, tree[a])]
            if not targets:
                raise ConfigError(
                    f"{key}.to: {rule.to!r} is not an ancestor of {src.id!r}; up-residuals go to ancestors"
                )
            for target in targets:
                _check_private_path(tree, src.id, target, key)
                link = UpLink(i, target, rule.k, rule.select, rule.combine)
                sends_up.setdefault(src.id, []).append(link)
                receives.setdefault(target, []).append(
                    (link.key, _receiver_opt(config, tree[target], "up", rule.opt, rule.eta, f"{key}.opt"))
                )

    for i, down in enumerate(config.tree.residuals.down):
        key = f"tree.residuals.down[{i}]"
        _lookup(tree, down.to, f"{key}.to")
        for src in _lookup(tree, down.source, f"{key}.from"):
            below = [n for n in tree if src.id in tree.ancestors(n.id)]
            receivers = [n for n in below if _matches(down.to, n)]
            if not receivers:
                raise ConfigError(
                    f"{key}.to: {down.to!r} is not a descendant of {src.id!r}; down-residuals go to descendants"
                )
            for receiver in receivers:
                down_link = DownLink(i, receiver.id)
                sends_down.setdefault(src.id, []).append(down_link)
                receives.setdefault(receiver.id, []).append(
                    (down_link.key, _receiver_opt(config, receiver, "down", down.opt, down.eta, f"{key}.opt"))
                )

    if not (sends_up or sends_down):
        return tree
    nodes = {
        node_id: replace(
            node,
            settings=replace(
                node.settings,
                res_up=tuple(sends_up.get(node_id, ())),
                res_down=tuple(sends_down.get(node_id, ())),
                res_in=tuple(dict(receives.get(node_id, ())).items()),
            ),
        )
        for node_id, node in tree.nodes.items()
    }
    return Tree(nodes=nodes, root_id=tree.root_id)
