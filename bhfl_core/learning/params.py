"""Flat parameter vectors: the one representation of a model that travels the tree.

Only trainable parameters are federated (buffers such as BERT's ``position_ids`` are
not); shared (tied) parameters appear once, as ``model.parameters()`` yields them.
"""

from __future__ import annotations

import torch
from torch import nn


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def get_flat(model: nn.Module) -> torch.Tensor:
    """A float32 copy of the model's trainable parameters as one vector, on the model's device.

    One copy (the concatenation); a GPU worker folds it on the GPU and moves to the CPU
    only what it must keep (a checkpoint, a residual candidate).
    """
    return torch.nn.utils.parameters_to_vector(trainable_parameters(model)).detach().to(torch.float32)


@torch.no_grad()
def set_flat(model: nn.Module, flat: torch.Tensor) -> None:
    """Load a flat vector into the model in place (no reallocation of the model)."""
    params = trainable_parameters(model)
    expected = sum(p.numel() for p in params)
    if flat.numel() != expected:
        raise ValueError(f"flat vector has {flat.numel()} values, the model has {expected} trainable parameters")
    offset = 0
    for p in params:
        n = p.numel()
        p.copy_(flat[offset : offset + n].view_as(p))
        offset += n
