"""Client training inside a worker process: a batch of clients folded into one weighted sum.

A worker trains the list of clients the placement gave it with one reused model
instance: client after client, it runs the client's EXECUTENODE (down-aggregation
into its persistent model, local TRAIN, checkpoint) from the parent's model and folds
the result into a running weighted sum. Only that sum (exact to ~2^-100, so the
server's mean does not depend on how clients were spread over workers), the running
top-K residual candidates and a few numbers go back to the server.

No Prefect here: this code runs in Dask worker processes (or in the orchestrator for
``runtime.executor: inprocess``).
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from bhfl_core.algorithm.aggregation import WeightedSum
from bhfl_core.algorithm.engine import PendingResult, execute_node
from bhfl_core.algorithm.node_state import Caller, NodeResult, RoundKey
from bhfl_core.algorithm.node_step import ChildrenReport
from bhfl_core.algorithm.residuals import Candidate, keep_top
from bhfl_core.algorithm.tree import Node, TrainParams
from bhfl_core.learning.local_train import TrainResult, held_out_loss, split_holdout, train_model
from bhfl_core.learning.params import get_flat, set_flat
from bhfl_core.rng import derive_seed
from bhfl_core.store.node_store import CheckpointError
from tasks import faults
from tasks.context import RunContext, mark_once

log = logging.getLogger("bhfl.worker")
Table = dict[str, torch.Tensor]


@dataclass
class WorkerReport:
    """What one worker sends back for its batch of clients."""

    aggregate: WeightedSum = field(default_factory=WeightedSum)
    losses: dict[str, tuple[float, int]] = field(default_factory=dict)  # client -> (mean loss, examples)
    candidates: list[Candidate] = field(default_factory=list)  # running top-K for up-residuals
    dropped: list[str] = field(default_factory=list)  # clients left out (runtime.on_client_failure: drop)
    timings: list[tuple[str, int, float]] = field(
        default_factory=list
    )  # (client, optimizer steps, seconds) trained here
    worker: str = ""
    device_kind: str = ""
    started: float = 0.0  # wall clock (time.time) of the batch on the worker
    finished: float = 0.0


class LocalTrainer:
    """EngineHooks for nodes executed inside a worker: TRAIN on the node's own data."""

    def __init__(self, ctx: RunContext, model: torch.nn.Module, device: torch.device) -> None:
        self.ctx, self.model, self.device = ctx, model, device
        self.trained = 0  # TRAIN calls made (a client loaded from its checkpoint makes none)
        self.epochs: int | None = None  # Tempo: clients' local epochs for the current call (None: their own)

    def run_children(self, node: Node, cohort: list[Node], theta: torch.Tensor, key: RoundKey) -> ChildrenReport:
        raise RuntimeError(f"node {node.id!r} has children; servers run in the orchestrator, not inside a worker")

    def start_train(self, node: Node, theta: torch.Tensor, key: RoundKey) -> PendingResult:
        raise RuntimeError(f"node {node.id!r}: asynchronous proxy TRAIN is a server's; clients train in order")

    def call_duration(self, node: Node, child: Node, caller: Caller) -> float | None:
        raise RuntimeError(f"node {node.id!r} has children; servers run in the orchestrator, not inside a worker")

    def _data(self, node: Node) -> tuple[Table, Table]:
        """The node's training rows (private split for clients, proxy train split for servers): (TRAIN, held out).

        The held-out share (``settings.holdout``, for tuned NODEOPTs) is drawn once from
        (seed, node): the same rows every round, never trained on.
        """
        ctx = self.ctx
        data = ctx.shard(ctx.clients[node.id].train.path) if node.is_leaf else ctx.proxy("train", node.id)
        if not node.settings.holdout:
            return data, {}
        return split_holdout(data, node.settings.holdout, derive_seed(ctx.config.seed, "holdout", node.id))

    def _fit(
        self, node: Node, theta: torch.Tensor, params: TrainParams, seed: int, anchor: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, TrainResult]:
        set_flat(self.model, theta)
        transform = self.ctx.task_kind.batch_transform(self.ctx.task_facts)  # mlm: masks drawn from `seed`
        result = train_model(self.model, self._data(node)[0], params, seed, self.device, transform, anchor)
        return get_flat(self.model), result

    def train(self, node: Node, theta: torch.Tensor, key: RoundKey) -> tuple[torch.Tensor, dict[str, float]]:
        assert node.settings.train is not None
        if node.is_leaf:
            faults.hit("client", node.id)
            mark_once(self.ctx.run_path, "first_training")
        params = node.settings.train
        if node.is_leaf and self.epochs is not None:
            params = replace(params, epochs=self.epochs)
        trained, result = self._fit(node, theta, params, derive_seed(self.ctx.config.seed, "train", *key.parts()))
        self.trained += 1
        prefix = "Training/" if node.is_leaf else "Training/proxy_"
        # examples: saved with a client's state (a re-run after a crash reports the same); a proxy TRAIN's
        # weight when it is merged like a child result (``proxy_train: async``)
        metrics = {
            f"{prefix}loss": result.loss,
            f"{prefix}steps": float(result.steps),
            f"{prefix}examples": float(result.examples),
        }
        return trained, metrics

    def train_personal(
        self, node: Node, personal: torch.Tensor, anchor: torch.Tensor, key: RoundKey
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Ditto: the personal model trained on the client's data with ``(lambda/2)·||v - anchor||²``."""
        params = node.settings.personal
        assert params is not None
        seed = derive_seed(self.ctx.config.seed, "personal", *key.parts())
        trained, result = self._fit(node, personal, params, seed, anchor)
        return trained, {"personal/loss": result.loss, "personal/steps": float(result.steps)}

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
    caller: Caller,
    client_ids: list[str],
    phi: torch.Tensor,
    keep: int = 0,
    select: str | None = None,
    epochs: int | None = None,
) -> WorkerReport:
    """Execute ``client_ids`` from the parent model ``phi``; return their weighted sum and statistics.

    With ``keep > 0`` the worker also returns its ``keep`` best residual candidates by
    ``select``, held as a running top-K so memory stays at K models per worker.
    ``epochs`` (Tempo) replaces the clients' ``train.epochs`` for this call.
    """
    trainer.epochs = epochs
    try:
        return _train_batch(ctx, trainer, caller, client_ids, phi, keep, select)
    finally:
        trainer.epochs = None


