"""Client training inside a worker process: a batch of clients, folded by their parent's aggregation rule.

A worker trains the list of clients the placement gave it with one reused model
instance: client after client, it runs the client's EXECUTENODE (down-aggregation
into its persistent model, local TRAIN, checkpoint) from the parent's model and
``contribute``s the result to the parent's rule (``aggregation_rule.py``), on the
worker's device. Only that partial (for the default rule an exact sum, so the parent's
mean does not depend on how clients were spread over workers), the running top-K
residual candidates and a few numbers go back, as one ``ChildResult``.

Checkpoints are written in the background while the next client trains
(``StateStore.background_commits``); the batch reports once they are all durable.

No Prefect here: this code runs in Dask worker processes (or in the orchestrator for
``runtime.executor: inprocess``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from bhfl_core.algorithm.aggregation import Allocator
from bhfl_core.algorithm.contract import ChildResult, MemberLoss, RoundPlan, Work
from bhfl_core.algorithm.engine import execute_node
from bhfl_core.algorithm.engine_hooks import PendingTrain
from bhfl_core.algorithm.fednova_norm import local_norm
from bhfl_core.algorithm.node_state import NodeResult, RoundKey
from bhfl_core.algorithm.residuals import Candidate, keep_top
from bhfl_core.algorithm.rules import rule_for
from bhfl_core.algorithm.tree import Node, TrainParams, planned_steps
from bhfl_core.algorithm.virtual_clock import ClockParams, client_call_s
from bhfl_core.learning.local_train import TrainResult, held_out_loss, split_holdout, train_model
from bhfl_core.learning.params import get_flat, set_flat
from bhfl_core.rng import derive_seed
from bhfl_core.store.node_store import CheckpointError, StateStore
from tasks.context import RunContext, mark_once

log = logging.getLogger("bhfl.worker")
Table = dict[str, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class BatchCall:
    """How a worker trains one batch of clients and what it sends back: the parent decides, the worker obeys.

    One value from the parent's round (``flows/training.py``) to ``train_clients`` below,
    through the worker call (``tasks/training.py``, ``WorkerRuntime.train_clients``),
    instead of four loose arguments that crossed those signatures in two orders.

    ``fold``: each client's model is contributed to the parent's aggregation rule here
    (a partial goes up); False: the batch is one client whose model goes up as it is (an
    asynchronous parent weighs it by staleness first). ``keep`` / ``select``: also send
    the ``keep`` best residual candidates by ``select`` (a running top-K, so memory stays
    at K models; ``residuals.needs`` gives both); 0 / None: none. ``whole_round``: this
    batch is all the parent's round folds, so the rule may close the partial here, on
    the worker's device (``AggregationRule.close``).
    """

    fold: bool = True
    keep: int = 0
    select: str | None = None
    whole_round: bool = False

    def __post_init__(self) -> None:
        if self.whole_round and not self.fold:
            raise ValueError("a batch that is not folded cannot close its round's fold (whole_round needs fold)")


def device_kind(device: torch.device) -> str:
    """What the placement's time model is keyed by: ``cpu`` or the GPU's name."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


