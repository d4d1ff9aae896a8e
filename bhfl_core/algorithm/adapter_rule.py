"""The ``adapter`` wrapper: how a server folds its children's LoRA adapters (``model.adapter.aggregation``).

A child's adapted matrix moves by ``s·B_i·A_i``. Averaging A and B apart (``ab-mean``,
FedIT: what the mean of the flat vectors does) gives ``s·mean(B)·mean(A)``, which is
not ``mean(s·B_i·A_i)``: the cross terms ``B_i·A_j`` enter. This wrapper folds each
child's products beside the vector (an exact ``WeightedSum`` of their float32 values:
the same bits however the children are spread over workers, and on any device: see
``products``) and, at ``finalize``:

- ``ab-mean``: keeps the mean vector as it is (the same bits as without the wrapper)
  and logs ``adapter/ab_error`` = ``||mean(s·B_i·A_i) - s·mean(B)·mean(A)|| /
  ||mean(s·B_i·A_i)||`` (Frobenius, over all adapted matrices together);
- ``exact``: replaces each matrix's A and B by the rank-r factorisation of the mean
  product (``M = U S V^T``, truncated SVD in float64 on the CPU: ``B = U_r·sqrt(S_r/s)``,
  ``A = sqrt(S_r/s)·V_r^T``, the singular values split evenly, as FlexLoRA does), and logs
  ``adapter/truncation_error`` = ``||M - s·B·A|| / ||M||`` (nothing is lost while the
  children's products span at most r directions) beside ``adapter/ab_error``. A row of A
  whose singular value is zero (the children's products span fewer than r directions,
  e.g. every B still zero) keeps ab-mean's row, with a zero column of B: the product is
  the same, and the adapter does not lose the direction for good.

Stacking (FLoRA) is exact too but grows the rank by the children's ranks each round, so
the vector would not keep its size; SVD keeps it. The rest of the vector (the head,
``modules_to_save``, DoRA's magnitudes) is the wrapped rule's mean. ``ffa`` needs no
wrapper: A is frozen and identical everywhere (``learning/lora_options.py``), so the mean
of B is already exact; nor does ``fedsa`` (each client keeps its B: ``adapter_fold.OwnB``,
spliced in by ``node_step.node_down``; its server's mean of A is the mean). The wrapper
sits directly around ``kind: mean`` in synchronous rounds, never inside ``dp`` or
``secagg`` (the server may not see a child's product there): ``config/adapter_settings.py``
decides where it goes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from bhfl_core.algorithm.adapter_fold import AdapterBlock, AdapterFold
from bhfl_core.algorithm.contract import NO_PLAN, FoldPlan, Partial
from bhfl_core.algorithm.node_state import Caller, RoundKey
from bhfl_core.algorithm.one_thread import one_thread
from bhfl_core.algorithm.rule_registry import NO_STATE, AggregationRule, Finalized, RuleState, register_wrapper

if TYPE_CHECKING:
    import torch

    from bhfl_core.algorithm.aggregation import Allocator, WeightedSum

AB_ERROR = "adapter/ab_error"
"""Metric: how far ab-mean's ``s·mean(B)·mean(A)`` is from the mean product, relative to it."""

TRUNCATION_ERROR = "adapter/truncation_error"
"""Metric (``exact``): what the rank-r factorisation leaves out of the mean product, relative to it."""

PRODUCTS = "adapter_products"  # the prefix of the products' tensors on the wire


class AdapterPartial:
    """The wrapped rule's partial and the running sum of the children's products (one vector, block after block)."""

    def __init__(self, inner: Partial, products: WeightedSum) -> None:
        self.inner, self.products = inner, products

    @property
    def weight(self) -> float:
        return self.inner.weight

    @property
    def empty(self) -> bool:
        return self.inner.empty


def _adapter(partial: Partial) -> AdapterPartial:
    if not isinstance(partial, AdapterPartial):
        raise TypeError(f"the adapter wrapper folds AdapterPartial partials, got {type(partial).__name__}")
    return partial


