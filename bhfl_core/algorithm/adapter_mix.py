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
``[c_1·B_1 | ... | c_k·B_k] = Q_B·R_B`` and ``[A_1; ...; A_k]^T = Q_A·R_A`` (a QR from
their kr x kr Gram matrices), the SVD of the kr x kr core ``R_B·R_A^T`` gives ``M``'s:
O(fan·(kr)^2) a block, float64 on the CPU, the same bits for any thread count
(``_low_rank_svd``). Where the terms span at most r directions the result is the exact
combination (to float32's precision); otherwise it is its best rank-r approximation
(Eckart-Young), and ``adapter/step_truncation_error`` (``adapter/down_step_truncation_error`` for the
down step) says what it left out.

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
from bhfl_core.algorithm.one_thread import one_thread

if TYPE_CHECKING:
    import torch

    from bhfl_core.algorithm.tree import NodeSettings

STEP_TRUNCATION = "adapter/step_truncation_error"
"""Metric (``exact``): what rank r leaves out of a product-space step's combination, relative to it."""
DOWN_STEP_TRUNCATION = "adapter/down_step_truncation_error"
"""The same for the down step (NODEOPT_down and down-residuals), logged with its execution's first round."""

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
        u, s, vh = _low_rank_svd(block.scaling, factors, block.rank)
        lost += float((s[block.rank :] ** 2).sum())
        total += float((s**2).sum())
        write_factors(out, block, u, s, vh, plain)
    return out, math.sqrt(lost / total) if total > 0 else 0.0


def _low_rank_svd(
    scaling: float, factors: Sequence[tuple[float, torch.Tensor, torch.Tensor]], rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``M = s·sum_j c_j·B_j·A_j`` (float64, CPU) as its first ``rank`` left and right singular vectors (``U_r``,
    ``V_r^T``) and all its singular values, without forming it.

    ``M = s·P·Q`` with ``P = [c_1·B_1 | ...]`` (fan_out x K) and ``Q = [A_1; ...]`` (K x fan_in). The Gram
    matrices ``P^T·P = V_P·L_P·V_P^T`` and ``Q·Q^T`` (K x K) give ``P = (P·V_P·L_P^-1/2)·(L_P^1/2·V_P^T)``, an
    orthonormal basis times a small factor (Cholesky-QR by eigenvectors), likewise Q, and the SVD of the small
    core ``L_P^1/2·V_P^T·V_Q·L_Q^1/2`` gives M's. Directions of P or Q under 1e-6 of their largest singular value
    are dropped (what the Gram matrix can resolve; they move the product by as little). Every reduction over a
    matrix's long side is a chain of elementwise operations (``_gram``, ``_times``) and the decompositions are of
    K x K matrices, so the bits do not depend on the thread count (LAPACK's QR and SVD of a tall or large matrix
    split their sums by thread), as the fold's own products (``adapter_rule.products``).
    """
    import torch

    p = torch.cat([c * bj.cpu().double() for c, bj, _ in factors], dim=1)  # fan_out x K
    q = torch.cat([aj.cpu().double() for _, _, aj in factors], dim=0)  # K x fan_in
    basis_p, root_p = _range(_gram(p))  # P = (P·basis_p)·root_p^T: basis_p = V·L^-1/2, root_p = V·L^1/2
    basis_q, root_q = _range(_gram(q.T))
    if basis_p.shape[1] == 0 or basis_q.shape[1] == 0:  # no product at all
        empty = torch.zeros(0, dtype=torch.float64)
        return p.new_zeros(p.shape[0], 0), empty, q.new_zeros(0, q.shape[1])
    core = _times(root_p.T, root_q)  # kp x kq
    with one_thread():  # K x K: thread-independent up to K = 192 here, pinned for larger K (one_thread.py)
        u, s, vh = torch.linalg.svd(core, full_matrices=False)
    left = _times(p, _times(basis_p, u[:, :rank]))  # fan_out x r: P·V_P·L_P^-1/2·U_r
    right = _times(_times(vh[:rank], basis_q.T), q)  # r x fan_in
    return left, s * scaling, right


def _range(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``V·L^-1/2`` and ``V·L^1/2`` of a Gram matrix's eigenpairs over its resolvable range (the SVD of a
    symmetric positive semi-definite matrix: its eigenvectors and eigenvalues, descending)."""
    import torch

    with one_thread():
        v, eigen, _ = torch.linalg.svd(gram)
    keep = eigen > eigen[0] * 1e-12 if len(eigen) else eigen > 0
    v, eigen = v[:, keep], eigen[keep]
    return v / eigen.sqrt(), v * eigen.sqrt()


def _gram(x: torch.Tensor) -> torch.Tensor:
    """``x^T·x`` (n x K -> K x K): the rows' outer products summed pairwise in chunks, in a fixed order."""
    import torch

    total = x.new_zeros(x.shape[1], x.shape[1])
    for start in range(0, x.shape[0], _CHUNK):
        rows = x[start : start + _CHUNK]
        terms = rows[:, :, None] * rows[:, None, :]
        while terms.shape[0] > 1:
            if terms.shape[0] % 2:
                terms = torch.cat([terms, terms.new_zeros(1, *terms.shape[1:])])
            terms = terms[0::2] + terms[1::2]
        total = total + terms[0]
    return total


def _times(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``left @ right`` as the outer products of their K columns and rows added in order (K is small)."""
    out = left.new_zeros(left.shape[0], right.shape[1])
    for j in range(left.shape[1]):
        out.add_(left[:, j : j + 1] * right[j : j + 1])
    return out


_CHUNK = 4096  # rows whose outer products _gram holds at once: 4096 x K x K values (37 MB at K = 32)
