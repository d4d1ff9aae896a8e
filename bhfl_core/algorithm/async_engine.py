"""EXECUTENODE for an asynchronous node (FedBuff at any depth; ALGORITHMS.md, issue 14).

::

    theta_0 = NODEOPT_down(q, W_q, [phi], R_down[q])           (as in the synchronous engine)
    keep up to `concurrency` children in flight, each sent the node's newest model
    until T_q flushes are done:
        take the result that finishes first on the virtual clock
        buffer Delta_i = y_i - theta_{v_i}, staleness s_i = v - v_i
        every `buffer` results:  theta_{v+1} = NODEOPT_up(q, theta_v, theta_v + sum p w(s) Delta / sum p, R_up[q])
                                 then TRAIN(theta_{v+1}, Omega_q); commit; re-dispatch free children
    W_q = theta_T;  return theta_T  (and the virtual time the execution took)

Order comes from the virtual clock (``virtual_clock.py``), never from which real call
returns first: a child's finish time is its dispatch time plus its virtual duration,
known at dispatch for clients (``AsyncHooks.call_duration``) and from the returned
``NodeResult.virtual_s`` for servers. Which idle child is sent next is a draw seeded by
(seed, node, dispatch number), and a child's execution is keyed by ``Caller(node,
dispatch)``. So the same config and seed give the same sequence of flushes however
fast the real workers are, while the real calls of all in-flight children run at once.

Choices where FedBuff is silent (docs/algorithm.md):
- the version ``v`` is the node's round counter (flushes), so staleness is counted in
  the node's own model versions;
- a result is buffered with the child's example weight ``p_i`` (``asynchrony.py``);
- at the end of an execution (T_q flushes) the children still in flight are awaited
  and their results dropped (``async/dropped_results``): an execution hands its parent
  a model, not pending work; the next execution starts with an empty buffer.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from bhfl_core.algorithm.asynchrony import AsyncParams, BufferedResult, buffered_input
from bhfl_core.algorithm.engine import VIRTUAL_TIME, EngineHooks, NodeResult, tuned_metrics
from bhfl_core.algorithm.node_state import ROOT_CALLER, Caller, RoundKey
from bhfl_core.algorithm.node_step import ChildrenReport, down_posts, node_down, node_up
from bhfl_core.algorithm.residuals import Candidate
from bhfl_core.algorithm.tree import Node, Tree
from bhfl_core.rng import generator
from bhfl_core.store.node_store import StateStore


@dataclass(frozen=True)
class InFlight:
    """A child execution the node has sent out and not yet used."""

    child: str
    dispatch: int  # the node's running dispatch number: the child's caller is Caller(node, dispatch)
    version: int  # the node's model version the child was sent
    start: float  # virtual time it was sent (seconds since the node's execution began)
    finish: float | None  # virtual time its result arrives; None until a server child's duration is known


class ChildCall(Protocol):
    def result(self) -> NodeResult | None:
        """Wait for the child's execution (it runs from the moment it was started).

        None: the child failed and was dropped (``runtime.on_client_failure: drop``).
        """
        ...


class AsyncHooks(EngineHooks, Protocol):
    def start_child(self, node: Node, child: Node, theta: torch.Tensor, caller: Caller) -> ChildCall:
        """Begin executing ``child`` from ``theta`` without waiting for it."""
        ...

    def call_duration(self, node: Node, child: Node, caller: Caller) -> float | None:
        """The child call's virtual duration when known before it runs (clients), else None (servers)."""
        ...


def pick_idle(children: Sequence[Node], busy: set[str], seed: int, node_id: str, dispatch: int) -> Node | None:
    """The child to send dispatch number ``dispatch`` to: uniform over the idle ones, in child order."""
    idle = [c for c in children if c.id not in busy]
    if not idle:
        return None
    return idle[int(generator(seed, "dispatch", node_id, dispatch).integers(len(idle)))]


def next_arrival(in_flight: Sequence[InFlight]) -> InFlight:
    """The in-flight child whose result the virtual clock delivers first (ties: earlier dispatch)."""
    known = [f for f in in_flight if f.finish is not None]
    if len(known) != len(in_flight):
        raise ValueError("every in-flight finish time must be known before choosing the next arrival")
    return min(known, key=lambda f: (f.finish, f.dispatch))


@dataclass
class _Execution:
    """The mutable bookkeeping of one asynchronous execution (not yet checkpointed: see module docstring)."""

    now: float = 0.0
    dispatched: int = 0
    in_flight: list[InFlight] = field(default_factory=list)
    calls: dict[int, ChildCall] = field(default_factory=dict)
    buffer: list[BufferedResult] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)
    models: dict[int, torch.Tensor] = field(default_factory=dict)  # versions in-flight children were sent
    staleness: list[int] = field(default_factory=list)  # of the results buffered since the last flush
    sent: int = 0  # models sent to children since the last flush
    dropped: int = 0  # failed children left out since the last flush
    drops_in_a_row: int = 0


