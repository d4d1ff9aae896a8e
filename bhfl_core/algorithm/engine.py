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

``execute_node`` is that loop; the maths is in the pure steps of ``node_step.py``, and
everything after a round's fold (NODEOPT_up through the node's rule, its metrics, Ditto's
and the node's TRAIN, Tempo's schedule) is ``round_tail.py``'s, which the asynchronous
engine's flushes share.
*Where* children run (Prefect subflows, worker tasks, or plain recursion in tests)
and *how* TRAIN is done are injected through ``EngineHooks``, so the same function
drives clients inside a worker, servers inside subflows, and fake trees in unit tests
(the protocols: ``engine_hooks.py``).
The store is the only place with side effects: it reads the inbox of residuals,
delivers posts, and commits each round's state in one atomic file (model, optimiser
states, round counter, the execution it belongs to), after which the residuals that
state consumed are deleted. The loop sees it as an ``ExecutionStore``
(``store_protocol.py``), which ``bhfl_core/store/node_store.py`` implements.

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
import math
from collections.abc import Sequence
from dataclasses import replace

import torch

from bhfl_core.algorithm.aggregation_rule import FoldedRound, fold_results
from bhfl_core.algorithm.compression import compress_update, payload_bytes, received_model
from bhfl_core.algorithm.contract import ROOT_PLAN, ChildResult, FoldPlan, MemberLoss, RoundPlan
from bhfl_core.algorithm.downlink import Broadcast, broadcast, rebase
from bhfl_core.algorithm.engine_hooks import EngineHooks, PendingTrain
from bhfl_core.algorithm.node_opt import Scorer
from bhfl_core.algorithm.node_state import Caller, NodeResult, NodeState, RoundKey
from bhfl_core.algorithm.node_step import down_posts, keeps_state, node_down, reads_own_model
from bhfl_core.algorithm.round_commits import RoundCommits, commits_behind
from bhfl_core.algorithm.round_tail import VIRTUAL_TIME, RoundScope, Tail, Traffic, round_tail
from bhfl_core.algorithm.rules import rule_for
from bhfl_core.algorithm.store_protocol import ExecutionStore
from bhfl_core.algorithm.tree import Node, NodeSettings, Tree
from bhfl_core.algorithm.virtual_clock import drops_out
from bhfl_core.rng import derive_seed, sample_cohort


def load_for_execution(store: ExecutionStore, node: Node, caller: Caller) -> NodeState:
    """The node's state for an execution by ``caller``; its model checked only when the execution reads it.

    A node whose down- and up-aggregation replace its model (fedavg, eta 1) and that
    receives no residuals never reads the model it saved (evaluation does, later): it is
    mapped, not checksummed. An interrupted execution continues from its model: checked.
    """
    lazy = not reads_own_model(node.settings, node.is_leaf)
    state = store.load(node.id, lazy_model=lazy)
    if lazy and state.rounds_done_for(caller):
        state = store.load(node.id)
    return state


def execute_node(
    tree: Tree,
    node: Node,
    phi: torch.Tensor | None,
    store: ExecutionStore,
    hooks: EngineHooks,
    seed: int,
    plan: RoundPlan = ROOT_PLAN,
) -> NodeResult:
    """Run one execution of ``node`` (T_q rounds), or finish it after a crash; return theta_T."""
    settings = node.settings
    caller = plan.caller
    state = load_for_execution(store, node, caller)
    done = state.rounds_done_for(caller)
    if done >= settings.rounds:  # finished before a crash: hand back the saved result
        return saved_result(state, phi, settings)
    scorer = functools.partial(hooks.score, node) if settings.tunes else None
    down: dict[str, float] = {}  # the down step's metric lines, logged with the first round
    if not done:
        state, down = node_down(state, phi, store.inbox(node.id, "down", state.res_seen), settings, caller, scorer)
        state = replace(state, virtual_s=0.0, sent={})
    persist = keeps_state(settings, node.is_leaf)
    with RoundCommits(store, hooks, node, behind=commits_behind(tree, node)) as commits:
        for _ in range(done, settings.rounds):
            state = _round(tree, node, state, plan, store, hooks, seed, scorer, persist, phi, commits, down)
            down = {}
    return saved_result(state, phi, settings)


