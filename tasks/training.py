"""Prefect tasks for training: a round's client batches, or a server's proxy TRAIN, on the workers.

A task runs in the orchestrator (a thread that waits) and hands the work to the
executor: one call per worker batch, each pinned to the slot the placement chose;
the computation happens in those worker processes (tasks/worker.py). Prefect gives
each node round one task run in the UI (named after the placement) and its retries; a
retried round does not train again the clients that finished. Resource errors (out of
memory, disk full, damaged checkpoint) are not retried: they would fail the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from prefect import Task, task
from prefect.cache_policies import NO_CACHE

from bhfl_core.algorithm.contract import RoundPlan
from bhfl_core.algorithm.node_state import RoundKey
from bhfl_core.config.schema import RuntimeConfig
from bhfl_core.placement import Slot
from bhfl_core.store.transfer import SentResult, TensorRef
from tasks.client_training import is_resource_error
from tasks.executor import Executor, WorkersLostError, gather
from tasks.worker import SentTrain

Batches = Sequence[tuple[Slot, list[str]]]


def _worth_retrying(task_: Any, task_run: Any, state: Any) -> bool:
    """Prefect's retry condition: transient failures yes; resource errors and lost workers no (they would recur:
    the executor already re-ran the call on a restarted worker)."""
    error = state.data if isinstance(state.data, BaseException) else None
    return error is None or not (is_resource_error(error) or isinstance(error, WorkersLostError))


def with_retries(
    task_: Task, runtime: RuntimeConfig, name: str, on_running: Sequence[Callable[..., None]] = ()
) -> Task:
    """The task with the run's Prefect retries (``runtime.retries``, ``runtime.retry_delay_s``), a name and hooks."""
    return task_.with_options(
        retries=runtime.retries,
        retry_delay_seconds=runtime.retry_delay_s,
        retry_condition_fn=_worth_retrying,
        task_run_name=name,
        on_running=list(on_running),
    )


@task(name="train-clients", cache_policy=NO_CACHE, persist_result=False)
def train_clients(
    executor: Executor,
    batches: Batches,
    run_path: str,
    plan: RoundPlan,
    phi: TensorRef,
    keep: int = 0,
    select: str | None = None,
) -> list[SentResult]:
    """Execute each batch of clients on its slot from the parent model ``phi`` under ``plan``; one result per batch.

    Each batch comes back folded by the parent's rule, its tensors by reference
    (``receive_result`` maps them): a task's return value stays in Prefect's memory
    until the flow ends, so it must not hold models.
    """
    futures = [
        executor.submit(slot, "train_clients", run_path, plan, ids, phi, True, keep, select) for slot, ids in batches
    ]
    return gather(futures)


@task(name="proxy-train", cache_policy=NO_CACHE, persist_result=False)
def proxy_train(
    executor: Executor, slot: Slot, run_path: str, node_id: str, key: RoundKey, theta: TensorRef
) -> SentTrain:
    """TRAIN a server's model (``theta``) on its proxy split, on ``slot``; the trained model by reference."""
    sent: SentTrain = executor.submit(slot, "proxy_train", run_path, node_id, key, theta).result()
    return sent


@task(name="score-candidates", cache_policy=NO_CACHE, persist_result=False)
def score_candidates(
    executor: Executor, slot: Slot, run_path: str, node_id: str, candidates: list[TensorRef]
) -> list[float]:
    """A server's candidate models scored on its held-out proxy rows; one loss each."""
    return list(executor.submit(slot, "held_out_losses", run_path, node_id, candidates).result())