def execute_async_node(
    tree: Tree,
    node: Node,
    phi: torch.Tensor | None,
    store: StateStore,
    hooks: AsyncHooks,
    seed: int,
    caller: Caller = ROOT_CALLER,
) -> NodeResult:
    """Run one asynchronous execution of ``node`` (T_q flushes); return theta_T and its virtual duration."""
    settings = node.settings
    params = settings.asynchronous
    if params is None:
        raise ValueError(f"node {node.id!r} is not asynchronous (settings.asynchronous is None)")
    state = store.load(node.id)
    done = state.rounds_done_for(caller)
    if done >= settings.rounds:
        return NodeResult(state.theta, state.metrics)
    if done:
        raise NotImplementedError("resuming an interrupted asynchronous execution: in-flight work is not saved yet")
    scorer = functools.partial(hooks.score, node) if settings.tunes else None
    state = node_down(state, phi, store.inbox(node.id, "down", state.res_seen), settings, caller, scorer)
    children = {c.id: c for c in tree.children(node.id)}
    run = _Execution(models={state.rounds_done: state.theta})
    dropped_total = 0
    while state.rounds_done - state.exec_start < settings.rounds:
        key = RoundKey(node.id, state.rounds_done, caller)
        store.post(node.id, key.round, down_posts(state.theta, settings))
        while len(run.buffer) < params.buffer:
            _fill(run, node, list(children.values()), state.rounds_done, state.theta, hooks, seed, params)
            arrival = _await_next(run, node, children, hooks)
            result = run.calls.pop(arrival.dispatch).result()
            run.in_flight.remove(arrival)
            run.now = max(run.now, arrival.finish or 0.0)
            child = children[arrival.child]
            if result is None:  # dropped: its slot frees up, nothing is buffered
                run.dropped += 1
                run.drops_in_a_row += 1
                if run.drops_in_a_row >= len(children):
                    raise RuntimeError(f"{node.id}: {run.drops_in_a_row} child results in a row were dropped (failed)")
                continue
            run.drops_in_a_row = 0
            staleness = state.rounds_done - arrival.version
            run.buffer.append(
                BufferedResult(child.id, result.theta - run.models[arrival.version], child.weight, staleness)
            )
            if settings.res_up:
                loss = result.metrics.get("train/loss", float("nan"))
                run.candidates.append(Candidate(child.id, result.theta, child.weight, loss))
            run.staleness.append(staleness)
            _forget_unused_versions(run, state.rounds_done)
        report = ChildrenReport(candidates=run.candidates)
        report.aggregate.add(buffered_input(state.theta, run.buffer, params.staleness), 1.0)
        state, posts = node_up(state, report, store.inbox(node.id, "up", state.res_seen), settings, scorer)
        store.post(node.id, key.round, posts)
        metrics = _flush_metrics(run, posts)
        metrics.update(tuned_metrics(state))
        if settings.train is not None:
            trained, train_metrics = hooks.train(node, state.theta, key)
            state = replace(state, model=trained)
            metrics.update(train_metrics)
            run.now += train_metrics.get("proxy_train/steps", 0.0)  # speed 1, as in engine.round_virtual_s
            metrics[VIRTUAL_TIME] = run.now
        run.buffer, run.candidates, run.staleness, run.sent, run.dropped = [], [], [], 0, 0
        state = replace(state, rounds_done=key.round + 1, metrics=metrics)
        run.models[state.rounds_done] = state.theta
        store.commit(node.id, state)
        hooks.round_done(node, key, state.theta, metrics)
    for flight in run.in_flight:  # an execution returns a model, not pending work
        run.calls.pop(flight.dispatch).result()
        dropped_total += 1
    metrics = {**state.metrics, "async/dropped_results": float(dropped_total)}
    return NodeResult(state.theta, metrics, virtual_s=run.now)


def _fill(
    run: _Execution,
    node: Node,
    children: list[Node],
    version: int,
    theta: torch.Tensor,
    hooks: AsyncHooks,
    seed: int,
    params: AsyncParams,
) -> None:
    """Send the newest model to idle children until ``concurrency`` are in flight (or none is idle)."""
    while len(run.in_flight) < params.concurrency:
        busy = {f.child for f in run.in_flight}
        child = pick_idle(children, busy, seed, node.id, run.dispatched)
        if child is None:
            return
        caller = Caller(node.id, run.dispatched)
        run.calls[run.dispatched] = hooks.start_child(node, child, theta, caller)
        duration = hooks.call_duration(node, child, caller)
        finish = None if duration is None else run.now + duration
        run.in_flight.append(InFlight(child.id, run.dispatched, version, run.now, finish))
        run.models.setdefault(version, theta)
        run.dispatched += 1
        run.sent += 1


def _await_next(run: _Execution, node: Node, children: Mapping[str, Node], hooks: AsyncHooks) -> InFlight:
    """The next arrival, after learning the durations of server children (their results carry them)."""
    for i, flight in enumerate(run.in_flight):
        if flight.finish is None:
            result = run.calls[flight.dispatch].result()
            duration = result.virtual_s if result is not None else 0.0
            run.in_flight[i] = replace(flight, finish=flight.start + duration)
    return next_arrival(run.in_flight)


def _forget_unused_versions(run: _Execution, current: int) -> None:
    keep = {f.version for f in run.in_flight} | {current}
    for version in [v for v in run.models if v not in keep]:
        del run.models[version]


def _flush_metrics(run: _Execution, posts: Sequence[object]) -> dict[str, float]:
    staleness = run.staleness
    return {
        "async/buffered": float(len(run.buffer)),
        "async/staleness_mean": sum(staleness) / len(staleness),
        "async/staleness_max": float(max(staleness)),
        "async/in_flight": float(len(run.in_flight)),
        VIRTUAL_TIME: run.now,
        "comm/down_models": float(run.sent),
        "train/dropped_clients": float(run.dropped),
        "comm/up_models": float(len(run.buffer)),
        "comm/res_up_models": float(sum(getattr(p, "models", 0) for p in posts)),
    }
