"""The pure steps of Algorithm 1 (ALGORITHMS.md, seeds/004): no files, no executors.

``node_down`` begins a node execution (line 1: theta_0 = NODEOPT_down(q, W_q, [phi],
R_down[q])), ``node_up`` ends a round's aggregation (SELECTRESIDUALS for the
ancestors, then theta' = NODEOPT_up(q, theta_t, children, R_up[q])) and
``down_posts`` is what a round sends to its descendants' R_down. Each takes a
``NodeState`` and returns a new one plus the residual posts to deliver; the round loop
(``engine.py``) reads the inbox from the store, calls these and commits the result.

Residual inputs: each kind (one per residual rule) is averaged into its own
pseudo-gradient and stepped by its own optimiser state at the receiving node, from the
same base as the regular step; its step is added to the regular one:
``theta + (regular - theta) + sum_k (step_k - theta)``. With nothing waiting, the
regular step is returned untouched (bit-exact FedAvg replacement).

Choices where ALGORITHMS.md is silent:
- A node with no model yet adopts ``phi`` (its first down-aggregation is a copy) and
  still folds its waiting down-residuals into it.
- ``persistent: false`` nodes start every execution from ``phi`` with fresh optimiser
  states (their round counter and consumed-residual marks are kept).
- A round whose children all failed (empty aggregate) leaves the model as it was and
  sends no up-residuals; a DP server's still gets the round's noise (whether a round was
  empty would otherwise show, and under Poisson sampling that depends on who is in the data).
- A LoRA node with ``adapter_rank`` (``settings.rank``) caps theta_0, the mean input and
  theta' (after the up-residuals, which may come from nodes of a higher rank) to its
  rank (``adapter_fold.cap_rank``: HetLoRA's zero-padding, FlexLoRA's truncation).
  A FedSA client (``settings.own_b``) takes theta_0's B matrices from the model it saved
  (``adapter_fold.keep_own_b``), persistent or not: it always keeps its state.
- Under LoRA's ``exact`` (``settings.products``) the linear steps (FedAvg's eta, the
  residual folding) combine the models' products, re-factorised to rank r
  (``adapter_mix.py``); the rest of the vector is the plain step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from bhfl_core.algorithm.adapter_fold import cap_rank, keep_own_b
from bhfl_core.algorithm.adapter_mix import DOWN_STEP_TRUNCATION, STEP_TRUNCATION, Terms, mix_products, step_terms
from bhfl_core.algorithm.aggregation import WeightedSum
from bhfl_core.algorithm.aggregation_rule import FoldedRound
from bhfl_core.algorithm.node_opt import NodeOptParams, OptState, Scorer, node_opt_step
from bhfl_core.algorithm.node_state import Caller, NodeState, RoundKey
from bhfl_core.algorithm.residuals import contribution, select_residuals
from bhfl_core.algorithm.rules import rule_for
from bhfl_core.algorithm.tree import NodeSettings


@dataclass(frozen=True)
class PendingResidual:
    """A residual accumulator waiting at a node: the sum of what arrived, and what it covers.

    ``read`` maps ``"<kind>/<sender>"`` to the last sender round included in ``total``;
    consuming the accumulator merges it into ``NodeState.res_seen``.
    """

    total: WeightedSum
    read: Mapping[str, int]


Inbox = Mapping[str, PendingResidual]
"""A node's waiting residual accumulators of one direction, by kind (``"up0"``, ``"down1"``)."""


@dataclass(frozen=True)
class ResidualPost:
    """One contribution a round sends to another node's residual accumulator."""

    target: str
    kind: str
    part: WeightedSum
    models: int  # models it carries (communication accounting)


