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
- a result is buffered with the child's example weight ``p_i`` (``asynchrony.py``), and a child
  sent the model again after its result arrived may be buffered again before the flush;
- no staleness bound: every arrival is used, shrunk by ``w(s)`` only;
- an up-residual candidate is the result as folded, ``theta_v + w(s_i) Delta_i`` (``_buffer``);
- at the end of an execution (T_q flushes) the children still in flight are awaited
  and their results dropped (``async/dropped_results``): an execution hands its parent
  a model, not pending work; the next execution starts with an empty buffer;
- a client call that drops out (``tree.clock.dropout_p``) is never started; it holds its
  slot until it would have ended and buffers nothing, and is no failure (a streak of
  failures stops the run; dropouts do not);
- dispatch numbers count on across executions (``AsyncProgress.dispatched``), so no two
  dispatches of a node ever give a child the same caller.

Resume: each flush commits, with the node's state, the children in flight, the model
versions they were sent, the clock and the dispatch counter (``AsyncProgress``). Every
result used between flushes is saved first (``ExecutionStore.save_result``), before its
child can be dispatched again. A re-run after a crash restarts the in-flight children
with their callers (a child's own resume rule finishes or repeats its execution) and
replays the arrivals since the last flush from the saved results, so it reaches the
same flushes bit for bit. The last flush commits only after the children still in
flight have finished, so a persistent child's state never runs ahead of its parent's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from bhfl_core.algorithm.aggregation_rule import FoldedRound
from bhfl_core.algorithm.asynchrony import AsyncParams, stale_model, staleness_weight
from bhfl_core.algorithm.contract import ROOT_PLAN, ChildResult, Partial, RoundPlan
from bhfl_core.algorithm.engine import load_for_execution, proxy_child, proxy_metrics, saved_result, send_up
from bhfl_core.algorithm.engine_hooks import EngineHooks, PendingResult, PendingTrain
from bhfl_core.algorithm.node_opt import Scorer
from bhfl_core.algorithm.node_state import AsyncProgress, Caller, InFlight, NodeResult, NodeState, RoundKey
from bhfl_core.algorithm.node_step import down_posts, node_down
from bhfl_core.algorithm.residuals import Candidate
from bhfl_core.algorithm.round_tail import VIRTUAL_TIME, RoundScope, Traffic, round_tail
from bhfl_core.algorithm.rule_registry import AggregationRule
from bhfl_core.algorithm.rules import rule_for
from bhfl_core.algorithm.store_protocol import ExecutionStore
from bhfl_core.algorithm.tree import Node, Tree
from bhfl_core.algorithm.virtual_clock import drops_out
from bhfl_core.rng import generator


class AsyncHooks(EngineHooks, Protocol):
    def start_child(self, node: Node, child: Node, theta: torch.Tensor, plan: RoundPlan) -> PendingResult:
        """Begin executing ``child`` from ``theta`` under ``plan`` without waiting for it."""
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
    """The mutable bookkeeping of one asynchronous execution; its part that outlives a flush is ``AsyncProgress``."""

    now: float = 0.0
    dispatched: int = 0
    in_flight: list[InFlight] = field(default_factory=list)
    calls: dict[int, PendingResult] = field(default_factory=dict)
    partial: Partial | None = None  # the buffered results since the last flush, folded by the node's rule
    buffered: list[str] = field(default_factory=list)  # who they came from (the node itself: its proxy TRAIN)
    candidates: list[Candidate] = field(default_factory=list)
    models: dict[int, torch.Tensor] = field(default_factory=dict)  # versions in-flight children were sent
    staleness: list[int] = field(default_factory=list)  # of the results buffered since the last flush
    sent_bytes: int = 0  # compressed updates buffered since the last flush (``compression.py``)
    sent: int = 0  # models sent to children since the last flush
    dropped: int = 0  # failed children left out since the last flush
    drops_in_a_row: int = 0
    proxy_metrics: dict[str, float] = field(default_factory=dict)  # of the last proxy TRAIN buffered


@dataclass(frozen=True)
class _Scope:
    """What stays fixed through one execution of a node, handed to each phase of its loop as one value."""

    node: Node
    children: Mapping[str, Node]
    members: Mapping[str, Node]  # the children and the node itself (its proxy TRAIN with ``proxy_train: async``)
    rule: AggregationRule
    params: AsyncParams
    phi: torch.Tensor | None
    scorer: Scorer | None
    hooks: AsyncHooks
    store: ExecutionStore
    seed: int
    plan: RoundPlan


def execute_async_node(
    tree: Tree,
    node: Node,
    phi: torch.Tensor | None,
    store: ExecutionStore,
    hooks: AsyncHooks,
    seed: int,
    plan: RoundPlan = ROOT_PLAN,
) -> NodeResult:
    """Run one asynchronous execution of ``node`` (T_q flushes); return theta_T and its virtual duration."""
    settings = node.settings
    params = settings.asynchronous
    if params is None:
        raise ValueError(f"node {node.id!r} is not asynchronous (settings.asynchronous is None)")
    caller = plan.caller
    state = load_for_execution(store, node, caller)
    done = state.rounds_done_for(caller)
    if done >= settings.rounds:
        return saved_result(state, phi, settings)
    scorer = functools.partial(hooks.score, node) if settings.tunes else None
    children = {c.id: c for c in tree.children(node.id)}
    members = {**children, node.id: node}
    scope = _Scope(node, children, members, rule_for(settings.aggregate), params, phi, scorer, hooks, store, seed, plan)
    state, run = _begin(state, done, scope)
    while state.rounds_done - state.exec_start < settings.rounds:
        key = RoundKey(node.id, state.rounds_done, caller)
        store.post(node.id, key.round, down_posts(state.theta, settings))
        _fill_buffer(run, key, state, scope)
        state = _flush(run, state, key, scope)
    return saved_result(state, phi, settings)


def _begin(state: NodeState, done: int, scope: _Scope) -> tuple[NodeState, _Execution]:
    """Start the execution (NODEOPT_down), or, after ``done`` flushes, resume it: the children in flight at the last
    flush are sent again, with the same callers."""
    progress = state.pending or AsyncProgress()
    if done:  # interrupted after a flush: the children in flight then are sent again, with the same callers
        run = _Execution(progress.now, progress.dispatched, list(progress.in_flight))
        run.models = {**progress.versions, state.rounds_done: state.theta}
        for flight in run.in_flight:
            run.calls[flight.dispatch] = _start(scope, scope.members[flight.child], flight, run.models)
    else:
        node, inbox = scope.node, scope.store.inbox(scope.node.id, "down", state.res_seen)
        # no metric lines: only LoRA's exact has any, refused at an asynchronous server (config/adapter_settings.py)
        state, _ = node_down(state, scope.phi, inbox, node.settings, scope.plan.caller, scope.scorer)
        state = replace(state, sent={})
        run = _Execution(dispatched=progress.dispatched, models={state.rounds_done: state.theta})
    return state, run


def _fill_buffer(run: _Execution, key: RoundKey, state: NodeState, scope: _Scope) -> None:
    """Keep children in flight and take their results in virtual-clock order until ``buffer`` are buffered.

    Each result is saved before its child can be dispatched again; a dropout or a failed
    child frees its slot and buffers nothing (``len(children)`` failures in a row stop the run).
    """
    node = scope.node
    while len(run.buffered) < scope.params.buffer:
        _fill(run, scope, state.rounds_done, state.theta)
        arrival = _await_next(run)
        call = run.calls.pop(arrival.dispatch)
        run.in_flight.remove(arrival)
        run.now = max(run.now, arrival.finish or 0.0)
        if call is _DROPPED_OUT:  # its slot frees up; a simulated dropout is no failure
            run.dropped += 1
            continue
        result = call.result()
        if not isinstance(call, _Saved):  # before the child can be dispatched again
            scope.store.save_result(node.id, arrival.dispatch, result)
        if result is None or result.model is None:  # dropped: its slot frees up, nothing is buffered
            run.dropped += 1
            run.drops_in_a_row += 1
            if run.drops_in_a_row >= len(scope.children):
                raise RuntimeError(f"{node.id}: {run.drops_in_a_row} child results in a row were dropped (failed)")
            continue
        run.drops_in_a_row = 0
        _buffer(run, key, scope.members[arrival.child], arrival, result, state, scope)
        _forget_unused_versions(run, state.rounds_done)


def _flush(run: _Execution, state: NodeState, key: RoundKey, scope: _Scope) -> NodeState:
    """One flush: the round tail both engines share (``round_tail.py``: NODEOPT_up on the buffer, the node's TRAIN),
    the flush's own metrics, then the commit.

    The last flush of an execution first awaits the children still in flight (their
    results are dropped), so the commit never runs behind a persistent child's state.
    """
    node, store, hooks = scope.node, scope.store, scope.hooks
    settings = node.settings
    assert run.partial is not None
    folded = FoldedRound(run.partial, run.candidates, {}, [])
    traffic = Traffic(run.sent, sum(b != node.id for b in run.buffered), run.sent_bytes)
    tail = round_tail(RoundScope(node, key, scope.plan, hooks, store, scope.scorer), state, folded, traffic)
    del folded  # its partial is model-sized: not kept while the next flush fills
    run.now += tail.train_s  # the node's own TRAIN, at speed 1 (engine.round_virtual_s)
    metrics = {**_flush_metrics(run), **tail.metrics, VIRTUAL_TIME: run.now}
    run.partial, run.buffered, run.candidates, run.staleness, run.sent, run.dropped = None, [], [], [], 0, 0
    run.sent_bytes = 0
    run.proxy_metrics = {}
    if key.round + 1 - state.exec_start >= settings.rounds:  # an execution returns a model, not pending work
        metrics["async/dropped_results"] = float(_await_in_flight(run))
    state = tail.state
    run.models[key.round + 1] = state.theta
    state = replace(
        state,
        rounds_done=key.round + 1,
        metrics=metrics,
        pending=_progress(run),
        virtual_s=run.now,
        loss=math.nan,
        examples=0,
    )
    state = send_up(state, scope.phi, settings, key, scope.seed)
    store.commit(node.id, state)
    store.drop_results(node.id)
    hooks.round_done(node, key, state.theta, metrics)
    return state


def _buffer(
    run: _Execution,
    key: RoundKey,
    member: Node,
    arrival: InFlight,
    result: ChildResult,
    state: NodeState,
    scope: _Scope,
) -> None:
    """Fold an arrived result into the buffer: ``theta_v + w(s) (y - theta_{v_i})`` with the child's weight.

    The buffer is the node's rule's partial, opened from its state's plan against ``theta_v``
    (the model the stale-weighted contribution is relative to). An up-residual candidate is
    that same stale-weighted model, not the raw ``y``: SELECTRESIDUALS ranks ``candidate -
    theta_v``, which for the raw ``y`` of a stale child would add the node's own drift since
    ``theta_{v_i}`` to the child's update (a fresh result is ``y`` itself, bit for bit).
    """
    assert result.model is not None
    node, rule, version = scope.node, scope.rule, state.rounds_done
    staleness = version - arrival.version
    weight = staleness_weight(staleness, scope.params.staleness)
    stale = stale_model(run.models[version], result.model, run.models[arrival.version], weight)
    if run.partial is None:
        called = list(scope.children)  # every child may be in this flush (secure aggregation: its mask group)
        run.partial = rule.start(key.as_caller(), rule.plan(state.rule_state, called), run.models[version])
    rule.contribute(run.partial, member.id, stale, result.weight)
    run.buffered.append(member.id)
    run.sent_bytes += result.sent_bytes
    run.staleness.append(staleness)
    if member.id == node.id:  # the node's proxy TRAIN, merged like a child result
        run.proxy_metrics = proxy_metrics(result)
    elif node.settings.res_up:
        loss = result.losses[0].loss if result.losses else math.nan
        run.candidates.append(Candidate(member.id, stale, member.weight, loss))  # as folded: see docstring


class _Saved:
    """A child result saved before a crash, handed back instead of running the child again."""

    def __init__(self, result: ChildResult | None) -> None:
        self._result = result

    def result(self) -> ChildResult | None:
        return self._result


_DROPPED_OUT: PendingResult = _Saved(None)
"""A client call that drops out (``tree.clock.dropout_p``): never started, its slot held until it would end."""


class _ProxyCall:
    """The node's own proxy TRAIN in flight, handed over as one more child's result."""

    def __init__(self, node: Node, pending: PendingTrain) -> None:
        self.node, self.pending = node, pending

    def result(self) -> ChildResult:
        return proxy_child(self.node, self.pending.result())


def _start(scope: _Scope, member: Node, flight: InFlight, models: Mapping[int, torch.Tensor]) -> PendingResult:
    """Start ``flight`` (a child's execution, or the node's own proxy TRAIN), or hand back its saved result."""
    node, store, hooks = scope.node, scope.store, scope.hooks
    if drops_out(member.settings.dropout, scope.seed, member.id, flight.dispatch):
        return _DROPPED_OUT
    if store.has_result(node.id, flight.dispatch):
        return _Saved(store.load_result(node.id, flight.dispatch))
    theta, caller = models[flight.version], Caller(node.id, flight.dispatch)
    if member.id == node.id:
        return _ProxyCall(node, hooks.start_train(node, theta, RoundKey(node.id, flight.version, caller)))
    return hooks.start_child(node, member, theta, scope.plan.for_child(caller))


def _progress(run: _Execution) -> AsyncProgress:
    """What of the execution a flush commits: the children in flight and the models they were sent."""
    versions = {f.version: run.models[f.version] for f in run.in_flight}
    return AsyncProgress(run.dispatched, run.now, tuple(run.in_flight), versions)


def _await_in_flight(run: _Execution) -> int:
    """Wait for the children still in flight and drop their results; how many there were."""
    for flight in run.in_flight:
        run.calls.pop(flight.dispatch).result()
    dropped, run.in_flight = len(run.in_flight), []
    return dropped


def _fill(run: _Execution, scope: _Scope, version: int, theta: torch.Tensor) -> None:
    """Send the newest model out: to the node's own proxy TRAIN if it is idle (``proxy_train: async``),
    then to idle children until ``concurrency`` are in flight (or none is idle). Under a rule that folds one
    contribution per child (``distinct_members``: DP), a child already in the buffer is not idle."""
    node, children = scope.node, list(scope.children.values())
    run.models.setdefault(version, theta)
    if node.settings.proxy_async and all(f.child != node.id for f in run.in_flight):
        _dispatch(run, scope, node, version, None)
    held = set(run.buffered) if scope.rule.distinct_members else set()  # DP: one update per child and flush
    while sum(f.child != node.id for f in run.in_flight) < scope.params.concurrency:
        busy = {f.child for f in run.in_flight} | held
        child = pick_idle(children, busy, scope.seed, node.id, run.dispatched)
        if child is None:
            return
        duration = scope.hooks.call_duration(node, child, scope.plan.for_child(Caller(node.id, run.dispatched)))
        finish = None if duration is None else run.now + duration
        _dispatch(run, scope, child, version, finish)
        run.sent += 1


def _dispatch(run: _Execution, scope: _Scope, member: Node, version: int, finish: float | None) -> None:
    flight = InFlight(member.id, run.dispatched, version, run.now, finish)
    run.calls[flight.dispatch] = _start(scope, member, flight, run.models)
    run.in_flight.append(flight)
    run.dispatched += 1


def _await_next(run: _Execution) -> InFlight:
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


def _flush_metrics(run: _Execution) -> dict[str, float]:
    """What only an asynchronous flush reports (the shared ``comm/*`` lines are the round tail's)."""
    staleness = run.staleness
    return {
        "async/buffered": float(len(run.buffered)),
        "async/staleness_mean": sum(staleness) / len(staleness),
        "async/staleness_max": float(max(staleness)),
        "async/in_flight": float(len(run.in_flight)),
        "Training/dropped_clients": float(run.dropped),
        **run.proxy_metrics,
    }
