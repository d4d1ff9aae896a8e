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

from bhfl_core.algorithm.node_state import Caller, RoundKey
from bhfl_core.config.schema import RuntimeConfig
from bhfl_core.placement import Slot
from tasks.client_training import WorkerReport, is_resource_error
from tasks.executor import Executor, gather

Batches = Sequence[tuple[Slot, list[str]]]


def _worth_retrying(task_: Any, task_run: Any, state: Any) -> bool:
    """Prefect's retry condition: transient failures yes, resource errors no."""
    return not (isinstance(state.data, BaseException) and is_resource_error(state.data))


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
    caller: Caller,
    phi_path: str,
    keep: int = 0,
    select: str | None = None,
    epochs: int | None = None,
) -> list[WorkerReport]:
    """Execute each batch of clients on its slot from the parent model at ``phi_path``; one report per batch.

    ``epochs`` (Tempo): the clients' local epochs for this call instead of their ``train.epochs``.
    """
    return gather(
        [
            executor.submit(slot, "train_clients", run_path, caller, ids, phi_path, keep, select, epochs)
            for slot, ids in batches
        ]
    )


@task(name="proxy-train", cache_policy=NO_CACHE, persist_result=False)
def proxy_train(
    executor: Executor, slot: Slot, run_path: str, node_id: str, key: RoundKey, theta_path: str
) -> tuple[str, dict[str, float]]:
    """TRAIN a server's model (message at ``theta_path``) on its proxy split; returns the result's message."""
    return executor.submit(slot, "proxy_train", run_path, node_id, key, theta_path).result()


@task(name="score-candidates", cache_policy=NO_CACHE, persist_result=False)
def score_candidates(executor: Executor, slot: Slot, run_path: str, node_id: str, paths: list[str]) -> list[float]:
    """A server's candidate models (message files) scored on its held-out proxy rows; one loss each."""
    return list(executor.submit(slot, "held_out_losses", run_path, node_id, paths).result())
