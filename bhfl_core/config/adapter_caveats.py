"""Where ``model.adapter.aggregation: exact`` stops being exact: the warnings a run starts with.

Kept apart from adapter_settings.py, which the tree's resolution imports: these walk a
resolved tree (``build_tree``).
"""

from __future__ import annotations

from bhfl_core.algorithm.adapter_mix import linear
from bhfl_core.algorithm.tree import Role, Tree
from bhfl_core.config.layering import layered
from bhfl_core.config.schema import ExperimentConfig
from bhfl_core.config.topology import build_tree, placeholder_clients


def exact_caveats(config: ExperimentConfig) -> list[str]:
    """Under ``aggregation: exact``, a warning per key whose step still combines models' A and B factor by factor.

    The servers' folds and the steps linear in the models (FedAvg at any ``eta_down`` /
    ``eta_up``, residual folding) combine products (``adapter_rule.py``,
    ``adapter_mix.py``). What stays on the factors, which come from different SVDs (a
    node's from its own fold, its parent's from the parent's), so that their product is
    not the same combination of the products: an ``opt_down``/``opt_up`` other than
    FedAvg (its momentum and second moments are kept per factor coordinate; in product
    space they would be fan_out x fan_in a matrix), Ditto's pull, an error-feedback
    residual, a residual folded by such an optimiser, and a residual accumulator that
    averages several models (an up-residual's selected children, senders and rounds; a
    down-residual's rounds a receiver missed). Warned, not refused: such runs train, but
    the user who chose ``exact`` for its exactness should know where it stops. One line
    per key written, whatever the number of nodes reading it (the tree of
    ``placeholder_clients``: the settings do not depend on the data).
    """
    if config.model.adapter is None or config.model.adapter.aggregation != "exact":
        return []
    steps: dict[str, str] = {}
    tree = build_tree(config, placeholder_clients(config))
    for node in tree:
        _, origin = layered(config, node.id, node.role, node.depth)
        settings = node.settings
        if node.role is not Role.ROOT and settings.persistent and not linear(settings.opt_down):
            kind = settings.opt_down.kind
            steps.setdefault(origin["opt_down"], f"steps a node's own A and B towards its parent's with {kind}")
        if node.children:
            if not linear(settings.opt_up):
                kind = settings.opt_up.kind
                steps.setdefault(origin["opt_up"], f"steps a server's A and B towards its fold's pair with {kind}")
            compress = settings.aggregate.compress
            if compress is not None and compress.error_feedback:
                steps.setdefault(
                    origin["aggregate"], "its compress wrapper's error feedback carries a child's A and B residual"
                )
        if settings.personal is not None:
            steps.setdefault(origin["personal"], "pulls a client's personal A and B towards its federated ones")
        for kind, params in settings.res_in:
            if not linear(params):
                direction = "up" if kind.startswith("up") else "down"  # the accumulator keys: up<rule>, down<rule>
                key = f"tree.residuals.{direction}[{kind.removeprefix(direction)}]"
                steps.setdefault(key, f"folds a residual's A and B with {params.kind}")
        for link in settings.res_down:
            if not _always_called(tree, node.id, link.target):
                steps.setdefault(
                    f"tree.residuals.down[{link.rule}]",
                    "averages the models of the rounds a receiver missed (a cohort, Poisson sampling, dropout or "
                    "an asynchronous server on its way) in its accumulator",
                )
    for i, _ in enumerate(config.tree.residuals.up):
        steps.setdefault(
            f"tree.residuals.up[{i}]", "averages the children's models it selects (over senders and rounds)"
        )
    return [
        f"{key}: {what}, factor by factor; under model.adapter.aggregation: exact those factors come from different "
        "SVDs, so their product is not the same combination of the products; exact are the servers' folds and the "
        "linear steps, FedAvg's eta_down and eta_up and residual folding, which combine products (docs/algorithm.md)"
        for key, what in steps.items()
    ]


def _always_called(tree: Tree, sender: str, receiver: str) -> bool:
    """Whether every round of ``sender`` executes ``receiver`` (its down-residual accumulator then holds one model):
    no cohort, Poisson draw, asynchronous server or client dropout between them."""
    node = tree[receiver]
    while node.id != sender and node.parent is not None:
        parent = tree[node.parent]
        s = parent.settings
        sampled = (s.cohort is not None and s.cohort < len(parent.children)) or s.poisson_rate is not None
        if sampled or s.asynchronous is not None or node.settings.dropout > 0:
            return False
        node = parent
    return True
