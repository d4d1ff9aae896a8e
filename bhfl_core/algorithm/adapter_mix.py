"""Under ``model.adapter.aggregation: exact``: a node's linear steps combine LoRA products, not factors.

A server's fold re-factorises its children's mean product (``adapter_rule.py``), so a
node's A and B and its parent's come from different SVDs: the same product can have
any factors ``B·G``, ``G^T·A`` (G orthogonal), and mixing factors of two bases is not
mixing their products (``eta_down: 0.3`` on synthetic 32x32 rank-4 adapters: a product
38% off, median). The steps linear in the models are therefore taken in product space:

- FedAvg with ``eta`` other than 1, down and up: ``(1-eta)·s·B_t·A_t + eta·s·B_in·A_in``;
- residual folding (``node_step.fold_residuals``): ``stepped + sum_k (moved_k - base)``,
  each term's product, FedAvg's ``moved_k`` again as its two models.

The step is written as a linear combination of models (``Terms``; one model appearing
twice is merged, so ``base`` cancels where it should), each block's combination
``M = s·sum_j c_j·B_j·A_j`` (rank <= k·r) is re-factorised to rank r as the fold does
(``adapter_rule.write_factors``: singular values split evenly, ordered, a dead row
keeps the plain step's A), and everything outside the blocks (head, ``modules_to_save``,
DoRA magnitudes) is the plain vector step, bit for bit. ``M`` is never formed:
``[c_1·B_1 | ... | c_k·B_k] = Q_B·R_B`` and ``[A_1; ...; A_k]^T = Q_A·R_A`` (thin QR),
the SVD of the kr x kr core ``R_B·R_A^T`` gives ``M``'s: O(fan·(kr)^2) a block, float64
on the CPU (the same LAPACK calls wherever the node runs). Where the terms span at most r
directions the result is the exact combination; otherwise it is its best rank-r
approximation (Eckart-Young), and ``adapter/step_truncation_error`` says what it left out.

A step that is one model with coefficient 1 (FedAvg at ``eta`` 1 without residuals:
adoption) is returned as it is. Non-linear steps (FedAvgM, FedAdam, ... on the factors,
Ditto's pull, error feedback) stay factor-wise: their product-space version needs
optimiser state of the full matrix (``config/adapter_caveats.py`` warns of them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from bhfl_core.algorithm.adapter_fold import ProductSteps
from bhfl_core.algorithm.adapter_rule import factor, write_factors
from bhfl_core.algorithm.node_opt import NodeOptParams

if TYPE_CHECKING:
    import torch

    from bhfl_core.algorithm.tree import NodeSettings

STEP_TRUNCATION = "adapter/step_truncation_error"
"""Metric (``exact``): what rank r leaves out of a product-space step's combination, relative to it."""

Terms = Sequence[tuple[float, "torch.Tensor"]]
"""A step as a linear combination of flat vectors: ``sum_j c_j·v_j``."""


def linear(params: NodeOptParams) -> bool:
    """Whether a NODEOPT step is a fixed linear combination of its two models: FedAvg."""
    return params.kind == "fedavg"


def mixes_models(settings: NodeSettings, is_leaf: bool) -> bool:
    """Whether a node has a linear step that combines two models' adapters (then ``ProductSteps``)."""
    down = linear(settings.opt_down) and settings.opt_down.eta != 1.0 and settings.persistent
    up = not is_leaf and linear(settings.opt_up) and settings.opt_up.eta != 1.0
    return down or up or bool(settings.res_in)


def step_terms(params: NodeOptParams, theta: torch.Tensor, mean_input: torch.Tensor, stepped: torch.Tensor) -> Terms:
    """A NODEOPT step as ``Terms``: FedAvg's ``(1-eta)·theta + eta·input``; any other kind its result as it is."""
    if linear(params) and params.eta != 1.0:
        return ((1.0 - params.eta, theta), (params.eta, mean_input))
    return ((1.0, stepped),)


def merged(terms: Terms) -> list[tuple[float, torch.Tensor]]:
    """``terms`` with each model once (by identity: a model is never changed in place), zero coefficients dropped."""
    coefficients: list[float] = []
    models: list[torch.Tensor] = []
    for c, v in terms:
        at = next((i for i, m in enumerate(models) if m is v), None)
        if at is None:
            coefficients.append(c)
            models.append(v)
        else:
            coefficients[at] += c
    return [(c, v) for c, v in zip(coefficients, models, strict=True) if c != 0.0]


def mix_products(steps: ProductSteps | None, plain: torch.Tensor, terms: Terms) -> tuple[torch.Tensor, float | None]:
    """``plain`` (the step on the flat vector) with each block's A and B the rank-r factorisation of the terms'
    product combination, and the truncation error; ``plain`` itself (and None) without ``steps`` or when the terms
    are one model with coefficient 1."""
    combination = merged(terms)
    if steps is None or (len(combination) == 1 and combination[0][0] == 1.0):
        return plain, None
    if not steps.blocks:
        raise ValueError("aggregation: exact's steps need the model's layout of A and B (learning/adapter_layout.py)")
    if plain.numel() != steps.size:
        raise ValueError(f"an adapter vector of {plain.numel()} values, the layout has {steps.size}")
    out = plain.clone()
    lost = total = 0.0
    combination = combination or [(0.0, plain)]  # everything cancelled: the zero product
    for block in steps.blocks:
        factors = [(c, factor(v, block, "B"), factor(v, block, "A")) for c, v in combination]
        u, s, vh = _low_rank_svd(block.scaling, factors)
        lost += float((s[block.rank :] ** 2).sum())
        total += float((s**2).sum())
        write_factors(out, block, u, s, vh, plain)
    return out, math.sqrt(lost / total) if total > 0 else 0.0


def _low_rank_svd(
    scaling: float, factors: Sequence[tuple[float, torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The thin SVD ``U, S, V^T`` of ``s·sum_j c_j·B_j·A_j`` (float64, CPU) without forming it: QR of the stacked
    factors, SVD of the small core."""
    import torch

    b = torch.cat([c * bj.cpu().double() for c, bj, _ in factors], dim=1)  # fan_out x kr
    a = torch.cat([aj.cpu().double() for _, _, aj in factors], dim=0)  # kr x fan_in
    q_b, r_b = torch.linalg.qr(b)
    q_a, r_a = torch.linalg.qr(a.T)
    u, s, vh = torch.linalg.svd(r_b @ r_a.T, full_matrices=False)
    return q_b @ u, s * scaling, vh @ q_a.T
