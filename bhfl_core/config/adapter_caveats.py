"""Where ``model.adapter.aggregation: exact`` stops being exact: the warnings a run starts with.

Kept apart from adapter_settings.py, which the tree's resolution imports: these walk a
resolved tree (``build_tree``).
"""

from __future__ import annotations

from bhfl_core.algorithm.tree import Role
from bhfl_core.config.layering import layered
from bhfl_core.config.schema import ExperimentConfig
from bhfl_core.config.topology import build_tree, placeholder_clients


def exact_caveats(config: ExperimentConfig) -> list[str]:
    """Under ``aggregation: exact``, a warning per key whose step combines two models' A and B factor by factor.

    Only a server's fold of its children is exact (docs/algorithm.md): a node's factors
    and its parent's come from different SVDs, so a down step other than adoption, an up
    step other than adopting the fold, residuals, Ditto's pull and an error-feedback
    residual each combine factorisations whose product is not the same combination of
    the products. Warned, not refused: such runs train (``benchmarks/lora_experiment.py``
    runs ``exact`` on ``configs/bhfl-lora.yaml``'s ``eta_down``), but the user who chose
    ``exact`` for its exactness should know where it stops. One line per key written,
    whatever the number of nodes reading it (the tree of ``placeholder_clients``: the
    settings do not depend on the data).
    """
    if config.model.adapter is None or config.model.adapter.aggregation != "exact":
        return []
    steps: dict[str, str] = {}
    for node in build_tree(config, placeholder_clients(config)):
        values, origin = layered(config, node.id, node.role, node.depth)
        settings = node.settings
        if node.role is not Role.ROOT and settings.persistent:
            if values["eta_down"] != 1.0:
                steps.setdefault(origin["eta_down"], "mixes a node's own A and B with its parent's")
            if values["opt_down"].kind != "fedavg":
                steps.setdefault(origin["opt_down"], "steps a node's own A and B towards its parent's")
        if node.children:
            if values["eta_up"] != 1.0:
                steps.setdefault(origin["eta_up"], "mixes a server's A and B with its fold's re-factorised pair")
            if values["opt_up"].kind != "fedavg":
                steps.setdefault(origin["opt_up"], "steps a server's A and B towards its fold's re-factorised pair")
            compress = settings.aggregate.compress
            if compress is not None and compress.error_feedback:
                steps.setdefault(
                    origin["aggregate"], "its compress wrapper's error feedback carries a child's A and B residual"
                )
        if settings.personal is not None:
            steps.setdefault(origin["personal"], "pulls a client's personal A and B towards its federated ones")
    for direction in ("up", "down"):
        if getattr(config.tree.residuals, direction):
            steps[f"tree.residuals.{direction}"] = "folds a residual's A and B into another node's"
    return [
        f"{key}: {what} factor by factor; under model.adapter.aggregation: exact the two come from different SVDs, "
        "so the product is not the same combination of their products (38% off at eta_down 0.3 on synthetic "
        "adapters); only the servers' folds of their children are exact (docs/algorithm.md)"
        for key, what in steps.items()
    ]
