"""Worker calls for training: a round's client batches, or a server's proxy TRAIN, on the workers.

Each function runs in the orchestrator (a thread that waits) and hands the work to the
executor: one call per worker batch, each pinned to the slot the placement chose; the
computation happens in those worker processes (tasks/worker.py). They are plain
functions: the run's orchestration (flows/orchestration.py) calls them directly, or as
Prefect tasks named after them (one task run per node round in the UI, named after the
placement) with the run's retries; a retried round does not train again the clients that
finished. Resource errors (out of memory, disk full, damaged checkpoint) are not
retried: they would fail the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

from bhfl_core.algorithm.contract import RoundPlan
from bhfl_core.algorithm.node_state import RoundKey
from bhfl_core.placement import Slot
from bhfl_core.store.transfer import SentResult, TensorRef
from tasks.client_training import BatchCall, is_resource_error
from tasks.executor import Executor, WorkersLostError, gather
from tasks.worker import SentTrain, WorkerRuntime

Batches = Sequence[tuple[Slot, list[str]]]


def worth_retrying(error: BaseException | None) -> bool:
    """Whether a failed worker call is tried again: transient failures yes; resource errors and lost workers no
    (they would recur: the executor already re-ran the call on a restarted worker)."""
    return error is None or not (is_resource_error(error) or isinstance(error, WorkersLostError))


def train_clients(
    executor: Executor,
    batches: Batches,
    run_path: str,
    plan: RoundPlan,
    phi: TensorRef,
    batch_call: BatchCall,
) -> list[SentResult]:
    """Execute each batch of clients on its slot from the parent model ``phi`` under ``plan``; one result per batch.

    Each batch comes back as ``batch_call`` says (``tasks/client_training.py``
    ``BatchCall``: folded by the parent's rule, or one client's own model for an
    asynchronous node; with residual candidates; closed when it is the whole round), its
    tensors by reference (``receive_result`` maps them): a Prefect task's return value
    stays in memory until the flow ends, so it must not hold models.
    """
    if batch_call.whole_round and len(batches) != 1:
        raise ValueError(f"a whole round in one batch, not {len(batches)}")
    futures = [
        executor.submit(slot, WorkerRuntime.train_clients, run_path, plan, ids, phi, batch_call)
        for slot, ids in batches
    ]
    return gather(futures)


def proxy_train(
    executor: Executor, slot: Slot, run_path: str, node_id: str, key: RoundKey, theta: TensorRef
) -> SentTrain:
    """TRAIN a server's model (``theta``) on its proxy split, on ``slot``; the trained model by reference."""
    return executor.submit(slot, WorkerRuntime.proxy_train, run_path, node_id, key, theta).result()


def score_candidates(
    executor: Executor, slot: Slot, run_path: str, node_id: str, candidates: list[TensorRef]
) -> list[float]:
    """A server's candidate models scored on its held-out proxy rows; one loss each."""
    return executor.submit(slot, WorkerRuntime.held_out_losses, run_path, node_id, candidates).result()