class LocalTrainer:
    """EngineHooks for nodes executed inside a worker: TRAIN on the node's own data."""

    def __init__(self, ctx: RunContext, model: torch.nn.Module, device: torch.device) -> None:
        self.ctx, self.model, self.device = ctx, model, device
        self.kind = device_kind(device)
        self.trained = 0  # TRAIN calls made (a client loaded from its checkpoint makes none)
        self._staged: tuple[torch.Tensor, torch.Tensor] | None = None  # (parent's model, its copy on the device)

    @contextlib.contextmanager
    def staged(self, phi: torch.Tensor) -> Iterator[None]:
        """Within the block, the parent's model ``phi`` is copied to the device once, not once per client.

        A client that starts from ``phi`` itself (not persistent, or ``eta_down: 1``)
        hands the engine's TRAIN that very tensor (the engine never changes tensors in
        place), so a GPU worker loads it from its device copy: one host-to-device copy
        per batch instead of one per client. On a CPU worker there is nothing to stage.
        """
        if phi.device != self.device:
            self._staged = (phi, phi.to(self.device))
        try:
            yield
        finally:
            self._staged = None

    def run_children(self, node: Node, cohort: list[Node], theta: torch.Tensor, plans: object) -> list[ChildResult]:
        raise RuntimeError(f"node {node.id!r} has children; servers run in the orchestrator, not inside a worker")

    def start_train(self, node: Node, theta: torch.Tensor, key: RoundKey) -> PendingTrain:
        raise RuntimeError(f"node {node.id!r}: asynchronous proxy TRAIN is a server's; clients train in order")

    def call_duration(self, node: Node, child: Node, plan: RoundPlan) -> float | None:
        raise RuntimeError(f"node {node.id!r} has children; servers run in the orchestrator, not inside a worker")

    def _data(self, node: Node) -> tuple[Table, Table]:
        """The node's training rows (private split for clients, proxy train split for servers): (TRAIN, held out).

        The held-out share (``settings.holdout``, for tuned NODEOPTs) is drawn once from
        (seed, node): the same rows every round, never trained on.
        """
        ctx = self.ctx
        if node.is_leaf:
            data = ctx.shard(ctx.manifest.clients.by_id(node.id).train.path)
        else:
            data = ctx.proxy("train", node.id)
        if not node.settings.holdout:
            return data, {}
        return split_holdout(data, node.settings.holdout, derive_seed(ctx.config.seed, "holdout", node.id))

    def _fit(
        self, node: Node, theta: torch.Tensor, params: TrainParams, seed: int, anchor: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, TrainResult]:
        staged = self._staged
        set_flat(self.model, staged[1] if staged is not None and theta is staged[0] else theta)
        transform = self.ctx.task_kind.batch_transform(self.ctx.task_facts)  # mlm: masks drawn from `seed`
        result = train_model(self.model, self._data(node)[0], params, seed, self.device, transform, anchor)
        return get_flat(self.model), result

    def train(self, node: Node, theta: torch.Tensor, key: RoundKey, plan: RoundPlan) -> NodeResult:
        """TRAIN; a client's local epochs are its plan's (Tempo) when the plan sets them."""
        params = _params(node, plan)
        if node.is_leaf:
            self.ctx.faults.hit("client", node.id)
            mark_once(self.ctx.run_path, "first_training")
        trained, result = self._fit(node, theta, params, derive_seed(self.ctx.config.seed, "train", *key.parts()))
        self.trained += 1
        return NodeResult(trained, result.loss, result.examples, result.steps)

    def train_personal(self, node: Node, personal: torch.Tensor, anchor: torch.Tensor, key: RoundKey) -> NodeResult:
        """Ditto: the personal model trained on the client's data with ``(lambda/2)·||v - anchor||²``."""
        params = node.settings.personal
        assert params is not None
        seed = derive_seed(self.ctx.config.seed, "personal", *key.parts())
        trained, result = self._fit(node, personal, params, seed, anchor)
        return NodeResult(trained, result.loss, result.examples, result.steps)

    def score(self, node: Node, candidates: Sequence[torch.Tensor]) -> list[float]:
        """Each candidate's loss on the node's held-out rows (same masks for all, for masked LM)."""
        ctx = self.ctx
        held = self._data(node)[1]
        if not held:
            return [float("nan")] * len(candidates)
        transform = ctx.task_kind.batch_transform(ctx.task_facts)
        seed = derive_seed(ctx.config.seed, "holdout-score", node.id)
        losses = []
        for theta in candidates:
            set_flat(self.model, theta)
            losses.append(held_out_loss(self.model, held, ctx.config.eval.batch_size, self.device, seed, transform))
        return losses

    def round_done(self, node: Node, key: RoundKey, theta: torch.Tensor, metrics: dict[str, float]) -> None:
        return None