def _train_batch(
    ctx: RunContext,
    trainer: LocalTrainer,
    caller: Caller,
    client_ids: list[str],
    phi: torch.Tensor,
    keep: int,
    select: str | None,
) -> WorkerReport:
    report = WorkerReport(started=time.time())
    for client_id in client_ids:
        node = ctx.tree[client_id]
        before, clock = trainer.trained, time.perf_counter()
        result = _execute_client(ctx, node, phi, trainer, caller)
        if result is None:
            report.dropped.append(client_id)
            continue
        if trainer.trained > before:
            report.timings.append(
                (client_id, int(result.metrics.get("Training/steps", 0)), time.perf_counter() - clock)
            )
        report.aggregate.add(result.theta, node.weight)
        loss = result.metrics.get("Training/loss", float("nan"))
        report.losses[client_id] = (loss, int(result.metrics.get("Training/examples", 0)))
        if keep and select:
            found = Candidate(client_id, result.theta, node.weight, loss)
            report.candidates = keep_top(report.candidates, found, phi, keep, select)
    report.finished = time.time()
    return report


def is_resource_error(exc: BaseException) -> bool:
    """Out of memory, disk full, or a damaged checkpoint: problems of the machine, not of a client."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
        return True
    return isinstance(exc, (MemoryError, torch.OutOfMemoryError, CheckpointError))


def _execute_client(
    ctx: RunContext, node: Node, phi: torch.Tensor, trainer: LocalTrainer, caller: Caller
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
            return execute_node(ctx.tree, node, phi, ctx.store, trainer, ctx.config.seed, caller)
        except Exception as exc:
            if runtime.on_client_failure == "fail" or is_resource_error(exc):
                raise
            if attempt == attempts:
                log.warning("client %s dropped from round %s after %d attempts: %r", node.id, caller, attempts, exc)
            elif runtime.retry_delay_s:
                time.sleep(runtime.retry_delay_s)
    return None
