"""EXECUTENODE: the recursive B-HFL node program (ALGORITHMS.md, seeds/004 Algorithm 1).

::

    theta_0 = W_q                    (phi given: theta_0 = NODEOPT_down(q, W_q, [phi], R_down[q]))
    for t in 0..T_q-1:
        for d in DescRes[q]: R_down[d].append(theta_t)
        S        = sample(C_q, cohort)
        children = [EXECUTENODE(theta_t, c) for c in S]
        for a in AncRes[q]: R_up[a].extend(SELECTRESIDUALS(q, children))
        theta'   = NODEOPT_up(q, theta_t, children, R_up[q])   (leaves: theta' = theta_t)
        theta_t+1 = TRAIN(theta', Omega_q)                     (no-op without data)
    W_q = theta_T;  return theta_T

Residual inputs: each kind (one per residual rule) is averaged into its own
pseudo-gradient and stepped by its own optimiser state at the receiving node; the step
is added to the regular one: ``theta + (regular - theta) + sum_k (step_k - theta)``.
Accumulators live in the state store and are emptied once the state that consumed
them is saved.

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
- A node with no model yet still folds its waiting down-residuals into ``phi``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from pathlib import Path

from bhfl_core.aggregation import WeightedSum
from bhfl_core.node_opt import OptState, node_opt_step
from bhfl_core.residuals import Candidate, contribution, select_residuals
from bhfl_core.rng import sample_cohort
from bhfl_core.state_store import NodeState, StateStore
from bhfl_core.tree import Node, Tree


@dataclass
class ChildrenReport:
    """What a round's children send up: their weighted models and training statistics.

    ``candidates`` holds the children's models that up-residual selection may pick from
    (workers keep only their running top-K, so it stays small); empty when the node
    sends no up-residuals.
    """

    aggregate: WeightedSum = field(default_factory=WeightedSum)
    metrics: dict[str, float] = field(default_factory=dict)
    candidates: list[Candidate] = field(default_factory=list)


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
    opt_res = dict(state.opt_res)
    consumed: list[Path] = []

    if phi is None:
        if state.model is None:
            raise ValueError(f"node {node.id!r} was executed without a parent model and has no model of its own")
        theta = state.model
    else:
        if state.model is None:
            theta = phi.clone()
            opt_down = state.opt_down
        else:
            opt_down, theta = node_opt_step(state.opt_down, state.model, phi, settings.opt_down)
        base = phi if state.model is None else state.model
        theta = _fold_residuals(node, store, "down", base, theta, opt_res, consumed)
        state = NodeState(state.model, state.opt_up, opt_down, state.rounds_done, opt_res)

    children = tree.children(node.id)
    save = settings.persistent or not node.is_leaf
    for _ in range(settings.rounds):
        key = RoundKey(node.id, state.rounds_done, caller)
        tag = f"{node.id}.{key.round:06d}"
        metrics: dict[str, float] = {}
        opt_up = state.opt_up
        for link in settings.res_down:
            down = WeightedSum()
            down.add(theta, 1.0)
            store.post_residual(link.target, link.key, tag, down)
        cohort = sample_cohort(children, settings.cohort, seed, node.id, key.round)
        if not node.is_leaf:  # communication, in models (flat vectors): what this round moved
            metrics.update({"comm/down_models": float(len(cohort)), "comm/up_models": float(len(cohort)),
                            "comm/res_down_models": float(len(settings.res_down)), "comm/res_up_models": 0.0})
        if cohort:
            report = hooks.run_children(node, cohort, theta, key)
            mean_input = report.aggregate.mean()
            for link in settings.res_up:
                chosen = select_residuals(report.candidates, theta, link.k, link.select, mean_input)
                if chosen:
                    store.post_residual(link.target, link.key, tag, contribution(chosen, link.combine))
                    metrics["comm/res_up_models"] += 1.0 if link.combine == "mean" else float(len(chosen))
            opt_up, stepped = node_opt_step(opt_up, theta, mean_input, settings.opt_up)
            theta = _fold_residuals(node, store, "up", theta, stepped, opt_res, consumed)
            metrics.update(report.metrics)
        if settings.train is not None:
            theta, train_metrics = hooks.train(node, theta, key)
            metrics.update(train_metrics)
        state = NodeState(theta, opt_up, state.opt_down, state.rounds_done + 1, dict(opt_res))
        if save:
            store.save(node.id, state)
        store.consume(consumed)
        consumed.clear()
        hooks.round_done(node, key, theta, metrics)
    return theta


def _fold_residuals(
    node: Node,
    store: StateStore,
    direction: str,
    base: torch.Tensor,
    stepped: torch.Tensor,
    opt_res: dict[str, OptState],
    consumed: list[Path],
) -> torch.Tensor:
    """Add each waiting residual kind's NODEOPT step (taken from ``base``) to ``stepped``.

    Updates ``opt_res`` in place and records the accumulator files read in ``consumed``.
    With nothing waiting, ``stepped`` is returned untouched (bit-exact FedAvg replacement).
    """
    theta = stepped
    for kind, (acc, files) in store.pending_residuals(node.id, direction).items():
        opt_res[kind], moved = node_opt_step(opt_res.get(kind, {}), base, acc.mean(), node.settings.residual_opt(kind))
        theta = theta + (moved - base)
        consumed.extend(files)
    return theta