def products(fold: AdapterFold, model: torch.Tensor) -> torch.Tensor:
    """``s·B·A`` of every block of ``model`` (a flat vector), each row major, as one float32 vector.

    In float64 as r outer products added in rank order (each term is exact, each addition
    correctly rounded), not a matrix product whose summation order is the kernel's: the
    same bits on any device and CPU kernel, as the fold's other sums.
    """
    import torch

    parts = []
    for b in fold.blocks:
        a, bb = factor(model, b, "A").double(), factor(model, b, "B").double()
        product = bb[:, :1] * a[:1]
        for k in range(1, b.rank):
            product.add_(bb[:, k : k + 1] * a[k : k + 1])
        parts.append(product.mul_(b.scaling).flatten())
    return torch.cat(parts).to(torch.float32)


def factor(model: torch.Tensor, block: AdapterBlock, which: str) -> torch.Tensor:
    """A view of ``model``'s ``"A"`` (rank x fan_in) or ``"B"`` (fan_out x rank) of ``block``."""
    if which == "A":
        return model[block.a_offset : block.a_offset + block.rank * block.fan_in].view(block.rank, block.fan_in)
    return model[block.b_offset : block.b_offset + block.fan_out * block.rank].view(block.fan_out, block.rank)


@register_wrapper("adapter", AdapterFold)
class AdapterRule:
    """Folds the children's adapter products beside the wrapped rule (module docstring)."""

    def __init__(self, fold: AdapterFold, inner: AggregationRule) -> None:
        if not fold.blocks:
            raise ValueError(
                "the adapter wrapper has no layout: the tree was built without the model "
                "(learning/adapter_layout.with_adapter_layout fills it in)"
            )
        self.fold, self.inner = fold, inner
        self.distinct_members = inner.distinct_members
        self.reports_up, self.sees_members = inner.reports_up, inner.sees_members

    def plan(self, state: RuleState, called: Sequence[str]) -> FoldPlan:
        return self.inner.plan(state, called)

    def start(
        self,
        round_of: Caller,
        plan: FoldPlan = NO_PLAN,
        reference: torch.Tensor | None = None,
        allocate: Allocator | None = None,
    ) -> AdapterPartial:
        from bhfl_core.algorithm.aggregation import WeightedSum

        return AdapterPartial(self.inner.start(round_of, plan, reference, allocate), WeightedSum())

    def contribute(
        self, partial: Partial, member: str, model: torch.Tensor, weight: float, steps: float | None = None
    ) -> None:
        fold = _adapter(partial)
        if model.numel() != self.fold.size:
            raise ValueError(f"an adapter vector of {model.numel()} values, the layout has {self.fold.size}")
        fold.products.add(products(self.fold, model), weight)
        self.inner.contribute(fold.inner, member, model, weight, steps)

    def merge(self, into: Partial, other: Partial) -> None:
        mine, theirs = _adapter(into), _adapter(other)
        self.inner.merge(mine.inner, theirs.inner)
        mine.products.merge(theirs.products, consume=True)

    def close(self, partial: Partial) -> bool:
        fold = _adapter(partial)
        if not self.inner.close(fold.inner):
            return False
        fold.products.close()
        return True

    def finalize(self, partial: Partial, key: RoundKey, state: RuleState = NO_STATE) -> Finalized:
        fold = _adapter(partial)
        done = self.inner.finalize(fold.inner, key, state)
        mean_product = fold.products.mean()
        metrics = {**done.metrics, AB_ERROR: ab_error(self.fold, done.input, mean_product)}
        if self.fold.aggregation != "exact":
            return Finalized(done.input, done.state, metrics)
        refactored, truncation = refactorise(self.fold, done.input, mean_product)
        return Finalized(refactored, done.state, {**metrics, TRUNCATION_ERROR: truncation})

    def wire(self, partial: Partial) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        fold = _adapter(partial)
        tensors, numbers = self.inner.wire(fold.inner)
        mine = {f"{PRODUCTS}_{name}": t for name, t in fold.products.parts().items()}
        return {**tensors, **mine}, {**numbers, f"{PRODUCTS}_weight": fold.products.weight}

    def unwire(self, tensors: Mapping[str, torch.Tensor], numbers: Mapping[str, float]) -> AdapterPartial:
        from bhfl_core.algorithm.aggregation import CLOSED, WeightedSum

        prefix = f"{PRODUCTS}_"
        mine = {k.removeprefix(prefix): t for k, t in tensors.items() if k.startswith(prefix)}
        weight = float(numbers.get(f"{prefix}weight", 0.0))
        inner = self.inner.unwire(
            {k: t for k, t in tensors.items() if not k.startswith(prefix)},
            {k: v for k, v in numbers.items() if not k.startswith(prefix)},
        )
        if CLOSED in mine:
            return AdapterPartial(inner, WeightedSum.closed_of(mine[CLOSED], weight))
        return AdapterPartial(inner, WeightedSum.of(mine["hi"], mine["lo"], weight) if mine else WeightedSum())


