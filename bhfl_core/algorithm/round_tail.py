"""The tail of a round, one for both engines: what follows a synchronous round's fold (``engine.py``) and an
asynchronous flush's (``async_engine.py``).

::

    theta' = NODEOPT_up(q, theta_t, children, R_up[q])   (the rule's finalize inside node_up; residual posts)
    comm/* metrics, the rule's metric lines, the tuned NODEOPTs' alphas
    then the named steps, each a no-op where its feature is off (ROUND_STEPS):
        personal_step   Ditto: v = TRAIN(v, Omega_q) with (lambda/2)·||v - theta'||²   (clients)
        train_step      theta_t+1 = TRAIN(theta', Omega_q) (+ DP-SGD's step count and epsilon)
        tempo_step      Tempo's Eq. 9: the children's epochs next round              (the root)

A feature reaches a round through its rule (``rule_registry.py``: DP, secure aggregation,
zeroing, the robust rules), its NODEOPT, or a step here; neither engine branches on one.
What stays the engines' own: how children are called (a cohort, or dispatches on the virtual
clock), how the round's virtual time and reported loss are counted, and how it is committed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from bhfl_core.algorithm.adapter_fold import cap_rank
from bhfl_core.algorithm.aggregation_rule import FoldedRound
from bhfl_core.algorithm.contract import RoundPlan
from bhfl_core.algorithm.engine_hooks import EngineHooks
from bhfl_core.algorithm.node_opt import Scorer
from bhfl_core.algorithm.node_state import NodeResult, NodeState, RoundKey
from bhfl_core.algorithm.node_step import Inbox, ResidualPost, node_up
from bhfl_core.algorithm.store_protocol import ExecutionStore
from bhfl_core.algorithm.tempo import omega, tempo_epochs
from bhfl_core.algorithm.tree import Node, held_out_rows

SAMPLE_EPSILON = "privacy/sample_epsilon"
"""Metric (a DP-SGD client's state): the epsilon its TRAIN calls have spent so far."""

VIRTUAL_TIME = "time/virtual_s"
"""Metric: virtual seconds since the node's execution began (the root's: since the run began)."""


@dataclass(frozen=True)
class RoundScope:
    """What one round (or flush) of a node works with; ``plans``: the children's (a synchronous round's)."""

    node: Node
    key: RoundKey
    plan: RoundPlan
    hooks: EngineHooks
    store: ExecutionStore
    scorer: Scorer | None
    plans: Mapping[str, RoundPlan] = field(default_factory=dict)


@dataclass(frozen=True)
class Traffic:
    """What crossed the node's edges to its children this round, for the ``comm/*`` metrics.

    ``down``: models sent to children; ``up``: children's models (or updates) folded, the
    node's own proxy TRAIN not counted; ``sent_bytes``: the compressed payloads among them;
    ``down_bytes``: what compressed broadcasts cost (``downlink.py``; None: ``down`` float32 models).
    """

    down: int
    up: int
    sent_bytes: int = 0
    down_bytes: int | None = None


@dataclass
class Tail:
    """The round's state and metrics as the steps leave them; ``train_s``: the node's own TRAIN on the virtual
    clock (a server's proxy TRAIN, speed 1: one step per second); ``trained``: that TRAIN's result."""

    state: NodeState
    metrics: dict[str, float]
    train_s: float = 0.0
    trained: NodeResult | None = None


def round_tail(scope: RoundScope, state: NodeState, folded: FoldedRound, traffic: Traffic) -> Tail:
    """NODEOPT_up on the fold (posting the up-residuals), the metrics every round reports, then ``ROUND_STEPS``."""
    node, key = scope.node, scope.key
    state, posts, rule_metrics = node_up(state, folded, inbox_up(scope, state), node.settings, key, scope.scorer)
    scope.store.post(node.id, key.round, posts)
    tail = Tail(state, {**comm_metrics(node, traffic, posts), **rule_metrics, **tuned_metrics(state)})
    for step in ROUND_STEPS:
        step(scope, tail, folded)
    return tail


def inbox_up(scope: RoundScope, state: NodeState) -> Inbox:
    """The node's waiting up-residuals (a leaf has none to fold)."""
    node = scope.node
    return scope.store.inbox(node.id, "up", state.res_seen) if not node.is_leaf else {}


def comm_metrics(node: Node, traffic: Traffic, posts: Sequence[ResidualPost]) -> dict[str, float]:
    """A server's communication this round, in models (flat vectors), the same keys in both engines."""
    if node.is_leaf:
        return {}
    metrics = {
        "comm/down_models": float(traffic.down),
        "comm/up_models": float(traffic.up),
        "comm/res_down_models": float(len(node.settings.res_down)),
        "comm/res_up_models": float(sum(p.models for p in posts)),
    }
    if node.settings.aggregate.compress is not None:
        metrics["comm/up_bytes"] = float(traffic.sent_bytes)
    if traffic.down_bytes is not None:
        metrics["comm/down_bytes"] = float(traffic.down_bytes)
    return metrics


def tuned_metrics(state: NodeState) -> dict[str, float]:
    """The ``alpha`` each tuned NODEOPT (``interp``) last chose: ``opt/alpha_up``, ``_down``, ``_<residual kind>``."""
    opts = {"up": state.opt_up, "down": state.opt_down, **state.opt_res}
    return {f"opt/alpha_{name}": float(opt["alpha"]) for name, opt in opts.items() if "alpha" in opt}


def personal_step(scope: RoundScope, tail: Tail, folded: FoldedRound) -> None:
    """Ditto (Li et al. 2021, Algorithm 1): a client trains its personal model ``v`` from its last value (first:
    theta') towards theta', before the TRAIN of the model it sends up."""
    node, state = scope.node, tail.state
    if node.settings.personal is None:
        return
    start = state.personal if state.personal is not None else state.theta
    personal = scope.hooks.train_personal(node, start, state.theta, scope.key)
    tail.state = replace(state, personal=personal.theta)
    tail.metrics.update({"personal/loss": personal.loss, "personal/steps": float(personal.steps)})


def train_step(scope: RoundScope, tail: Tail, folded: FoldedRound) -> None:
    """TRAIN(theta', Omega_q) at a node with data (a client, or a server's proxy TRAIN after aggregating); a DP-SGD
    client counts its steps and logs what they cost. A proxy TRAIN run alongside the children was folded instead."""
    node = scope.node
    train = node.settings.train
    if train is None or node.settings.proxy_async:
        return
    trained = scope.hooks.train(node, tail.state.theta, scope.key, scope.plan)
    tail.state = replace(tail.state, model=cap_rank(trained.theta, node.settings.rank))  # (DP-SGD's noise: all)
    tail.metrics.update(train_metrics(node, trained))
    if train.dp_sgd is not None:  # a DP-SGD client: its steps so far, and what they cost
        tail.state = replace(tail.state, dp_steps=tail.state.dp_steps + trained.steps)
        tail.metrics[SAMPLE_EPSILON] = client_epsilon(node, tail.state.dp_steps)
    tail.train_s = float(trained.steps) if not node.is_leaf else 0.0
    tail.trained = trained


def tempo_step(scope: RoundScope, tail: Tail, folded: FoldedRound) -> None:
    """Tempo (seeds/001 Eq. 9) after a root round: next round's epochs per child, and what to log.

    ``omega_m = ||w_m - w_root||``: each child's model as sent up this round against the
    root's model at the end of the round (after its own TRAIN). The schedule is part of
    the root's state, committed with the round, so a resume uses exactly these epochs.
    """
    c, plans, state = scope.node.settings.tempo, scope.plans, tail.state
    if c is None:
        return
    omegas = {m: omega(folded.models[m], state.theta) for m in sorted(folded.models) if m in plans}
    tail.metrics.update({f"tempo/omega/{m}": w for m, w in omegas.items()})
    tail.metrics.update({f"tempo/epochs/{m}": float(plans[m].epochs or c) for m in omegas})
    tail.state = replace(state, child_epochs=tempo_epochs(omegas, c))


RoundStep = Callable[[RoundScope, Tail, FoldedRound], None]

ROUND_STEPS: tuple[RoundStep, ...] = (personal_step, train_step, tempo_step)
"""What follows NODEOPT_up in every round and flush, in this order."""


def client_epsilon(node: Node, steps: int) -> float:
    """A DP-SGD client's epsilon after ``steps`` steps of TRAIN over the rows it trains on (its held-out rows are
    never in a batch, so they are not in the sampling rate's denominator; ``learning/dp_sgd.py``)."""
    from bhfl_core.algorithm.privacy_accounting import sample_epsilon

    params = node.settings.train
    assert params is not None and params.dp_sgd is not None
    rows = int(node.weight)
    return sample_epsilon(params.dp_sgd, rows - held_out_rows(rows, node.settings.holdout), params.batch_size, steps)


def train_metrics(node: Node, result: NodeResult) -> dict[str, float]:
    """A TRAIN call's metrics: ``Training/{loss,steps,examples}`` at a client, ``Training/proxy_*`` at a server."""
    prefix = "Training/" if node.is_leaf else "Training/proxy_"
    return {
        f"{prefix}loss": result.loss,
        f"{prefix}steps": float(result.steps),
        f"{prefix}examples": float(result.examples),
    }
