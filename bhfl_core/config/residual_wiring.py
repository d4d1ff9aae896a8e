"""Residual rules (``tree.residuals``) resolved into per-node links and the receivers' optimisers.

A rule's ``from`` / ``to`` are selectors (``selectors.py``). Each sender gets an
``UpLink`` / ``DownLink`` per receiver; each receiver gets, per link, the optimiser it
folds that input with (the rule's ``opt`` / ``eta`` over its own). An up-residual that
would carry children's models past a DP server's noise or a secure aggregation's masks
is rejected, and so is one that would carry them past or into a robust rule.
"""

from __future__ import annotations

from dataclasses import replace

from bhfl_core.algorithm.node_opt import NodeOptParams, is_tuned
from bhfl_core.algorithm.residuals import DownLink, UpLink
from bhfl_core.algorithm.rules import rule_traits
from bhfl_core.algorithm.tree import Node, Tree
from bhfl_core.config.aggregation_settings import check_tuned
from bhfl_core.config.base import ConfigError
from bhfl_core.config.schema import ExperimentConfig
from bhfl_core.config.selectors import holds_proxy, lookup, matches
from bhfl_core.config.tree_schema import OptSettings


def _receiver_opt(
    config: ExperimentConfig, node: Node, direction: str, opt: OptSettings | None, eta: float | None, key: str
) -> NodeOptParams:
    """A residual kind's optimiser at ``node``: the rule's settings over the node's own for that direction."""
    own: NodeOptParams = getattr(node.settings, f"opt_{direction}")
    if eta is not None and eta != 1.0 and is_tuned(opt.kind if opt is not None else own.kind):
        raise ConfigError(
            f"{key[: -len('.opt')]}.eta: {eta} would not be read: the residual is folded at {node.id!r} by interp, "
            "which picks its own mixing weight (alpha) from its grid; drop the eta"
        )
    if opt is None:
        return replace(own, eta=own.eta if eta is None else eta)
    if is_tuned(opt.kind):
        has_data = node.is_leaf or holds_proxy(config, node.id, node.role, node.depth)
        check_tuned(key, node.id, has_data, node.settings.holdout, f"tree.nodes.{node.id}.holdout")
        train = node.settings.train
        if train is not None and train.dp_sgd is not None:
            raise ConfigError(
                f"{key}: interp at {node.id!r} would pick its model by its loss on held-out rows that no DP-SGD step "
                "protects (the client trains with dp_sgd); use a NODEOPT that is not tuned"
            )
    return NodeOptParams(
        kind=opt.kind,
        eta=own.eta if eta is None else eta,
        beta1=opt.beta1,
        beta2=opt.beta2,
        tau=opt.tau,
        alphas=tuple(opt.alphas),
    )


def _check_robust_path(tree: Tree, source: str, target: str, key: str) -> None:
    """An up-residual must not carry children's models past a robust rule (median, trimmed mean, Krum), nor into
    one: the models it selects (by default the largest updates, an attacker's first) would skip that rule."""
    path = [source, *tree.ancestors(source)]
    for node_id in path[: path.index(target) + 1]:
        kind = tree[node_id].settings.aggregate.kind
        if rule_traits(kind).robust:
            where = "from" if node_id == source else ("into" if node_id == target else "through")
            raise ConfigError(
                f"{key}: {source!r} would send its children's models to {target!r}, {where} {node_id!r} whose "
                f"aggregate.kind {kind} exists to outvote or cut outlying children: the residuals would reach a "
                "model unfiltered; drop the residual, or use a non-robust aggregate.kind there"
            )


def _check_private_path(tree: Tree, source: str, target: str, key: str) -> None:
    """An up-residual must not carry children's models past a DP server's noise or a secure aggregation's masks,
    nor into such a server: it would be folded into the model that server publishes, unclipped and un-noised."""
    path = [source, *tree.ancestors(source)]
    for node_id in path[: path.index(target) + 1]:
        aggregate = tree[node_id].settings.aggregate
        via = "" if node_id in (source, target) else f" through {node_id!r}"
        into = node_id == target
        if aggregate.secagg is not None:
            where = (
                f"into {node_id!r}, whose secure aggregation may see"
                if into
                else (f"in the clear, past the secure aggregation of {node_id!r}, where")
            )
            raise ConfigError(
                f"{key}: {source!r} would send its children's models to {target!r}{via} {where} only their masked "
                "sum: drop the residual"
            )
        if aggregate.privacy is not None:
            where = "into the differential privacy of" if into else "past the differential privacy of"
            raise ConfigError(
                f"{key}: {source!r} would send its children's models to {target!r}{via} unclipped and un-noised, "
                f"{where} {node_id!r} (its dp wrapper, privacy:); residuals cannot skip or enter a DP server's "
                "noise: drop the residual, or move the privacy settings above the residual's target"
            )


def wire_residuals(config: ExperimentConfig, tree: Tree) -> Tree:
    """Resolve ``tree.residuals`` into per-node links (senders) and optimiser kinds (receivers)."""
    sends_up: dict[str, list[UpLink]] = {}
    sends_down: dict[str, list[DownLink]] = {}
    receives: dict[str, list[tuple[str, NodeOptParams]]] = {}

    for i, rule in enumerate(config.tree.residuals.up):
        key = f"tree.residuals.up[{i}]"
        lookup(tree, rule.to, f"{key}.to")
        for src in lookup(tree, rule.source, f"{key}.from"):
            if src.is_leaf:
                raise ConfigError(
                    f"{key}.from: {src.id!r} is a client; up-residuals are selected by a server among its children"
                )
            if rule.k > len(src.children):  # as a cohort larger than the children: a count no round can reach
                raise ConfigError(
                    f"{key}.k: {rule.k} models a round is more than the {len(src.children)} children of {src.id!r}; "
                    "k counts the children's models selected in each of its rounds (at most its cohort)"
                )
            if rule.select == "loss" and not all(c.is_leaf for c in tree.children(src.id)):
                raise ConfigError(
                    f"{key}.select: 'loss' ranks clients by training loss, but the children of {src.id!r} are servers"
                )
            private = next((c.id for c in tree.children(src.id) if not c.settings.reports_loss), None)
            if rule.select == "loss" and private is not None:
                raise ConfigError(
                    f"{key}.select: 'loss' would pick which of {src.id!r}'s clients' models go up by their training "
                    f"loss, computed un-noised from the examples the DP-SGD of {private!r} protects; use select: l2 "
                    "or cosine (they rank the models it sends)"
                )
            targets = [a for a in tree.ancestors(src.id) if matches(rule.to, tree[a])]
            if not targets:
                raise ConfigError(
                    f"{key}.to: {rule.to!r} is not an ancestor of {src.id!r}; up-residuals go to ancestors"
                )
            for target in targets:
                _check_private_path(tree, src.id, target, key)
                _check_robust_path(tree, src.id, target, key)
                link = UpLink(i, target, rule.k, rule.select, rule.combine)
                sends_up.setdefault(src.id, []).append(link)
                receives.setdefault(target, []).append(
                    (link.key, _receiver_opt(config, tree[target], "up", rule.opt, rule.eta, f"{key}.opt"))
                )

    for i, down in enumerate(config.tree.residuals.down):
        key = f"tree.residuals.down[{i}]"
        lookup(tree, down.to, f"{key}.to")
        for src in lookup(tree, down.source, f"{key}.from"):
            below = [n for n in tree if src.id in tree.ancestors(n.id)]
            receivers = [n for n in below if matches(down.to, n)]
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