def ab_error(fold: AdapterFold, mean: torch.Tensor, mean_product: torch.Tensor) -> float:
    """``||M - s·mean(B)·mean(A)|| / ||M||`` over all blocks together (0 when every product is zero)."""
    import torch

    naive = products(fold, mean.cpu()).double()
    exact = mean_product.cpu().double()
    norm = float(torch.linalg.vector_norm(exact))
    return float(torch.linalg.vector_norm(exact - naive)) / norm if norm > 0 else 0.0


def refactorise(fold: AdapterFold, mean: torch.Tensor, mean_product: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``mean`` with each block's A and B the rank-r factorisation of its mean product; the truncation error."""
    import torch

    out = mean.clone()
    lost = total = 0.0
    offset = 0
    for block in fold.blocks:
        m = mean_product[offset : offset + block.product_size].cpu().double().view(block.fan_out, block.fan_in)
        offset += block.product_size
        with one_thread():  # the same bits whatever the orchestrator's thread count (one_thread.py)
            u, s, vh = torch.linalg.svd(m, full_matrices=False)
        lost += float((s[block.rank :] ** 2).sum())
        total += float((s**2).sum())
        write_factors(out, block, u, s, vh, mean)
    return out, math.sqrt(lost / total) if total > 0 else 0.0


def write_factors(
    out: torch.Tensor, block: AdapterBlock, u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor, fallback: torch.Tensor
) -> None:
    """Write into ``out`` the block's rank-r factors of ``M = U·diag(S)·V^T`` (float64, ``S`` descending).

    FlexLoRA's split, ``B = U_r·sqrt(S_r/s)``, ``A = sqrt(S_r/s)·V_r^T``. A row of A whose
    singular value is zero (``M`` spans fewer than r directions) keeps ``fallback``'s row
    beside a zero column of B: the same product, and the direction stays trainable.
    """
    import torch

    r = block.rank
    kept = torch.zeros(r, dtype=torch.float64)  # r may exceed min(fan_in, fan_out): those rows have no direction
    kept[: min(r, len(s))] = s[:r]
    root = (kept / block.scaling).sqrt()
    b_new = torch.zeros(block.fan_out, r, dtype=torch.float64)
    a_new = torch.zeros(r, block.fan_in, dtype=torch.float64)
    b_new[:, : len(s)] = u[:, :r] * root[: len(s)]
    a_new[: len(s)] = root[: len(s), None] * vh[:r]
    dead = kept <= (float(s[0]) if len(s) else 0.0) * 1e-12  # no direction: keep the fallback's row of A, B's column 0
    if bool(dead.any()):
        a_new[dead] = factor(fallback, block, "A").cpu().double()[dead]
        b_new[:, dead] = 0.0
    factor(out, block, "A").copy_(a_new.to(out.dtype))
    factor(out, block, "B").copy_(b_new.to(out.dtype))
