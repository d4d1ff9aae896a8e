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

Ditto clients (``settings.personal``) also train their personal model each round,
``v = TRAIN(v, Omega_q) with (lambda/2)·||v - theta'||²``, before the TRAIN of the
model they send up (both start from theta': Li et al. 2021, Algorithm 1).

``execute_node`` is that loop; the maths is in the pure steps of ``node_step.py``.
*Where* children run (Prefect subflows, worker tasks, or plain recursion in tests)
and *how* TRAIN is done are injected through ``EngineHooks``, so the same function
drives clients inside a worker, servers inside subflows, and fake trees in unit tests.
The store is the only place with side effects: it reads the inbox of residuals,
delivers posts, and commits each round's state in one atomic file (model, optimiser
states, round counter, the execution it belongs to), after which the residuals that
state consumed are deleted.

Resume: an execution is identified by (node, caller). Executed again by the same
caller after a crash, a node whose execution finished returns its saved result without
work, and one that was interrupted continues after its last saved round (its
down-aggregation is not repeated): ``NodeState.rounds_done_for``. Every random draw
depends only on (seed, node, round, caller), so the re-run reproduces the
uninterrupted run bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from bhfl_core.algorithm.node_state import ROOT_CALLER, Caller, NodeState, RoundKey
from bhfl_core.algorithm.node_step import ChildrenReport, ResidualPost, down_posts, node_down, node_up
from bhfl_core.algorithm.tree import Node, Tree
from bhfl_core.rng import sample_cohort
from bhfl_core.store.node_store import StateStore


@dataclass(frozen=True)
class NodeResult:
    """What an execution returns to its parent: theta_T, its last round's metrics, its virtual duration.

    ``virtual_s``: seconds the execution took on the virtual clock (asynchronous
    execution, ``async_engine.py``); 0 where no clock runs.
    """

    theta: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    virtual_s: float = 0.0


class EngineHooks(Protocol):
    def run_children(self, node: Node, cohort: list[Node], theta: torch.Tensor, key: RoundKey) -> ChildrenReport:
        """Execute every child of the cohort from ``theta``; return their aggregate."""
        ...

    def train(self, node: Node, theta: torch.Tensor, key: RoundKey) -> tuple[torch.Tensor, dict[str, float]]:
        """TRAIN on the node's own data (private for clients, proxy for servers)."""
        ...

    def round_done(self, node: Node, key: RoundKey, theta: torch.Tensor, metrics: dict[str, float]) -> None:
        """Called after each node round is committed (logging, progress, evaluation)."""
        ...

    def score(self, node: Node, candidates: Sequence[torch.Tensor]) -> list[float]:
        """Losses of candidate models on the node's held-out data (tuned NODEOPTs such as ``interp``)."""
        ...

    def train_personal(
        self, node: Node, personal: torch.Tensor, anchor: torch.Tensor, key: RoundKey
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Ditto: TRAIN a client's personal model with ``(mu/2)·||v - anchor||²`` (``settings.personal``)."""
        ...


def execute_node(
    tree: Tree,
    node: Node,
    phi: torch.Tensor | None,
    store: StateStore,
    hooks: EngineHooks,
    seed: int,
    caller: Caller = ROOT_CALLER,
) -> NodeResult:
    """Run one execution of ``node`` (T_q rounds), or finish it after a crash; return theta_T."""
    settings = node.settings
    state = store.load(node.id)
    done = state.rounds_done_for(caller)
    if done >= settings.rounds:  # finished before a crash: hand back the saved result
        return NodeResult(state.theta, state.metrics)
    scorer = functools.partial(hooks.score, node) if settings.tunes else None
    if not done:
        state = node_down(state, phi, store.inbox(node.id, "down", state.res_seen), settings, caller, scorer)
    # Receivers of residuals keep their bookkeeping, and Ditto clients their personal model, even when not persistent.
    persist = settings.persistent or not node.is_leaf or bool(settings.res_in) or settings.personal is not None
    children = tree.children(node.id)
    elapsed = state.metrics.get(VIRTUAL_TIME, 0.0) if done else 0.0  # virtual seconds since the execution began
    for _ in range(done, settings.rounds):
        key = RoundKey(node.id, state.rounds_done, caller)
        store.post(node.id, key.round, down_posts(state.theta, settings))
        cohort = sample_cohort(children, settings.cohort, seed, node.id, key.round)
        report = hooks.run_children(node, cohort, state.theta, key) if cohort else None
        state, posts = node_up(state, report, store.inbox(node.id, "up", state.res_seen), settings, scorer)
        store.post(node.id, key.round, posts)
        metrics = round_metrics(node, cohort, report, posts)
        metrics.update(tuned_metrics(state))
        if settings.personal is not None:  # Ditto: v_k from its last value (first: theta) towards theta
            start = state.personal if state.personal is not None else state.theta
            personal, personal_metrics = hooks.train_personal(node, start, state.theta, key)
            state = replace(state, personal=personal)
            metrics.update(personal_metrics)
        if settings.train is not None:
            trained, train_metrics = hooks.train(node, state.theta, key)
            state = replace(state, model=trained)
            metrics.update(train_metrics)
        elapsed += round_virtual_s(report, metrics)
        metrics[VIRTUAL_TIME] = elapsed
        state = replace(state, rounds_done=key.round + 1, metrics=metrics)
        store.commit(node.id, state, persist)
        hooks.round_done(node, key, state.theta, metrics)
    return NodeResult(state.theta, state.metrics, virtual_s=state.metrics.get(VIRTUAL_TIME, 0.0))


VIRTUAL_TIME = "time/virtual_s"
"""Metric and state entry: virtual seconds since the node's execution began (the root's: since the run began)."""


def round_virtual_s(report: ChildrenReport | None, metrics: Mapping[str, float]) -> float:
    """A synchronous round on the virtual clock: its slowest child, then the node's own TRAIN.

    The node's own TRAIN (proxy training at a server) runs at speed 1: one optimizer
    step per virtual second, the median client speed (``virtual_clock.py``).
    """
    children = report.virtual_s if report is not None else 0.0
    return children + metrics.get("proxy_train/steps", 0.0)


def tuned_metrics(state: NodeState) -> dict[str, float]:
    """The ``alpha`` each tuned NODEOPT (``interp``) last chose: ``opt/alpha_up``, ``_down``, ``_<residual kind>``."""
    opts = {"up": state.opt_up, "down": state.opt_down, **state.opt_res}
    return {f"opt/alpha_{name}": float(opt["alpha"]) for name, opt in opts.items() if "alpha" in opt}


def round_metrics(
    node: Node, cohort: list[Node], report: ChildrenReport | None, posts: list[ResidualPost]
) -> dict[str, float]:
    """A round's communication (in models, i.e. flat vectors), dropped clients and the children's statistics."""
    metrics: dict[str, float] = {}
    dropped = len(report.dropped) if report is not None else 0
    if not node.is_leaf:
        metrics.update(
            {
                "comm/down_models": float(len(cohort)),
                "comm/up_models": float(len(cohort) - dropped),
                "comm/res_down_models": float(len(node.settings.res_down)),
                "comm/res_up_models": float(sum(p.models for p in posts)),
            }
        )
    if dropped:
        metrics["train/dropped_clients"] = float(dropped)
    if report is not None:
        metrics.update(report.metrics)
    return metrics
