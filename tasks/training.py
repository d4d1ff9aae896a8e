"""Training tasks: a worker trains its list of clients in one task; servers train on proxy data.

One task per worker (not per client): the task takes one model instance from the
pool and, client after client, loads the parent's flat vector, runs the client's
EXECUTENODE (down-aggregation into its persistent model, local training, checkpoint)
and folds the result into a running weighted sum. Only that sum (one vector) and a
few numbers go back to the server.
"""

from __future__ import annotations

import errno
import logging
import time
from dataclasses import dataclass, field

import torch
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError

from bhfl_core.aggregation import WeightedSum
from bhfl_core.engine import ChildrenReport, NodeResult, RoundKey, execute_node
from bhfl_core.local_train import train_model
from bhfl_core.mlm import mlm_transform
from bhfl_core.params import get_flat, set_flat
from bhfl_core.residuals import Candidate, keep_top
from bhfl_core.rng import derive_seed
from bhfl_core.state_store import CheckpointError, StateStore
from bhfl_core.tree import Node
from tasks import faults
from tasks.context import RunContext, get_context


@dataclass
class WorkerReport:
    aggregate: WeightedSum = field(default_factory=WeightedSum)
    losses: dict[str, tuple[float, int]] = field(default_factory=dict)  # client -> (mean loss, examples)
    candidates: list[Candidate] = field(default_factory=list)  # running top-K for up-residuals
    dropped: list[str] = field(default_factory=list)  # clients left out (runtime.on_client_failure: drop)


class LocalTrainer:
    """EngineHooks for nodes executed inside a worker: TRAIN on the node's own data."""

    def __init__(self, ctx: RunContext, model: torch.nn.Module, device: torch.device) -> None:
        self.ctx, self.model, self.device = ctx, model, device

    def run_children(self, node: Node, cohort: list[Node], theta: torch.Tensor, key: RoundKey) -> ChildrenReport:
        raise RuntimeError(f"node {node.id!r} has children; servers run in subflows, not inside a worker")

    def train(self, node: Node, theta: torch.Tensor, key: RoundKey) -> tuple[torch.Tensor, dict[str, float]]:
        assert node.settings.train is not None
        if node.is_leaf:
            faults.hit("client", node.id)
        data = self.ctx.shard(self.ctx.clients[node.id].train.path) if node.is_leaf else self.ctx.proxy("train", node.id)
        set_flat(self.model, theta)
        seed = derive_seed(self.ctx.config.seed, "train", *key.parts())
        transform = mlm_transform(self.ctx.masking) if self.ctx.manifest.task == "mlm" else None  # masks from `seed`
        result = train_model(self.model, data, node.settings.train, seed, self.device, transform)
        prefix = "train" if node.is_leaf else "proxy_train"
        metrics = {f"{prefix}/loss": result.loss, f"{prefix}/steps": float(result.steps)}
        if node.is_leaf:  # saved with the client's state: a re-run after a crash reports the same
            metrics["train/examples"] = float(result.examples)
        return get_flat(self.model), metrics

    def round_done(self, node: Node, key: RoundKey, theta: torch.Tensor, metrics: dict[str, float]) -> None:
        return None


@task(name="train-clients", cache_policy=NO_CACHE, persist_result=False)
def train_clients(
    run_path: str, caller: str, client_ids: list[str], phi_path: str, keep: int = 0, select: str | None = None
) -> WorkerReport:
    """Execute a list of clients from the parent model at ``phi_path``; return their weighted sum.

    With ``keep > 0`` the worker also returns its ``keep`` best residual candidates by
    ``select``, held as a running top-K so memory stays at K models per worker.
    """
    ctx = get_context(run_path)
    phi = StateStore.read_message(phi_path)
    report = WorkerReport()
    with ctx.models.take() as (model, device):
        trainer = LocalTrainer(ctx, model, device)
        for client_id in client_ids:
            node = ctx.tree[client_id]
            result = _execute_client(ctx, node, phi, trainer, caller)
            if result is None:
                report.dropped.append(client_id)
                continue
            report.aggregate.add(result.theta, node.weight)
            loss = result.metrics.get("train/loss", float("nan"))
            report.losses[client_id] = (loss, int(result.metrics.get("train/examples", 0)))
            if keep and select:
                found = Candidate(client_id, result.theta, node.weight, loss)
                report.candidates = keep_top(report.candidates, found, phi, keep, select)
    return report


def is_resource_error(exc: BaseException) -> bool:
    """Out of memory, disk full, or a damaged checkpoint: problems of the machine, not of a client."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
        return True
    return isinstance(exc, (MemoryError, torch.OutOfMemoryError, CheckpointError))


def _logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except MissingContextError:  # inline runs (benchmarks) have no Prefect run
        return logging.getLogger("bhfl")


def _execute_client(ctx: RunContext, node: Node, phi: torch.Tensor, trainer: LocalTrainer, caller: str) -> NodeResult | None:
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
                _logger().warning("client %s dropped from round %s after %d attempts: %r", node.id, caller, attempts, exc)
            elif runtime.retry_delay_s:
                time.sleep(runtime.retry_delay_s)
    return None


@task(name="proxy-train", cache_policy=NO_CACHE, persist_result=False)
def proxy_train(run_path: str, node_id: str, key: RoundKey, theta: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """TRAIN a server's model on its proxy split."""
    ctx = get_context(run_path)
    with ctx.models.take() as (model, device):
        return LocalTrainer(ctx, model, device).train(ctx.tree[node_id], theta, key)
