"""NODEOPT: stateful server optimisers of the FedOPT family (Reddi et al., 2021).

Each node keeps one optimiser state per direction (up: children -> node, down:
parent -> node), so two nodes with identical hyperparameters still diverge; that is
the point of B-HFL. A NODEOPT step takes the node's current model ``theta`` and the
weighted mean of its inputs, forms the pseudo-gradient

    Delta = sum_i p_i (input_i - theta) = mean_input - theta

and applies (ALGORITHMS.md, seeds/000 Eq. 3)::

    FedAvg      theta + eta * Delta                       (eta = 1: adopt the mean)
    FedAvgM     m = beta1 * m + Delta;  theta + eta * m
    FedAdagrad  m = b1 m + (1-b1) D;  v = v + D^2;                    theta + eta m / (sqrt(v) + tau)
    FedAdam     m = b1 m + (1-b1) D;  v = b2 v + (1-b2) D^2;          theta + eta m / (sqrt(v) + tau)
    FedYogi     m = b1 m + (1-b1) D;  v = v - (1-b2) D^2 sign(v-D^2); theta + eta m / (sqrt(v) + tau)

States start at zero (``m = v = 0``) and carry their own step count, so bias or
schedule terms never depend on a global round (a node steps at its own rate).
Optimisers are looked up by name in a registry, so configs name them and new ones
plug in with ``@register_node_opt("name")``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

OptState = dict[str, torch.Tensor]


@dataclass(frozen=True)
class NodeOptParams:
    """Hyperparameters of one NODEOPT instance (one node, one direction)."""

    kind: str = "fedavg"
    eta: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3


StepFn = Callable[[OptState, torch.Tensor, torch.Tensor, NodeOptParams], tuple[OptState, torch.Tensor]]
_REGISTRY: dict[str, StepFn] = {}


def register_node_opt(name: str) -> Callable[[StepFn], StepFn]:
    """Register a step function under ``name``; returns the function unchanged."""
    if not name.isidentifier():
        raise ValueError(f"NODEOPT name must be an identifier, got {name!r}")

    def decorate(fn: StepFn) -> StepFn:
        if name in _REGISTRY:
            raise ValueError(f"NODEOPT {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return decorate


def available_node_opts() -> list[str]:
    return sorted(_REGISTRY)


def node_opt_step(
    state: OptState, theta: torch.Tensor, mean_input: torch.Tensor, params: NodeOptParams
) -> tuple[OptState, torch.Tensor]:
    """One NODEOPT step: returns ``(new_state, new_theta)``; inputs are not modified."""
    if theta.shape != mean_input.shape:
        raise ValueError(f"NODEOPT input shape {tuple(mean_input.shape)} != model shape {tuple(theta.shape)}")
    try:
        fn = _REGISTRY[params.kind]
    except KeyError:
        raise ValueError(f"unknown NODEOPT kind {params.kind!r}; available: {available_node_opts()}") from None
    return fn(state, theta, mean_input, params)


def _count(state: OptState) -> torch.Tensor:
    return state.get("step", torch.zeros((), dtype=torch.int64)) + 1


@register_node_opt("fedavg")
def fedavg(
    state: OptState, theta: torch.Tensor, mean_input: torch.Tensor, p: NodeOptParams
) -> tuple[OptState, torch.Tensor]:
    # lerp is exact at eta == 1 (returns mean_input bit-for-bit): HierFAVG's "replace".
    return {"step": _count(state)}, torch.lerp(theta, mean_input, p.eta)


@register_node_opt("fedavgm")
def fedavgm(
    state: OptState, theta: torch.Tensor, mean_input: torch.Tensor, p: NodeOptParams
) -> tuple[OptState, torch.Tensor]:
    delta = mean_input - theta
    m = p.beta1 * state["m"] + delta if "m" in state else delta
    return {"step": _count(state), "m": m}, theta + p.eta * m


def _adaptive(update_v: Callable[[torch.Tensor, torch.Tensor, NodeOptParams], torch.Tensor]) -> StepFn:
    def step(
        state: OptState, theta: torch.Tensor, mean_input: torch.Tensor, p: NodeOptParams
    ) -> tuple[OptState, torch.Tensor]:
        delta = mean_input - theta
        m = p.beta1 * state.get("m", torch.zeros_like(delta)) + (1 - p.beta1) * delta
        v = update_v(state.get("v", torch.zeros_like(delta)), delta * delta, p)
        return {"step": _count(state), "m": m, "v": v}, theta + p.eta * m / (v.sqrt() + p.tau)

    return step


register_node_opt("fedadagrad")(_adaptive(lambda v, d2, p: v + d2))
register_node_opt("fedadam")(_adaptive(lambda v, d2, p: p.beta2 * v + (1 - p.beta2) * d2))
register_node_opt("fedyogi")(_adaptive(lambda v, d2, p: v - (1 - p.beta2) * d2 * torch.sign(v - d2)))
