"""Where a LoRA run's servers fold their children's products (``model.adapter``: ``aggregation``, ``error_metric``),
the nodes' own ranks (``adapter_rank``), FedSA's clients' own B and the nodes whose linear steps ``exact`` takes in
product space.

``exact`` and the ab-mean error need every child's model at the fold: the ``adapter``
wrapper (bhfl_core/algorithm/adapter_rule.py) sits directly around ``kind: mean`` in
synchronous rounds. Elsewhere ``exact`` is an error naming the key: a robust ``kind``
outvotes children coordinate by coordinate (it has no mean product to re-factorise),
``dp`` and ``secagg`` let the server see only a clipped-and-noised or masked sum (no
child's product), and an asynchronous server folds stale-weighted buffers. The
error metric is simply not logged there. ``ffa`` needs no wrapper (A is frozen and the
same everywhere: any rule's mean of B is the mean product).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from bhfl_core.algorithm.adapter_fold import AdapterFold, OwnB, ProductSteps, RankCap
from bhfl_core.algorithm.adapter_mix import mixes_models
from bhfl_core.algorithm.tree import Role, Tree
from bhfl_core.config.base import ConfigError
from bhfl_core.config.schema import ExperimentConfig


def adapter_fold(
    config: ExperimentConfig,
    kind: str,
    wrapped: dict[str, str],
    node_id: str,
    role: Role,
    values: dict[str, Any],
    origin: dict[str, str],
) -> AdapterFold | None:
    """The server's ``adapter`` wrapper (layout still empty: ``with_adapter_layout``), or None where it has none.

    ``wrapped``: the node's wrappers by name, with the key that set each.
    """
    adapter = config.model.adapter
    if adapter is None or role is Role.CLIENT or not (adapter.aggregation == "exact" or adapter.error_metric):
        return None
    reason = None
    if kind != "mean":
        reason = f"{origin['aggregate']}.kind is {kind}, which folds coordinate by coordinate, not a mean product"
    elif "dp" in wrapped or "secagg" in wrapped:
        key = wrapped.get("dp", wrapped.get("secagg"))
        reason = f"{key} lets it see only the clipped-and-noised or masked sum, never a child's product"
    elif values["mode"] == "async":
        reason = f"{origin['mode']} is async (it folds stale-weighted buffers, not a round's products)"
    if reason is None:
        return AdapterFold(adapter.aggregation if adapter.aggregation == "exact" else "ab-mean")
    if adapter.aggregation == "exact":
        raise ConfigError(
            f"model.adapter.aggregation: exact re-factorises the mean of the children's products s·B_i·A_i, "
            f"but at {node_id!r} {reason}; use aggregation: ab-mean or ffa there (ffa's fold is linear in B: "
            "exact under dp, secagg and any rule linear in the models)"
        )
    return None  # ab-mean's error metric: logged where the fold sees the children's models


def rank_cap(config: ExperimentConfig, rank: int | None, key: str) -> RankCap | None:
    """A node's ``adapter_rank`` (written at ``key``): at most ``model.adapter.r``, the rank every vector keeps."""
    if rank is None:
        return None
    adapter = config.model.adapter
    if adapter is None:
        raise ConfigError(f"{key}: a LoRA rank needs LoRA adapters (model.adapter)")
    if rank > adapter.r:
        raise ConfigError(
            f"{key}: {rank} is above model.adapter.r ({adapter.r}), the rank of the vector every node keeps; "
            "raise model.adapter.r to the largest rank in the tree"
        )
    if adapter.aggregation == "ffa":
        raise ConfigError(
            f"{key}: with model.adapter.aggregation: ffa the A matrices are frozen and not federated, so a rank "
            "cannot be cut from them; use ab-mean or exact with per-node ranks"
        )
    if adapter.init_lora_weights in ("pissa", "olora"):
        raise ConfigError(
            f"{key}: with model.adapter.init_lora_weights: {adapter.init_lora_weights} the adapters start as the "
            "principal part of each adapted weight, taken out of the frozen one (W - s·B·A), so cutting A's rows "
            f"and B's columns from {rank} on would remove that part of the pretrained weights, not train a smaller "
            "adapter; use init_lora_weights: true or gaussian with per-node ranks"
        )
    return RankCap(rank)


def own_b(config: ExperimentConfig, role: Role) -> OwnB | None:
    """A client's FedSA part (``aggregation: fedsa``): its B matrices, kept from its own saved model."""
    adapter = config.model.adapter
    return OwnB() if adapter is not None and adapter.aggregation == "fedsa" and role is Role.CLIENT else None


def product_steps(config: ExperimentConfig, tree: Tree) -> Tree:
    """``tree`` with ``ProductSteps`` (layout still empty) at each node whose linear steps combine two models'
    adapters under ``aggregation: exact`` (``adapter_mix.mixes_models``: FedAvg at an eta other than 1, residuals);
    as it is otherwise. After the residuals are wired: a node's residual inputs are one such step."""
    adapter = config.model.adapter
    if adapter is None or adapter.aggregation != "exact":
        return tree
    nodes = {
        node_id: replace(node, settings=replace(node.settings, products=ProductSteps()))
        if mixes_models(node.settings, node.is_leaf)
        else node
        for node_id, node in tree.nodes.items()
    }
    return replace(tree, nodes=nodes)
