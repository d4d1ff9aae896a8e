"""FedNova: normalised averaging (Wang et al. 2020, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization").

Clients that take different numbers of local steps pull FedAvg's mean towards the ones
that took more (the objective inconsistency of the title). FedNova averages each
client's update *per step* and rescales by an effective step count::

    d_i       = (x_ref - x_i) / tau_i                 x_ref: the model the children were sent
    tau_eff   = sum_i p_i tau_i                       p_i = w_i / W: example weights, W = sum_i w_i
    x_nova    = x_ref - tau_eff * sum_i p_i d_i
              = x_ref + (tau_eff / W) * (S - A x_ref),   S = sum_i a_i x_i,  A = sum_i a_i,  a_i = w_i / tau_i

``x_nova`` is the mean input the node's NODEOPT_up steps towards (FedAvg with ``eta_up: 1``
adopts it: the paper's server step; a server optimiser takes ``x_nova - x_ref`` as its
pseudo-gradient). With every ``tau_i`` equal it is the example-weighted mean of the
models. ``tau_i`` is the paper's ``||a_i||_1``, how many steps' worth of gradient the
client's execution adds up to (``fednova_norm.local_norm``, passed to ``contribute`` as
``steps`` where the client is folded, tasks/client_training.py): its optimiser steps
(``tree.local_steps``: its rounds times ``planned_steps`` on its training rows, at the
epochs its plan gives, so Tempo's per-child epochs count) for plain SGD, the vanilla-SGD
normaliser, also given to AdamW (the paper has none for adaptive optimisers); for SGD with
FedProx's ``mu > 0`` the paper's proximal one, ``rounds · (1 - (1 - lr·mu)^s) / (lr·mu)``
(``s`` steps a TRAIN call), which is not an integer. With it, ``tau_eff = sum_i p_i ||a_i||_1``
(the paper's; its reference implementation's ``average`` takes ``p_i`` times the steps instead
when ``mu != 0``, a larger server step): clients that all ran the same ``a`` still give their weighted mean.

The partial streams like the mean's: ``S`` is an exact ``WeightedSum`` (16 bytes per
parameter whatever the cohort), each member's ``(w_i, tau_i)`` kept as numbers (float64:
``tau_i`` is the very number ``local_norm`` gave, on the wire too). ``a_i`` is rounded to
29 significant bits (``nova_weight``, a relative change below ``2**-29``) so that every
product ``a_i x_i`` is exact in float64 and the sum keeps its order-independence
(``aggregation.py``). The example weights are then taken as the ``a_i`` hold them,
``w_i ~ a_i tau_i`` (within ``2**-29``), so that ``p_i``, ``A``, ``W = sum_i a_i tau_i`` and
``tau_eff`` agree with ``S``: with every ``tau_i`` equal, ``x_ref`` then cancels and
``x_nova = S / A``, the weighted mean. These sums are ``math.fsum``s of each member's own
products (exact for integer steps below ``2**12``; a non-integer ``tau_i``'s rounded in
float64 member by member, the same bits whoever computes them), so the result is the same bits however the
children were batched or ordered. It is computed in float64 from the rounded sum and
rounded once to float32. With equal ``tau_i`` a power of two it is the mean rule's mean
bit for bit (the ``a_i`` are exact); with other equal ``tau_i`` (integers, or FedProx's
normalisers) it is that mean with weights within ``2**-29`` of ``w_i``: equal to one
float32 unit (tests/core/test_fednova.py: >99% of values identical), and where the mean is
near 0, within ``2**-27`` of the updates.

Where it applies (rejected by the config otherwise, naming the key): a server whose
children are all clients (a child server's model has no step count), synchronous
(``mode: async`` folds buffers of stale arrivals), without ``proxy_train: async`` (its
proxy model would need one), ``privacy:`` or ``secure_aggregation:`` (they fold their
own sums), or whose clients do not start from ``x_ref`` (a client ``eta_down < 1``
starts from a mix, and ``d_i`` would include that offset:
``bhfl_core/config/step_normalised_starts.py``). The fold is
never closed on a worker (the parent holds ``x_ref`` and the formula is one pass).
Residuals combine (they are stepped separately from the regular input).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from bhfl_core.algorithm.contract import NO_PLAN, FoldPlan, Partial
from bhfl_core.algorithm.node_state import Caller, RoundKey
from bhfl_core.algorithm.rule_registry import AggregateParams, RuleTraits, Stateless, register_rule

if TYPE_CHECKING:
    import torch

    from bhfl_core.algorithm.aggregation import Allocator, WeightedSum

WEIGHT = "weight."
"""Wire numbers: ``weight.<member>`` is w_i (its training examples)."""
STEPS = "steps."
"""Wire numbers: ``steps.<member>`` is tau_i (its ``||a_i||_1``, ``fednova_norm.local_norm``)."""
_CHUNK = 1 << 20
"""Elements per float64 pass of ``result``: 8 MiB temporaries, not five model-sized ones (4.4 GB at 110M)."""
_WEIGHT_BITS = 29
"""Significant bits of a_i: 29 + float32's 24 = float64's 53, so ``a_i x_i`` is exact."""


def nova_weight(weight: float, steps: float) -> float:
    """``a_i = w_i / tau_i`` rounded to 29 significant bits (exact products with float32 models)."""
    if not weight > 0 or not steps >= 1:
        raise ValueError(f"FedNova needs a positive weight and at least one local step, got {weight} and {steps}")
    mantissa, exponent = math.frexp(weight / steps)
    return math.ldexp(round(mantissa * 2**_WEIGHT_BITS), exponent - _WEIGHT_BITS)


class NovaSum:
    """FedNova's running fold: ``S = sum_i a_i x_i`` exactly, and each member's ``(w_i, tau_i)``."""

    def __init__(
        self, reference: torch.Tensor | None, allocate: Allocator | None = None, total: WeightedSum | None = None
    ) -> None:
        from bhfl_core.algorithm.aggregation import WeightedSum

        self.reference = reference
        self.total = total if total is not None else WeightedSum(allocate=allocate)
        self.members: dict[str, tuple[float, float]] = {}

    @property
    def weight(self) -> float:
        return math.fsum(w for w, _ in self.members.values())

    @property
    def empty(self) -> bool:
        return self.total.empty

    def add(self, member: str, model: torch.Tensor, weight: float, steps: float | None) -> None:
        if steps is None:
            raise ValueError(
                f"fednova divides each child's update by its local steps; {member!r} reported none (only clients "
                "do: a child server or a proxy TRAIN cannot be folded by fednova)"
            )
        if member in self.members:
            raise ValueError(f"{member!r} contributed twice to one fednova round")
        self.total.add(model, nova_weight(weight, steps))
        self.members[member] = (float(weight), float(steps))

    def merge(self, other: NovaSum) -> None:
        twice = sorted(self.members.keys() & other.members.keys())
        if twice:
            raise ValueError(f"{twice} contributed twice to one fednova round")
        self.total.merge(other.total, consume=True)
        self.members.update(other.members)

    def result(self) -> torch.Tensor:
        """``x_nova`` (float32): the module docstring's formula in float64 from the exact sum, rounded once."""
        if self.reference is None or self.total.hi is None or self.total.lo is None:
            raise ValueError("cannot finalize a fednova fold without its reference model or contributions")
        ordered = [(nova_weight(w, tau), tau) for w, tau in (self.members[m] for m in sorted(self.members))]
        a_total = math.fsum(a for a, _ in ordered)
        w_total = math.fsum(a * tau for a, tau in ordered)  # W, from the w_i as the a_i hold them
        tau_eff = math.fsum(a * tau * tau for a, tau in ordered) / w_total
        scale, hi, lo = tau_eff / w_total, self.total.hi.reshape(-1), self.total.lo.reshape(-1)
        x_ref = self.reference.reshape(-1).to(hi.device)
        out = x_ref.new_empty(hi.numel())  # float32; float64 only chunk by chunk (elementwise: the same bits)
        for start in range(0, hi.numel(), _CHUNK):
            part = slice(start, start + _CHUNK)
            x = x_ref[part].double()
            summed = hi[part] + lo[part]  # S, rounded once: a function of the exact sum only
            out[part] = x + (summed - x * a_total) * scale
        return out.view(self.total.hi.shape)

    def wire(self) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        numbers = {f"{WEIGHT}{m}": w for m, (w, _) in self.members.items()}
        numbers.update({f"{STEPS}{m}": tau for m, (_, tau) in self.members.items()})
        return self.total.parts(), numbers


