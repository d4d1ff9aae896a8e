"""The A and B matrices of a built LoRA model, located in its flat vector (``algorithm/adapter_fold.py``)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from bhfl_core.algorithm.adapter_fold import AdapterBlock
from bhfl_core.algorithm.tree import Tree
from bhfl_core.learning.params import trainable_parameters

if TYPE_CHECKING:
    from torch import nn


def adapter_layout(model: nn.Module) -> tuple[tuple[AdapterBlock, ...], int]:
    """Each adapted layer (linear or embedding) whose A and B are both trained, in model order, and the flat
    vector's length.

    Offsets follow ``params.get_flat`` (trainable parameters in ``model.parameters()``
    order). A layer whose A is frozen (``aggregation: ffa``) has no block: nothing of it
    needs more than the mean.
    """
    from peft.tuners.lora import LoraLayer

    offsets, size = {}, 0
    for p in trainable_parameters(model):
        offsets[id(p)] = size
        size += p.numel()
    blocks = []
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer) or (pair := _factors(layer)) is None:
            continue
        a, b = pair
        if id(a) in offsets and id(b) in offsets and a.dim() == 2 and b.dim() == 2:
            scaling = float(layer.scaling["default"])
            rank, fan_in, fan_out = int(a.shape[0]), int(a.shape[1]), int(b.shape[0])
            blocks.append(AdapterBlock(name, offsets[id(a)], offsets[id(b)], rank, fan_in, fan_out, scaling))
    return tuple(blocks), size


def _factors(layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:  # a peft LoraLayer (untyped attributes)
    """A layer's (A, B): ``r x fan_in`` and ``fan_out x r``, its update ``s·B·A`` (up to a transpose).

    A linear layer keeps them as ``lora_A``/``lora_B`` modules; an adapted embedding
    (``target_modules: [word_embeddings]``) as the parameters ``lora_embedding_A``
    (``r x num_embeddings``) and ``lora_embedding_B`` (``dim x r``), whose update peft adds
    as ``(B·A)^T``: the same product, so it is folded, capped and kept (FedSA) like a
    linear layer's, not left to the plain mean of A and B.
    """
    if "default" in layer.lora_A:
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    elif "default" in getattr(layer, "lora_embedding_A", {}):
        a, b = layer.lora_embedding_A["default"], layer.lora_embedding_B["default"]
    else:
        return None
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return a, b


def with_adapter_layout(tree: Tree, model: nn.Module) -> Tree:
    """``tree`` with ``model``'s layout in every ``AdapterFold``, ``RankCap``, ``OwnB`` and ``ProductSteps`` (other
    nodes as they are)."""
    blocks, size = adapter_layout(model)
    nodes = dict(tree.nodes)
    for node_id, node in tree.nodes.items():
        settings, fold = node.settings, node.settings.aggregate.adapter
        if fold is not None:
            aggregate = replace(settings.aggregate, adapter=replace(fold, blocks=blocks, size=size))
            settings = replace(settings, aggregate=aggregate)
        if settings.rank is not None:
            settings = replace(settings, rank=replace(settings.rank, blocks=blocks, size=size))
        if settings.own_b is not None:
            settings = replace(settings, own_b=replace(settings.own_b, blocks=blocks, size=size))
        if settings.products is not None:
            settings = replace(settings, products=replace(settings.products, blocks=blocks, size=size))
        nodes[node_id] = replace(node, settings=settings)
    return replace(tree, nodes=nodes)


def needs_layout(tree: Tree) -> bool:
    """Whether a node of ``tree`` folds adapter products, caps its rank, keeps its own B or takes its steps in
    product space (then ``with_adapter_layout``)."""
    return any(
        s.aggregate.adapter is not None or s.rank is not None or s.own_b is not None or s.products is not None
        for s in (node.settings for node in tree)
    )