def train_clients(
    ctx: RunContext,
    trainer: LocalTrainer,
    plan: RoundPlan,
    client_ids: list[str],
    phi: torch.Tensor,
    batch_call: BatchCall,
    allocate: Allocator | None = None,
) -> ChildResult:
    """Execute ``client_ids`` from the parent model ``phi`` under ``plan``; return what goes up to the parent.

    ``batch_call`` says whether the models are folded by the parent's rule here (a partial in
    the result; ``allocate`` gives its storage), whether the fold may be closed, and
    which residual candidates go up with it (``BatchCall``).
    """
    fold, keep, select = batch_call.fold, batch_call.keep, batch_call.select
    if not fold and len(client_ids) != 1:
        raise ValueError(f"an unfolded batch carries one client's model, not {len(client_ids)}")
    parent = plan.caller.node_id
    rule = rule_for(ctx.tree[parent].settings.aggregate)
    partial = rule.start(plan.caller, plan.fold, phi, allocate) if fold else None
    clock, seed = ClockParams(**ctx.config.tree.clock.model_dump()), ctx.config.seed
    members: list[str] = []
    dropped: list[str] = []
    losses: list[MemberLoss] = []
    work: list[Work] = []
    candidates: list[Candidate] = []
    model: torch.Tensor | None = None
    virtual_s, sent_bytes = 0.0, 0
    with ctx.store.background_commits() as store, trainer.staged(phi):
        for client_id in client_ids:
            node = ctx.tree[client_id]
            virtual_s = max(virtual_s, client_call_s(seed, clock, node, plan.epochs, plan.caller.round or 0))
            before, started = trainer.trained, time.perf_counter()
            result = _execute_client(ctx, store, node, phi, trainer, plan)
            if result is None:
                dropped.append(client_id)
                continue
            members.append(client_id)
            sent_bytes += result.sent_bytes
            if trainer.trained > before:  # trained here, not handed back from its checkpoint
                steps = planned_steps(int(node.weight), _params(node, plan))
                work.append(Work(client_id, steps, time.perf_counter() - started, trainer.kind))
            if partial is not None:
                rule.contribute(partial, client_id, result.theta, node.weight, steps=local_norm(node, plan.epochs))
            else:
                model = result.theta
            if rule.sees_members and node.settings.reports_loss:  # (not under secure aggregation, nor DP-SGD's)
                losses.append(MemberLoss(client_id, result.loss, result.examples))
            if keep and select:
                found = Candidate(client_id, result.theta.cpu(), node.weight, result.loss)
                candidates = keep_top(candidates, found, phi, keep, select)
            del result  # folded: the next client's model must not meet this one in memory
    if batch_call.whole_round and partial is not None and not partial.empty:
        rule.close(partial)
    return ChildResult(
        members=tuple(members),
        model=model,
        weight=ctx.tree[client_ids[0]].weight if model is not None else 0.0,
        partial=partial,
        losses=tuple(losses),
        virtual_s=virtual_s,
        dropped=tuple(dropped),
        candidates=tuple(candidates),
        work=tuple(work),
        sent_bytes=sent_bytes,
    )


def _params(node: Node, plan: RoundPlan) -> TrainParams:
    """The node's TRAIN settings, with a client's local epochs from its plan (Tempo) where the plan sets them."""
    params = node.settings.train
    assert params is not None
    return replace(params, epochs=plan.epochs) if node.is_leaf and plan.epochs is not None else params


def is_resource_error(exc: BaseException) -> bool:
    """Out of memory, disk full, or a damaged checkpoint: problems of the machine, not of a client."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
        return True
    return isinstance(exc, (MemoryError, torch.OutOfMemoryError, CheckpointError))


def _execute_client(
    ctx: RunContext, store: StateStore, node: Node, phi: torch.Tensor, trainer: LocalTrainer, plan: RoundPlan
) -> NodeResult | None:
    """EXECUTENODE for one client under the run's failure policy; None = dropped from this round.

    ``fail``: the error propagates (Prefect retries the whole batch; clients that
    finished are not trained again). ``drop``: the client is retried in place
    ``runtime.retries`` times, then left out of the aggregate. Resource errors and
    damaged checkpoints always propagate: dropping them would quietly bias the run.
    """
    runtime = ctx.config.runtime
    attempts = 1 + runtime.retries if runtime.on_client_failure == "drop" else 1
    for attempt in range(1, attempts + 1):
        try:
            return execute_node(ctx.tree, node, phi, store, trainer, ctx.config.seed, plan)
        except Exception as exc:
            if runtime.on_client_failure == "fail" or is_resource_error(exc):
                raise
            if attempt == attempts:
                log.warning(
                    "client %s dropped from round %s after %d attempts: %r", node.id, plan.caller, attempts, exc
                )
            elif runtime.retry_delay_s:
                time.sleep(runtime.retry_delay_s)
    return None