def _nova(partial: Partial) -> NovaSum:
    if not isinstance(partial, NovaSum):
        raise TypeError(f"the fednova rule folds NovaSum partials, got {type(partial).__name__}")
    return partial


@register_rule("fednova", RuleTraits(whole_round=True, steps=True))
class FedNovaRule(Stateless):
    """FedNova's normalised average (module docstring); each contribution must carry its client's ``steps``."""

    def __init__(self, params: AggregateParams) -> None:
        self.params = params

    def start(
        self,
        round_of: Caller,
        plan: FoldPlan = NO_PLAN,
        reference: torch.Tensor | None = None,
        allocate: Allocator | None = None,
    ) -> NovaSum:
        return NovaSum(reference, allocate)

    def contribute(
        self, partial: Partial, member: str, model: torch.Tensor, weight: float, steps: float | None = None
    ) -> None:
        _nova(partial).add(member, model, weight, steps)

    def merge(self, into: Partial, other: Partial) -> None:
        _nova(into).merge(_nova(other))

    def close(self, partial: Partial) -> bool:
        return False  # one pass at the parent, which holds x_ref

    def mean_input(self, partial: Partial, key: RoundKey) -> torch.Tensor:
        return _nova(partial).result()

    def wire(self, partial: Partial) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        return _nova(partial).wire()

    def unwire(self, tensors: Mapping[str, torch.Tensor], numbers: Mapping[str, float]) -> NovaSum:
        from bhfl_core.algorithm.aggregation import WeightedSum

        total = WeightedSum.of(tensors["hi"], tensors["lo"], 0.0) if tensors else WeightedSum()
        out = NovaSum(None, total=total)
        for key in sorted(k for k in numbers if k.startswith(WEIGHT)):
            member = key[len(WEIGHT) :]
            out.members[member] = (float(numbers[key]), float(numbers[f"{STEPS}{member}"]))
        return out
