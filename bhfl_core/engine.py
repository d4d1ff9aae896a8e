"""EXECUTENODE: the recursive B-HFL node program (ALGORITHMS.md, seeds/004 Algorithm 1).

::

    theta_0 = W_q                    (phi given: theta_0 = NODEOPT_down(q, W_q, [phi]))
    for t in 0..T_q-1:
        S        = sample(C_q, cohort)
        children = [EXECUTENODE(theta_t, c) for c in S]
        theta'   = NODEOPT_up(q, theta_t, children)      (leaves: theta' = theta_t)
        theta_t+1 = TRAIN(theta', Omega_q)                (no-op without data)
    W_q = theta_T;  return theta_T

This module holds the node program only. *Where* children run (Prefect subflows,
worker tasks, or plain recursion in tests) and *how* TRAIN is done are injected
through ``EngineHooks``, so the same function drives clients inside a worker, servers
inside subflows, and fake trees in unit tests.

Choices where ALGORITHMS.md is silent:
- A node with no model yet adopts ``phi`` (its first down-aggregation is a copy).
- ``persistent: false`` nodes start every execution from ``phi`` with fresh optimiser
  states; servers still save their latest model so it can be evaluated.
- The state is checkpointed after every node round (model, optimiser states and the
  round counter in one atomic file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from bhfl_core.aggregation import WeightedSum
from bhfl_core.node_opt import node_opt_step
from bhfl_core.rng import sample_cohort
from bhfl_core.state_store import NodeState, StateStore
from bhfl_core.tree import Node, Tree


@dataclass
class ChildrenReport:
    """What a round's children send up: their weighted models and training statistics."""

    aggregate: WeightedSum = field(default_factory=WeightedSum)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundKey:
    """Identifies one round of one node execution; seeds every draw in that round.

    ``round`` is the node's cumulative round index; ``caller`` identifies the parent
    round that triggered the execution (so non-persistent leaves, whose counter never
    advances, still get fresh draws every time they are called).
    """

    node_id: str
    round: int
    caller: str = ""

    def parts(self) -> tuple[str, int, str]:
        return (self.node_id, self.round, self.caller)


class EngineHooks(Protocol):
    def run_children(self, node: Node, cohort: list[Node], theta: torch.Tensor, key: RoundKey) -> ChildrenReport:
        """Execute every child of the cohort from ``theta``; return their aggregate."""
        ...

    def train(self, node: Node, theta: torch.Tensor, key: RoundKey) -> tuple[torch.Tensor, dict[str, float]]:
        """TRAIN on the node's own data (private for clients, proxy for servers)."""
        ...

    def round_done(self, node: Node, key: RoundKey, theta: torch.Tensor, metrics: dict[str, float]) -> None:
        """Called after each node round is checkpointed (logging, progress, evaluation)."""
        ...


def execute_node(
    tree: Tree,
    node: Node,
    phi: torch.Tensor | None,
    store: StateStore,
    hooks: EngineHooks,
    seed: int,
    caller: str = "",
) -> torch.Tensor:
    """Run one execution of ``node`` (T_q rounds) and return its final model theta_T."""
    settings = node.settings
    state = store.load(node.id)
    if not settings.persistent:
        state = NodeState(rounds_done=state.rounds_done)

    if phi is None:
        if state.model is None:
            raise ValueError(f"node {node.id!r} was executed without a parent model and has no model of its own")
        theta = state.model
    elif state.model is None:
        theta = phi.clone()
    else:
        opt_down, theta = node_opt_step(state.opt_down, state.model, phi, settings.opt_down)
        state = NodeState(state.model, state.opt_up, opt_down, state.rounds_done)

    children = tree.children(node.id)
    save = settings.persistent or not node.is_leaf
    for _ in range(settings.rounds):
        key = RoundKey(node.id, state.rounds_done, caller)
        metrics: dict[str, float] = {}
        opt_up = state.opt_up
        cohort = sample_cohort(children, settings.cohort, seed, node.id, key.round)
        if cohort:
            report = hooks.run_children(node, cohort, theta, key)
            opt_up, theta = node_opt_step(opt_up, theta, report.aggregate.mean(), settings.opt_up)
            metrics.update(report.metrics)
        if settings.train is not None:
            theta, train_metrics = hooks.train(node, theta, key)
            metrics.update(train_metrics)
        state = NodeState(theta, opt_up, state.opt_down, state.rounds_done + 1)
        if save:
            store.save(node.id, state)
        hooks.round_done(node, key, theta, metrics)
    return theta