def _round(
    tree: Tree,
    node: Node,
    state: NodeState,
    plan: RoundPlan,
    store: ExecutionStore,
    hooks: EngineHooks,
    seed: int,
    scorer: Scorer | None,
    persist: bool,
    phi: torch.Tensor | None,
    commits: RoundCommits,
    down: dict[str, float],
) -> NodeState:
    """One synchronous round, committed (``commits``); returns its state (``phi``: the model the parent sent;
    ``down``: the execution's down step's metric lines, for its first round).

    A function of its own so that what the round held — its children's results and
    their folded partial, model-sized each — is released when it returns, before the
    next round's children are even started. Everything after the fold is the round tail
    both engines share (``round_tail.py``).
    """
    settings = node.settings
    children = tree.children(node.id)
    key = RoundKey(node.id, state.rounds_done, plan.caller)
    store.post(node.id, key.round, down_posts(state.theta, settings))
    cohort = sample_cohort(children, settings.cohort, seed, node.id, key.round, settings.poisson_rate)
    sent = down_broadcast(node, children, state, key, seed)
    if sent is not None:  # the children get x_hat, the node keeps it (and its residual) for the next round
        state = replace(state, down_ref=sent.model)
    phi_children = state.theta if sent is None else sent.model
    present = [c for c in cohort if not drops_out(c.settings.dropout, seed, c.id, key.round)]
    rule = rule_for(settings.aggregate)
    fold = rule.plan(state.rule_state, [c.id for c in present])  # the rule's part of every child's plan
    plans = {c.id: child_plan(plan, key, state, c, fold) for c in cohort}
    proxy = start_proxy(node, state, key, hooks)
    results = hooks.run_children(node, present, phi_children, plans) if present else []
    commits.settle()  # the previous round's commit, if it was written while these children trained
    absent = [c for c in cohort if c not in present]  # dropped out: never trained, known when the call would end
    mine = proxy_results(node, proxy, None if sent is None else sent.delta)
    order = [c.id for c in children] + [node.id]
    folded = fold_results(rule, key, [*results, *mine], order, phi_children, fold)
    del results  # folded: the partials they carried are the fold's now
    if sent is not None:
        rebase(folded, sent.delta)
    folded.dropped.extend(c.id for c in absent)
    waited = [hooks.call_duration(node, c, plans[c.id]) or 0.0 for c in absent]
    folded.virtual_s = max([folded.virtual_s, *waited])
    scope = RoundScope(node, key, plan, hooks, store, scorer, plans)
    down_bytes = None if sent is None else sent.bytes_to(holding(node, children, cohort, seed, key.round), len(cohort))
    traffic = Traffic(len(cohort), len(cohort) - len(folded.dropped), folded.sent_bytes, down_bytes)
    tail = round_tail(scope, state, folded, traffic)
    virtual_s = state.virtual_s + round_virtual_s(folded, tail.train_s)
    metrics = {**down, **round_metrics(present, folded, mine), **tail.metrics, VIRTUAL_TIME: virtual_s}
    if sent is not None:
        metrics["comm/down_error"] = sent.error()
    loss, examples = reported(node, tail, folded, rule.reports_up)
    state = replace(
        tail.state, rounds_done=key.round + 1, metrics=metrics, virtual_s=virtual_s, loss=loss, examples=examples
    )
    state = send_up(state, phi, settings, key, seed)
    commits.commit(state, persist, key, metrics)
    return state


def child_plan(plan: RoundPlan, key: RoundKey, state: NodeState, child: Node, fold: FoldPlan) -> RoundPlan:
    """The plan one child gets this round: this round as its caller, the round's epochs for its clients, and
    the node's rule's part (``fold``: ``AggregationRule.plan``).

    Under Tempo the root's schedule (``state.child_epochs``, from the previous round)
    sets each edge's clients' epochs; elsewhere a node passes on the epochs it was given.
    """
    epochs = state.child_epochs.get(child.id, plan.epochs)
    return RoundPlan(key.as_caller(), epochs, fold)


def start_proxy(node: Node, state: NodeState, key: RoundKey, hooks: EngineHooks) -> PendingTrain | None:
    """A server's proxy TRAIN alongside its children (``proxy_train: async``), started from theta_t; else None."""
    return hooks.start_train(node, state.theta, key) if node.settings.proxy_async else None


def proxy_results(node: Node, proxy: PendingTrain | None, delta: torch.Tensor | None) -> list[ChildResult]:
    """The proxy TRAIN run alongside the children, as one more child result (none without one).

    Under compressed broadcasts (``delta``: ``theta_t - x_hat_t``) it started from ``theta_t`` while
    the children started from ``x_hat_t``: moved onto ``x_hat_t`` like theirs before the fold
    (``downlink.rebase`` adds ``delta`` back to all of them).
    """
    if proxy is None:
        return []
    result = proxy_child(node, proxy.result())
    if delta is not None and result.model is not None:
        result = replace(result, model=result.model - delta.to(result.model.device))
    return [result]


def down_broadcast(
    node: Node, children: Sequence[Node], state: NodeState, key: RoundKey, seed: int
) -> Broadcast | None:
    """The round's compressed broadcast (``tree.<level>.compress_down``; ``downlink.py``), None without one."""
    params = node.settings.downlink
    if params is None or not children:
        return None
    rounding_seed = derive_seed(seed, "compress_down", *key.parts())  # each server, round and caller its own draws
    return broadcast(state.theta, state.down_ref, params, rounding_seed, key)


