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
- The state is checkpointed after every node round (model, optimiser states, the
  round counter and the execution it belongs to, in one atomic file).
- A node with no model yet still folds its waiting down-residuals into ``phi``.

Resume: an execution is identified by (node, caller), where the caller is the parent
round that triggered it. Executed again with the same caller (a re-run after a crash),
a node whose execution finished returns its saved result without work, and one that
was interrupted continues after its last saved round (its down-aggregation is not
repeated). Every random draw depends only on (seed, node, round, caller), so the
re-run reproduces the uninterrupted run bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

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
    dropped: list[str] = field(default_factory=list)  # children that failed and were left out


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


@dataclass(frozen=True)
class NodeResult:
    """What an execution returns to its parent: theta_T and its last round's metrics."""

    theta: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


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
) -> NodeResult:
    """Run one execution of ``node`` (T_q rounds), or finish it after a crash; return theta_T."""
    settings = node.settings
    stored = store.load(node.id)
    done = stored.execution_rounds_done(caller)
    if done >= settings.rounds:  # finished before a crash: hand back the saved result
        assert stored.model is not None
        return NodeResult(stored.model, stored.metrics)
    # Receivers of residuals keep their bookkeeping even when not persistent.
    save = settings.persistent or not node.is_leaf or bool(settings.res_in)

    if done:  # interrupted mid-execution: continue after the last saved round
        state = stored
        theta = stored.model
        assert theta is not None
    else:
        state = stored if settings.persistent else NodeState(rounds_done=stored.rounds_done, res_seen=stored.res_seen)
        opt_res, seen = dict(state.opt_res), dict(state.res_seen)
        opt_down = state.opt_down
        if phi is None:
            if state.model is None:
                raise ValueError(f"node {node.id!r} was executed without a parent model and has no model of its own")
            theta = state.model
        else:
            if state.model is None:
                theta = phi.clone()
            else:
                opt_down, theta = node_opt_step(state.opt_down, state.model, phi, settings.opt_down)
            base = phi if state.model is None else state.model
            theta = _fold_residuals(node, store, "down", base, theta, opt_res, seen)
        state = replace(state, opt_down=opt_down, opt_res=opt_res, res_seen=seen,
                        exec_caller=caller, exec_start=state.rounds_done)

    children = tree.children(node.id)
    for _ in range(done, settings.rounds):
        key = RoundKey(node.id, state.rounds_done, caller)
        metrics: dict[str, float] = {}
        opt_up, opt_res, seen = state.opt_up, dict(state.opt_res), dict(state.res_seen)
        for link in settings.res_down:
            down = WeightedSum()
            down.add(theta, 1.0)
            store.post_residual(link.target, link.key, node.id, key.round, down)
        cohort = sample_cohort(children, settings.cohort, seed, node.id, key.round)
        if not node.is_leaf:  # communication, in models (flat vectors): what this round moved
            metrics.update({"comm/down_models": float(len(cohort)), "comm/up_models": float(len(cohort)),
                            "comm/res_down_models": float(len(settings.res_down)), "comm/res_up_models": 0.0})
        report = hooks.run_children(node, cohort, theta, key) if cohort else None
        if report is not None and report.dropped:
            metrics["comm/up_models"] -= len(report.dropped)
            metrics["train/dropped_clients"] = float(len(report.dropped))
        if report is not None and report.aggregate.empty:  # every child failed and was dropped
            metrics.update(report.metrics)
        elif report is not None:
            mean_input = report.aggregate.mean()
            for link in settings.res_up:
                chosen = select_residuals(report.candidates, theta, link.k, link.select, mean_input)
                if chosen:
                    store.post_residual(link.target, link.key, node.id, key.round, contribution(chosen, link.combine))
                    metrics["comm/res_up_models"] += 1.0 if link.combine == "mean" else float(len(chosen))
            opt_up, stepped = node_opt_step(opt_up, theta, mean_input, settings.opt_up)
            theta = _fold_residuals(node, store, "up", theta, stepped, opt_res, seen)
            metrics.update(report.metrics)
        if settings.train is not None:
            theta, train_metrics = hooks.train(node, theta, key)
            metrics.update(train_metrics)
        state = replace(state, model=theta, opt_up=opt_up, rounds_done=state.rounds_done + 1,
                        opt_res=opt_res, res_seen=seen, metrics=metrics)
        if save:
            store.save(node.id, state)
        store.drop_consumed(node.id, state.res_seen)
        hooks.round_done(node, key, theta, metrics)
    return NodeResult(theta, state.metrics)


def _fold_residuals(
    node: Node,
    store: StateStore,
    direction: str,
    base: torch.Tensor,
    stepped: torch.Tensor,
    opt_res: dict[str, OptState],
    seen: dict[str, int],
) -> torch.Tensor:
    """Add each waiting residual kind's NODEOPT step (taken from ``base``) to ``stepped``.

    Updates ``opt_res`` and ``seen`` (what was consumed) in place. With nothing waiting,
    ``stepped`` is returned untouched (bit-exact FedAvg replacement).
    """
    theta = stepped
    for kind, (acc, read) in store.pending_residuals(node.id, direction, seen).items():
        opt_res[kind], moved = node_opt_step(opt_res.get(kind, {}), base, acc.mean(), node.settings.residual_opt(kind))
        theta = theta + (moved - base)
        seen.update(read)
    return theta
