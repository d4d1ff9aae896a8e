"""Buffered asynchronous aggregation (FedBuff, Nguyen et al. 2022; ALGORITHMS.md) as pure maths.

An asynchronous node keeps up to ``concurrency`` children in flight. A child dispatched
with the node's model of version ``v_i`` returns ``y_i``; its update is
``Delta_i = y_i - theta_{v_i}`` (relative to the model it *started from*, not to the
node's current one) and its staleness is ``s_i = v - v_i``, ``v`` being the node's
version when the result arrives. Every ``buffer`` (K) results the node steps::

    mean_input = theta_v + sum_i p_i w(s_i) Delta_i / sum_i p_i
               = sum_i p_i (theta_v + w(s_i) Delta_i) / sum_i p_i
    theta_{v+1} = NODEOPT_up(theta_v, mean_input)            (fedavg, eta 1: theta_v + that mean)

The second form is how it is computed: each result, as it arrives, becomes the model
``theta_v + w(s_i) Delta_i`` (``stale_model``, with ``w(s_i)`` from ``staleness_weight``)
and is folded by the node's aggregation rule with weight ``p_i``, the very fold a
synchronous node makes of its children (``async_engine._buffer``; the rule's
``finalize`` gives ``mean_input`` at the flush). This module holds the pure pieces of
that fold; the buffer itself is the engine's.

``p_i`` is the child's example weight, as in the synchronous step, and ``w`` the
staleness function. Choice where FedBuff is silent about weights: the normalisation
uses ``p_i`` only, so staleness shrinks a stale update's step rather than handing its
share to the fresh ones (with every ``s_i = 0`` this is exactly the synchronous mean
``sum p_i y_i / sum p_i`` when all children started from ``theta_v``).

Staleness functions (``staleness`` in the config):

    constant   w(s) = 1
    poly       w(s) = (1 + s) ** -a               (a = 0.5: FedBuff's 1/sqrt(1 + s))
    hinge      w(s) = 1 if s <= b else 1 / (a (s - b) + 1)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: configs name these settings without loading torch
    import torch


@dataclass(frozen=True)
class StalenessParams:
    kind: str = "poly"
    a: float = 0.5  # poly: the exponent; hinge: the slope after the hinge
    b: float = 4.0  # hinge: the staleness up to which updates count fully


def _poly(s: int, p: StalenessParams) -> float:
    return float((1.0 + s) ** -p.a)


def _hinge(s: int, p: StalenessParams) -> float:
    return 1.0 if s <= p.b else 1.0 / (p.a * (s - p.b) + 1.0)


STALENESS: dict[str, Callable[[int, StalenessParams], float]] = {
    "constant": lambda s, p: 1.0,
    "poly": _poly,
    "hinge": _hinge,
}


def staleness_weight(staleness: int, params: StalenessParams) -> float:
    """``w(s)`` for one result; ``staleness`` must be >= 0 (a result cannot predate its dispatch)."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    try:
        fn = STALENESS[params.kind]
    except KeyError:
        raise ValueError(f"unknown staleness function {params.kind!r}; choose one of {sorted(STALENESS)}") from None
    return fn(staleness, params)


@dataclass(frozen=True)
class AsyncParams:
    """An asynchronous node's settings: children in flight, results per flush, staleness function."""

    concurrency: int = 4
    buffer: int = 2
    staleness: StalenessParams = field(default_factory=StalenessParams)


def stale_model(theta: torch.Tensor, model: torch.Tensor, base: torch.Tensor, weight: float) -> torch.Tensor:
    """``theta + weight * (model - base)``: a stale result as the model it stands for now.

    Computed in float64 (the difference of two float32 models is exact there) and
    rounded once to float32, in chunks (no full-size float64 temporaries). A fresh
    result (``base is theta``, weight 1) is ``model`` itself, bit for bit.
    """
    import torch

    if base is theta and weight == 1.0:
        return model
    out = torch.empty_like(theta, dtype=torch.float32)
    for t, m, b, o in zip(*(torch.split(x.reshape(-1), 1 << 20) for x in (theta, model, base, out))):
        o.copy_(t.double().add_(m.double().sub_(b.double()), alpha=weight))
    return out
