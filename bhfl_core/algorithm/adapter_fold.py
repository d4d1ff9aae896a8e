"""Where a LoRA run's A and B matrices lie in the flat vector, and how a server folds them (``model.adapter``).

The flat vector that travels (``learning/params.get_flat``) is the trainable parameters
in model order: each adapted matrix's ``A`` (r x fan_in) and ``B`` (fan_out x r), row
major, then the head and any ``modules_to_save``. The aggregation rules fold that vector
without knowing what it holds; ``AdapterFold`` tells the ``adapter`` wrapper
(``adapter_rule.py``) which slices are A and B, so it can fold the products ``s·B_i·A_i``
(``s``: the layer's scaling, alpha/r or alpha/sqrt(r) with rsLoRA) beside them.

The layout comes from the built model (``learning/adapter_layout.py``), which the
config alone does not give (the head's size is the data's labels), so ``build_tree``
leaves ``blocks`` empty and whoever opens a run fills them in once
(``learning/adapter_layout.with_adapter_layout``, from tasks/context.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class AdapterBlock:
    """One adapted linear layer: A at ``a_offset`` (rank x fan_in), B at ``b_offset`` (fan_out x rank)."""

    name: str
    a_offset: int
    b_offset: int
    rank: int
    fan_in: int
    fan_out: int
    scaling: float

    @property
    def product_size(self) -> int:
        return self.fan_out * self.fan_in


@dataclass(frozen=True)
class AdapterFold:
    """The ``adapter`` wrapper's parameters: ``aggregation`` (``ab-mean``: A and B averaged apart, the products
    folded only to measure the error; ``exact``: the mean product re-factorised) and the vector's layout."""

    aggregation: str
    blocks: tuple[AdapterBlock, ...] = ()
    size: int = 0  # the flat vector's length the blocks index into

    @property
    def products(self) -> int:
        """Values of all products together (what a fold keeps beside the vectors' sum)."""
        return sum(b.product_size for b in self.blocks)


@dataclass(frozen=True)
class RankCap:
    """A node's adapter rank below the model's (``adapter_rank``: HetLoRA's zero-padding; docs/config.md).

    Every node keeps the model's vector (rank ``model.adapter.r`` everywhere, so one
    model instance and one vector length serve the tree); a node of rank ``rank`` holds
    only the first ``rank`` rows of each A and columns of each B, the rest zero. A zero
    row of A beside a zero column of B gets no gradient (each one's gradient is a product
    with the other), so a client trains a rank-``rank`` adapter, and its parent's mean is
    the zero-padded mean of its children's. ``blocks``: the layout, filled in with the
    servers' (``with_adapter_layout``).
    """

    rank: int
    blocks: tuple[AdapterBlock, ...] = ()
    size: int = 0


def cap_rank(vector: torch.Tensor, cap: RankCap | None) -> torch.Tensor:
    """``vector`` with each block's A rows and B columns from ``cap.rank`` on set to zero (a new tensor).

    Without ``cap`` it is returned as it is. Truncating a factorisation whose components
    are ordered by singular value (``aggregation: exact``'s) keeps its best rank-``rank``
    part: FlexLoRA's redistribution to a smaller client.
    """
    if cap is None:
        return vector
    if not cap.blocks:
        raise ValueError("adapter_rank needs the model's layout of A and B (learning/adapter_layout.py)")
    if vector.numel() != cap.size:
        raise ValueError(f"an adapter vector of {vector.numel()} values, the layout has {cap.size}")
    out = vector.clone()
    for b in cap.blocks:
        if cap.rank >= b.rank:
            continue
        out[b.a_offset + cap.rank * b.fan_in : b.a_offset + b.rank * b.fan_in] = 0.0
        out[b.b_offset : b.b_offset + b.fan_out * b.rank].view(b.fan_out, b.rank)[:, cap.rank :] = 0.0
    return out


@dataclass(frozen=True)
class OwnB:
    """FedSA-LoRA (Guo et al. 2025) at a client: its B matrices are its own, A is shared (``aggregation: fedsa``).

    The client starts each execution from its parent's model with its own B from the
    model it saved last (its first: the parent's); it sends its whole vector up, so its
    parent's B is the mean of its children's (what a new client starts from, and what
    the server's model is evaluated with). ``blocks``: the layout (``with_adapter_layout``).
    """

    blocks: tuple[AdapterBlock, ...] = ()
    size: int = 0


def keep_own_b(received: torch.Tensor, own: torch.Tensor | None, keep: OwnB | None) -> torch.Tensor:
    """``received`` with every block's B taken from ``own`` (a new tensor); as it is without ``keep`` or ``own``."""
    if keep is None or own is None:
        return received
    if not keep.blocks:
        raise ValueError("aggregation: fedsa needs the model's layout of A and B (learning/adapter_layout.py)")
    if received.numel() != keep.size or own.numel() != keep.size:
        raise ValueError(f"adapter vectors of {received.numel()} and {own.numel()} values, the layout has {keep.size}")
    out = received.clone()
    for b in keep.blocks:
        part = slice(b.b_offset, b.b_offset + b.fan_out * b.rank)
        out[part] = own[part].to(out.device, out.dtype)
    return out


@dataclass(frozen=True)
class ProductSteps:
    """Under ``aggregation: exact``: the node's linear steps combine its models' products, not their factors.

    Set (``config/adapter_settings.product_steps``) at a node with such a step: FedAvg's
    ``eta_down`` or ``eta_up`` other than 1, or residuals to fold (``adapter_mix.py``).
    ``blocks``: the layout (``with_adapter_layout``).
    """

    blocks: tuple[AdapterBlock, ...] = ()
    size: int = 0
