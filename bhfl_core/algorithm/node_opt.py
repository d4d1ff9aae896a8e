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

``interp`` (APFL-style model interpolation, Deng et al. 2020) is the one *tuned*
NODEOPT: ``theta + (1 - alpha) * Delta = alpha * theta + (1 - alpha) * mean_input``,
with ``alpha`` chosen every step from the grid ``alphas`` as the candidate with the
lowest loss on the node's held-out data. The step cannot see data, so the caller
passes a ``Scorer`` (losses of candidate models); ``alpha`` is kept in the state, so
it is checkpointed and logged. A grid rather than APFL's gradient step on ``alpha``:
it needs no gradient through the interpolation, is exact at ``alpha`` 0 (adopt the
input) and 1 (keep the own model), and one forward pass per candidate on a few held-out
rows costs little next to TRAIN. Unlike APFL, no separate local model is trained through
the mixture and the mixture is the node's model itself (a client TRAINs it and sends it
up): docs/algorithm.md, "How it differs from APFL".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported by the steps: configs validate NODEOPT names without loading torch
    import torch

OptState = dict[str, "torch.Tensor"]


@dataclass(frozen=True)
class NodeOptParams:
    """Hyperparameters of one NODEOPT instance (one node, one direction)."""

    kind: str = "fedavg"
    eta: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    alphas: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)  # interp: the grid alpha is chosen from


Scorer = Callable[[Sequence["torch.Tensor"]], list[float]]
"""Losses of candidate models on the node's held-out data (lower is better), one per candidate."""

StepFn = Callable[
    [OptState, "torch.Tensor", "torch.Tensor", NodeOptParams, Scorer | None], tuple[OptState, "torch.Tensor"]
]
_REGISTRY: dict[str, StepFn] = {}
_TUNED: set[str] = set()


def register_node_opt(name: str, tuned: bool = False) -> Callable[[StepFn], StepFn]:
    """Register a step function under ``name``; returns the function unchanged.

    ``tuned``: the step scores candidates on held-out data, so it is called with a ``Scorer``.
    """
    if not name.isidentifier():
        raise ValueError(f"NODEOPT name must be an identifier, got {name!r}")

    def decorate(fn: StepFn) -> StepFn:
        if name in _REGISTRY:
            raise ValueError(f"NODEOPT {name!r} is already registered")
        _REGISTRY[name] = fn
        if tuned:
            _TUNED.add(name)
        return fn

    return decorate


def available_node_opts() -> list[str]:
    return sorted(_REGISTRY)


def is_tuned(kind: str) -> bool:
    """Whether NODEOPT ``kind`` needs held-out data (a ``Scorer``) at its node."""
    return kind in _TUNED


def node_opt_step(
    state: OptState,
    theta: torch.Tensor,
    mean_input: torch.Tensor,
    params: NodeOptParams,
    scorer: Scorer | None = None,
) -> tuple[OptState, torch.Tensor]:
    """One NODEOPT step: returns ``(new_state, new_theta)``; inputs are not modified.

    ``scorer`` is used only by tuned kinds (``interp``), which fail without one.
    """
    if theta.shape != mean_input.shape:
        raise ValueError(f"NODEOPT input shape {tuple(mean_input.shape)} != model shape {tuple(theta.shape)}")
    try:
        fn = _REGISTRY[params.kind]
    except KeyError:
        raise ValueError(f"unknown NODEOPT kind {params.kind!r}; available: {available_node_opts()}") from None
    return fn(state, theta, mean_input, params, scorer)


def _count(state: OptState) -> torch.Tensor:
    import torch

    return state.get("step", torch.zeros((), dtype=torch.int64)) + 1


@register_node_opt("fedavg")
def fedavg(
    state: OptState, theta: torch.Tensor, mean_input: torch.Tensor, p: NodeOptParams, scorer: Scorer | None
) -> tuple[OptState, torch.Tensor]:
    import torch

    if p.eta == 1.0:  # HierFAVG's "replace": the input itself (lerp would copy it, bit for bit)
        return {"step": _count(state)}, mean_input
    return {"step": _count(state)}, torch.lerp(theta, mean_input, p.eta)


@register_node_opt("fedavgm")
def fedavgm(
    state: OptState, theta: torch.Tensor, mean_input: torch.Tensor, p: NodeOptParams, scorer: Scorer | None
) -> tuple[OptState, torch.Tensor]:
    delta = mean_input - theta
    m = p.beta1 * state["m"] + delta if "m" in state else delta
    return {"step": _count(state), "m": m}, theta + p.eta * m


def _adaptive(update_v: Callable[[torch.Tensor, torch.Tensor, NodeOptParams], torch.Tensor]) -> StepFn:
    def step(
        state: OptState, theta: torch.Tensor, mean_input: torch.Tensor, p: NodeOptParams, scorer: Scorer | None
    ) -> tuple[OptState, torch.Tensor]:
        import torch

        delta = mean_input - theta
        m = p.beta1 * state.get("m", torch.zeros_like(delta)) + (1 - p.beta1) * delta
        v = update_v(state.get("v", torch.zeros_like(delta)), delta * delta, p)
        return {"step": _count(state), "m": m, "v": v}, theta + p.eta * m / (v.sqrt() + p.tau)

    return step


register_node_opt("fedadagrad")(_adaptive(lambda v, d2, p: v + d2))
register_node_opt("fedadam")(_adaptive(lambda v, d2, p: p.beta2 * v + (1 - p.beta2) * d2))
register_node_opt("fedyogi")(_adaptive(lambda v, d2, p: v - (1 - p.beta2) * d2 * (v - d2).sign()))


@register_node_opt("interp", tuned=True)
def interp(
    state: OptState, theta: torch.Tensor, mean_input: torch.Tensor, p: NodeOptParams, scorer: Scorer | None
) -> tuple[OptState, torch.Tensor]:
    """``alpha * theta + (1 - alpha) * mean_input`` for the grid's ``alpha`` with the lowest held-out loss.

    Ties (and all-NaN losses, e.g. no held-out rows) go to the first ``alpha`` of the grid.
    """
    if scorer is None:
        raise ValueError("NODEOPT interp tunes alpha on held-out data, but this node has none to score on")
    import torch

    # lerp(input, theta, a) = input + a (theta - input): exactly the input at a = 0 and theta at a = 1
    candidates = [torch.lerp(mean_input, theta, a) for a in p.alphas]
    losses = [math.inf if math.isnan(x) else x for x in scorer(candidates)]
    best = min(range(len(candidates)), key=losses.__getitem__)
    alpha = torch.tensor(p.alphas[best], dtype=torch.float64)
    return {"step": _count(state), "alpha": alpha}, candidates[best]