def node_down(
    stored: NodeState,
    phi: torch.Tensor | None,
    inbox: Inbox,
    settings: NodeSettings,
    caller: Caller,
    scorer: Scorer | None = None,
) -> tuple[NodeState, dict[str, float]]:
    """Begin the execution ``caller`` triggered: theta_0 = NODEOPT_down(q, W_q, [phi], R_down[q]).

    Without ``phi`` (the root) the node starts from its own model. ``inbox`` holds the
    node's waiting down-residuals; they are folded in only when ``phi`` is given.
    ``scorer``: held-out losses for tuned NODEOPTs (``interp``). A Ditto personal model
    is the client's own: kept even when the node is not persistent, and so are the
    error-feedback residual of its compressed updates (``compression.py``) and the model
    its children hold from its compressed broadcasts (``downlink.py``). Returns the state and
    the step's metric lines (under LoRA's ``exact``: what rank r left out of its product
    combination, ``adapter_mix.py``), which the execution's first round logs.
    """
    state = (
        stored
        if settings.persistent
        else NodeState(
            rounds_done=stored.rounds_done,
            res_seen=stored.res_seen,
            personal=stored.personal,
            rule_state=stored.rule_state,
            dp_steps=stored.dp_steps,
            feedback=stored.feedback,
            down_ref=stored.down_ref,
        )
    )
    state = replace(state, exec_caller=caller.key, exec_start=state.rounds_done)
    if phi is None:
        if state.model is None:
            raise ValueError("executed without a parent model and has no model of its own")
        return state, {}
    if state.model is None:  # tensors are never changed in place: the node may share phi's storage
        base, opt_down, theta = phi, state.opt_down, phi
        step: Terms = ((1.0, phi),)
    else:
        base = state.model
        opt_down, theta = node_opt_step(state.opt_down, state.model, phi, settings.opt_down, scorer)
        step = step_terms(settings.opt_down, base, phi, theta)
    theta, opt_res, seen, lost = fold_residuals(
        inbox, base, theta, state.opt_res, state.res_seen, settings, scorer, step
    )
    theta = cap_rank(keep_own_b(theta, stored.model, settings.own_b), settings.rank)
    metrics = {DOWN_STEP_TRUNCATION: lost} if lost is not None else {}
    return replace(state, model=theta, opt_down=opt_down, opt_res=opt_res, res_seen=seen), metrics


def down_posts(theta: torch.Tensor, settings: NodeSettings) -> list[ResidualPost]:
    """``for d in DescRes[q]: R_down[d].append(theta_t)``: the round's model, weight 1."""
    posts = []
    for link in settings.res_down:
        part = WeightedSum()
        part.add(theta, 1.0)
        posts.append(ResidualPost(link.target, link.key, part, 1))
    return posts


def node_up(
    state: NodeState,
    folded: FoldedRound | None,
    inbox: Inbox,
    settings: NodeSettings,
    key: RoundKey,
    scorer: Scorer | None = None,
) -> tuple[NodeState, list[ResidualPost], dict[str, float]]:
    """Aggregate a round's children: residuals for the ancestors, then NODEOPT_up with R_up[q].

    ``folded``: the round's child results folded by the node's aggregation rule, which
    ``finalize``s them into the mean input here, seeded by ``key``, from its state
    (``NodeState.rule_state``). Returns the state with theta' (the model before the node's
    own TRAIN) and the rule's next state, the up-residual posts, and the rule's metric
    lines. ``inbox`` holds the node's waiting up-residuals; ``scorer`` scores candidates for
    tuned NODEOPTs (``interp``).
    """
    if folded is None or (folded.empty and settings.aggregate.privacy is None):  # a leaf, or no child came
        return state, [], {}  # (a DP server publishes its noise even then: privacy.py)
    theta = state.model
    assert theta is not None, "a node aggregates only after node_down gave it a model"
    mean_input, rule_state, metrics = rule_for(settings.aggregate).finalize(folded.partial, key, state.rule_state)
    if folded.shift is not None:  # the children trained from a compressed broadcast (``downlink.rebase``)
        mean_input = mean_input + folded.shift.to(mean_input.device)
    mean_input = cap_rank(mean_input, settings.rank)
    posts = []
    for link in settings.res_up:
        chosen = select_residuals(folded.candidates, theta, link.k, link.select, mean_input)
        if chosen:
            models = 1 if link.combine == "mean" else len(chosen)
            posts.append(ResidualPost(link.target, link.key, contribution(chosen, link.combine), models))
    opt_up, stepped = node_opt_step(state.opt_up, theta, mean_input, settings.opt_up, scorer)
    step = step_terms(settings.opt_up, theta, mean_input, stepped)
    theta, opt_res, seen, lost = fold_residuals(
        inbox, theta, stepped, state.opt_res, state.res_seen, settings, scorer, step
    )
    if lost is not None:
        metrics = {**metrics, STEP_TRUNCATION: lost}
    theta = cap_rank(theta, settings.rank)  # an up-residual from a node of a higher rank is cut like the mean
    after = replace(state, model=theta, opt_up=opt_up, opt_res=opt_res, res_seen=seen, rule_state=dict(rule_state))
    return after, posts, metrics


