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

With ``proxy_train: async`` (``settings.proxy_async``) a server's TRAIN runs alongside
its children, from theta_t, and its result joins theta' like one more child, weighted
by its training rows; no TRAIN follows (ALGORITHMS.md: proxy training "on stale
parameters while its subtree executes").

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

Clients may drop out (``tree.clock.dropout_p``; ``virtual_clock.drops_out``, a draw from
(seed, client, round)): such a client is not trained, counts as dropped, and the round
waits for it on the virtual clock as for any call.

Resume: an execution is identified by (node, caller). Executed again by the same
caller after a crash, a node whose execution finished returns its saved result without
work, and one that was interrupted continues after its last saved round (its
down-aggregation is not repeated): ``NodeState.rounds_done_for``. Every random draw
depends only on (seed, node, round, caller), so the re-run reproduces the
uninterrupted run bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import torch

from bhfl_core.algorithm.node_state import ROOT_CALLER, Caller, NodeResult, NodeState, RoundKey
from bhfl_core.algorithm.node_step import ChildrenReport, ResidualPost, down_posts, node_down, node_up
from bhfl_core.algorithm.tree import Node, Tree
from bhfl_core.algorithm.virtual_clock import drops_out
from bhfl_core.rng import sample_cohort
from bhfl_core.store.node_store import StateStore


class PendingResult(Protocol):
    def result(self) -> NodeResult | None:
        """Wait for the work (it runs from the moment it was started); None: a child that failed and was dropped."""
        ...


class EngineHooks(Protocol):
    def run_children(self, node: Node, cohort: list[Node], theta: torch.Tensor, key: RoundKey) -> ChildrenReport:
        """Execute every child of the cohort from ``theta``; return their aggregate."""
        ...

    def train(self, node: Node, theta: torch.Tensor, key: RoundKey) -> tuple[torch.Tensor, dict[str, float]]:
        """TRAIN on the node's own data (private for clients, proxy for servers)."""
        ...

    def call_duration(self, node: Node, child: Node, caller: Caller) -> float | None:
        """A client call's virtual duration, known before it runs; None for servers (their result carries it)."""
        ...

    def start_train(self, node: Node, theta: torch.Tensor, key: RoundKey) -> PendingResult:
        """Begin a server's proxy TRAIN without waiting (``proxy_train: async``).

        Its result carries TRAIN's metrics (with ``Training/proxy_examples``, its weight) and
        its virtual duration (``Training/proxy_steps`` at speed 1).
        """
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
        return saved_result(state)
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
        proxy = hooks.start_train(node, state.theta, key) if settings.proxy_async else None
        present = [c for c in cohort if not drops_out(c.settings.dropout, seed, c.id, key.round)]
        report = hooks.run_children(node, present, state.theta, key) if present else None
        if len(present) < len(cohort):  # dropped out: never trained, known when the call would have ended
            report = add_dropouts(node, report, [c for c in cohort if c not in present], hooks, key)
        proxy_metrics: dict[str, float] = {}
        if proxy is not None:  # the node's own TRAIN, from theta_t, as one more child
            report = report or ChildrenReport()
            proxy_metrics = add_proxy_result(node, report, proxy)
        state, posts = node_up(state, report, store.inbox(node.id, "up", state.res_seen), settings, scorer)
        store.post(node.id, key.round, posts)
        metrics = round_metrics(node, cohort, report, posts)
        metrics.update(proxy_metrics)
        metrics.update(tuned_metrics(state))
        if settings.personal is not None:  # Ditto: v_k from its last value (first: theta) towards theta
            start = state.personal if state.personal is not None else state.theta
            personal, personal_metrics = hooks.train_personal(node, start, state.theta, key)
            state = replace(state, personal=personal)
            metrics.update(personal_metrics)
        train_s = 0.0
        if settings.train is not None and not settings.proxy_async:
            trained, train_metrics = hooks.train(node, state.theta, key)
            state = replace(state, model=trained)
            metrics.update(train_metrics)
            train_s = train_metrics.get(PROXY_STEPS, 0.0)
        elapsed += round_virtual_s(report, train_s)
        metrics[VIRTUAL_TIME] = elapsed
        state = replace(state, rounds_done=key.round + 1, metrics=metrics)
        store.commit(node.id, state, persist)
        hooks.round_done(node, key, state.theta, metrics)
    return saved_result(state)


VIRTUAL_TIME = "time/virtual_s"
"""Metric and state entry: virtual seconds since the node's execution began (the root's: since the run began)."""


def saved_result(state: NodeState) -> NodeResult:
    """The result of an execution that finished before a crash, as its caller first received it."""
    return NodeResult(state.theta, state.metrics, virtual_s=state.metrics.get(VIRTUAL_TIME, 0.0))


PROXY_STEPS = "Training/proxy_steps"
PROXY_EXAMPLES = "Training/proxy_examples"


def round_virtual_s(report: ChildrenReport | None, train_s: float) -> float:
    """A synchronous round on the virtual clock: its slowest child, then the node's own TRAIN (``train_s``).

    The node's own TRAIN (proxy training at a server) runs at speed 1: one optimizer
    step per virtual second, the median client speed (``virtual_clock.py``). An
    asynchronous proxy TRAIN runs alongside the children: it is in ``report.virtual_s``.
    """
    children = report.virtual_s if report is not None else 0.0
    return children + train_s


def add_dropouts(
    node: Node, report: ChildrenReport | None, absent: list[Node], hooks: EngineHooks, key: RoundKey
) -> ChildrenReport:
    """A synchronous round's clients that dropped out (``tree.clock.dropout_p``): dropped, waited for on the clock."""
    report = report or ChildrenReport()
    report.dropped.extend(c.id for c in absent)
    for child in absent:
        report.virtual_s = max(report.virtual_s, hooks.call_duration(node, child, key.as_caller()) or 0.0)
    return report


def proxy_weight(node: Node, result: NodeResult | None) -> float:
    """An asynchronous proxy TRAIN's weight among the children's results: the rows it trained on."""
    if result is None or not result.metrics.get(PROXY_EXAMPLES):
        raise RuntimeError(f"{node.id}: proxy TRAIN returned no result, or trained on no rows ({PROXY_EXAMPLES})")
    return result.metrics[PROXY_EXAMPLES]


def add_proxy_result(node: Node, report: ChildrenReport, pending: PendingResult) -> dict[str, float]:
    """Merge an asynchronous proxy TRAIN into a synchronous round's children; return its metrics."""
    result = pending.result()
    weight = proxy_weight(node, result)
    assert result is not None
    report.aggregate.add(result.theta, weight)
    report.virtual_s = max(report.virtual_s, result.virtual_s)
    return result.metrics


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
        metrics["Training/dropped_clients"] = float(dropped)
    if report is not None:
        metrics.update(report.metrics)
    return metrics