def holding(node: Node, children: Sequence[Node], cohort: Sequence[Node], seed: int, round_index: int) -> int:
    """Children of the cohort that hold the previous broadcast's ``x_hat``: called the round before (the same
    seeded draw, ``sample_cohort``) and keeping state between calls (``persistent``)."""
    if round_index == 0:
        return 0
    settings = node.settings
    called = sample_cohort(children, settings.cohort, seed, node.id, round_index - 1, settings.poisson_rate)
    before = {c.id for c in called}
    return sum(c.id in before and c.settings.persistent for c in cohort)


def reported(node: Node, tail: Tail, folded: FoldedRound, reports_up: bool) -> tuple[float | None, int]:
    """The training loss and examples the node reports up: a client's TRAIN's, a server's children's (none past a
    rule that publishes only a noised or masked sum: ``AggregationRule.reports_up``)."""
    trained = tail.trained
    if node.is_leaf and trained is not None:
        return trained.loss, trained.examples
    return folded.reported() if reports_up else (None, 0)


def send_up(state: NodeState, phi: torch.Tensor | None, settings: NodeSettings, key: RoundKey, seed: int) -> NodeState:
    """After an execution's last round, a child of a compressing parent compresses its update (``compression.py``).

    The payload and the new error-feedback residual join the state committed with the
    round, so a crash after the commit hands back the same payload (``saved_result``).
    An update with NaN or inf raises ``NonFiniteUpdate`` naming the node and ``key``,
    unless the parent zeroes such updates (``uplink.nonfinite``: then it is sent as it is).
    Any other round, and any node whose parent does not compress, is left as it is.
    """
    uplink = settings.uplink
    if uplink is None or phi is None or state.rounds_done - state.exec_start < settings.rounds:
        return state
    rounding_seed = derive_seed(seed, "compress", *key.parts())  # each sender, round and caller its own draws
    sent = compress_update(state.theta, phi, state.feedback, uplink, rounding_seed, key)
    return replace(state, sent=sent.payload, feedback=sent.feedback)


def saved_result(state: NodeState, phi: torch.Tensor | None = None, settings: NodeSettings | None = None) -> NodeResult:
    """The result of a finished execution, as its caller receives it (again, after a crash).

    Under a compressing parent (``settings.uplink``) that is the model the parent decodes
    from the payload the state keeps, ``phi + decode(sent)``, and its bytes.
    """
    loss = math.nan if state.loss is None else state.loss
    uplink = settings.uplink if settings is not None else None
    if uplink is None or phi is None:
        return NodeResult(state.theta, loss, state.examples, virtual_s=state.virtual_s)
    theta = received_model(phi, state.sent, uplink)
    return NodeResult(theta, loss, state.examples, virtual_s=state.virtual_s, sent_bytes=payload_bytes(state.sent))


def round_virtual_s(folded: FoldedRound, train_s: float) -> float:
    """A synchronous round on the virtual clock: its slowest child, then the node's own TRAIN (``train_s``).

    The node's own TRAIN (proxy training at a server) runs at speed 1: one optimizer
    step per virtual second, the median client speed (``virtual_clock.py``). An
    asynchronous proxy TRAIN runs alongside the children: it is in ``folded.virtual_s``.
    """
    return folded.virtual_s + train_s


def proxy_child(node: Node, trained: NodeResult) -> ChildResult:
    """A server's proxy TRAIN run alongside its children, as one more child result.

    Weighted by the rows it trained on; its virtual duration is its optimizer steps
    (speed 1, as in ``round_virtual_s``). Its loss is the TRAIN's (``Training/proxy_loss``),
    not one of the children's: ``fold_results`` leaves the node's own out of their mean.
    """
    if not trained.examples > 0:
        raise RuntimeError(f"{node.id}: proxy TRAIN trained on no rows (its weight among the children)")
    losses = (MemberLoss(node.id, trained.loss, trained.examples),)
    return ChildResult(
        members=(node.id,),
        model=trained.theta,
        weight=float(trained.examples),
        losses=losses,
        virtual_s=float(trained.steps),
    )


def proxy_metrics(result: ChildResult) -> dict[str, float]:
    """A proxy TRAIN merged like a child (``proxy_child``): its metrics, as ``train_metrics`` names them."""
    (own,) = result.losses
    return {
        "Training/proxy_loss": own.loss,
        "Training/proxy_steps": result.virtual_s,
        "Training/proxy_examples": float(own.examples),
    }


def round_metrics(present: list[Node], folded: FoldedRound, mine: list[ChildResult]) -> dict[str, float]:
    """What a synchronous round adds to the shared tail's metrics: dropped and trained clients, the children's
    training loss, and the node's own proxy TRAIN run alongside them."""
    metrics: dict[str, float] = {}
    if dropped := len(folded.dropped):
        metrics["Training/dropped_clients"] = float(dropped)
    if leaves := sum(c.is_leaf for c in present):  # the clients called (those that dropped out were not)
        metrics["Training/clients"] = float(leaves)
    if folded.examples is not None:
        metrics["Training/loss"] = folded.loss
        metrics["Training/examples"] = float(folded.examples)
    for own in mine:
        metrics.update(proxy_metrics(own))
    return metrics