def replaces(params: NodeOptParams) -> bool:
    """Whether a NODEOPT step ignores the model it starts from (fedavg with eta 1: adopt the input)."""
    return params.kind == "fedavg" and params.eta == 1.0


def keeps_state(settings: NodeSettings, is_leaf: bool) -> bool:
    """Whether a node's state must be written at the end of each round: something will read it again.

    Servers always (the run's commit points). A client when it is persistent and its next
    execution mixes its model in (``reads_own_model``) or evaluation scores it
    (``settings.evaluated``), when it receives residuals (their bookkeeping), or when it
    keeps a Ditto personal model or its own B (FedSA), or counts its DP-SGD steps (its privacy accounting), or
    keeps an error-feedback residual for its compressed updates (``compression.py``). A
    client whose next round replaces its model and that nobody evaluates keeps nothing: a
    retried batch trains it again, to the same result.
    """
    if not is_leaf or settings.res_in or settings.personal is not None or settings.own_b is not None:
        return True
    if settings.uplink is not None and settings.uplink.error_feedback:
        return True
    if settings.train is not None and settings.train.dp_sgd is not None:
        return True
    return settings.persistent and (settings.evaluated or reads_own_model(settings, is_leaf))


def reads_own_model(settings: NodeSettings, is_leaf: bool) -> bool:
    """Whether a new execution reads the model the node saved: not when every step replaces it.

    Down-aggregation replaces it (``replaces(opt_down)``, no residuals folded in) and,
    at a server, so does up-aggregation; a client's TRAIN then starts from its parent's
    model. Evaluation still reads the saved model; this is about the round loop.
    """
    if settings.own_b is not None:  # a FedSA client's B
        return True
    if not settings.persistent:
        return False
    folds_up = not is_leaf and not replaces(settings.opt_up)
    return folds_up or not replaces(settings.opt_down) or bool(settings.res_in)


def fold_residuals(
    inbox: Inbox,
    base: torch.Tensor,
    stepped: torch.Tensor,
    opt_res: Mapping[str, OptState],
    seen: Mapping[str, int],
    settings: NodeSettings,
    scorer: Scorer | None = None,
    step: Terms = (),
) -> tuple[torch.Tensor, dict[str, OptState], dict[str, int], float | None]:
    """Add each waiting kind's NODEOPT step (taken from ``base``) to ``stepped``.

    Returns the model, the residual optimiser states, the consumed marks and, where the
    node takes its linear steps in product space (``settings.products``, under LoRA's
    ``exact``), what rank r left out of their combination (``adapter_mix.py``; None where
    nothing was re-factorised). ``step``: the regular step (``stepped``) as a linear
    combination of models. Kinds are folded in sorted order, so the float sum does not
    depend on how the inbox was read.
    """
    theta, new_opt_res, new_seen = stepped, dict(opt_res), dict(seen)
    terms = list(step) or [(1.0, stepped)]
    for kind in sorted(inbox):
        pending, params = inbox[kind], settings.residual_opt(kind)
        mean = pending.total.mean()
        new_opt_res[kind], moved = node_opt_step(new_opt_res.get(kind, {}), base, mean, params, scorer)
        theta = theta + (moved - base)
        terms += [*step_terms(params, base, mean, moved), (-1.0, base)]
        new_seen.update(pending.read)
    theta, lost = mix_products(settings.products, theta, terms)
    return theta, new_opt_res, new_seen, lost
