"""How a job runs: as Prefect flow and task runs (``PREFECT_RUNS``) or as plain calls (``PLAIN_CALLS``).

An ``Orchestration`` (the protocol: flows/orchestration_protocol.py) owns everything
that differs between the two, so the job code (flows/experiment.py, sweep.py,
pipeline.py, training.py, evaluation.py) never asks which one it runs under:

- ``invoke``: a whole job (experiment, sweep, pipeline) as a flow run, or its body called;
- ``gate``: Prefect runs created one at a time (flows/creation_gate.py), or nothing;
- ``publish``: the headlines and the MLflow link on the flow run's page, or nothing;
- ``run_node``: an internal node's execution as a subflow run, or a call;
- ``call_task`` / ``start_task``: a worker call (a plain function of tasks/, taking the
  executor first) as a task run with the run's retries, or called directly; waited for,
  or started and waited for later (an asynchronous node's clients), alike;
- ``prepare``: the data as the ``prepare-data`` subflow, or prepared directly.

The plain orchestration needs no Prefect-decorated code: ``PrefectRuns`` wraps the
plain functions as tasks when it calls them (a task run is named after its function,
``train_clients`` -> ``train-clients``, and after the call).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from prefect import Task, flow, tags
from prefect.cache_policies import NO_CACHE
from prefect.context import TagsContext
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import quote

from bhfl_core.algorithm.contract import RoundPlan
from bhfl_core.config.schema import ExperimentConfig, RuntimeConfig
from bhfl_core.store.transfer import SentResult, TensorRef
from data_prep.prepare import PreparedData, prepare_data
from flows import progress
from flows.creation_gate import creation_gate, run_gated, run_in_thread, signal_running
from flows.data import no_heartbeats, run_prepare
from flows.orchestration_protocol import Invocation, WorkerAccess
from flows.tracking.prefect_summary import publish_summary
from flows.training import execute_tree_node
from tasks.executor import Executor
from tasks.training import worth_retrying

P = ParamSpec("P")
R = TypeVar("R")
TASK_THREADS = 64  # threads that wait on worker calls (cheap; the work is on the workers)

__all__ = ["PLAIN_CALLS", "PREFECT_RUNS", "PlainCalls", "PrefectRuns"]


def thread_task_runner() -> Any:
    """The task runner of the run's flows: threads that wait on worker calls.

    (Typed ``Any``: prefect's annotation of ``Flow.with_options(task_runner=...)`` accepts
    no concrete runner without a cast.)
    """
    return ThreadPoolTaskRunner(max_workers=TASK_THREADS)


def _retry_condition(task_: Any, task_run: Any, state: Any) -> bool:
    """Prefect's retry condition over the state's error (tasks/training.py ``worth_retrying``)."""
    return worth_retrying(state.data if isinstance(state.data, BaseException) else None)


def as_task(fn: Callable[..., R], runtime: RuntimeConfig, name: str) -> Task[..., R]:
    """``fn`` as a Prefect task named after it, with the run's retries, its run named ``name``; gated."""
    return Task(
        fn=fn,
        name=fn.__name__.replace("_", "-"),
        cache_policy=NO_CACHE,  # arguments are references and an executor: nothing to cache
        persist_result=False,
        retries=runtime.retries,
        retry_delay_seconds=runtime.retry_delay_s,
        retry_condition_fn=_retry_condition,
        task_run_name=name,
        on_running=[signal_running],
    )


@flow(name="node", validate_parameters=False)
def node_flow(run_path: str, node_id: str, phi: TensorRef | None, plan: RoundPlan) -> SentResult:
    """One execution of an internal node as a Prefect subflow."""
    return execute_tree_node(run_path, node_id, phi, plan, PREFECT_RUNS)


class PrefectRuns:
    """Jobs and node executions as flow runs, worker calls as task runs (with retries), data as a subflow.

    Runs are *created* one at a time through the job's creation gate
    (flows/creation_gate.py) and then go on concurrently.
    """

    name = "prefect"

    def invoke(self, job: Invocation[R]) -> R:
        with no_heartbeats(), tags(*job.tags):
            flow_ = job.flow.with_options(flow_run_name=job.name, task_runner=thread_task_runner())
            return flow_(**job.parameters)

    def gate(self) -> AbstractContextManager[None]:
        return creation_gate()

    def publish(self, config: ExperimentConfig, markdown: str) -> None:
        publish_summary(config, markdown)

    def run_node(
        self, run_path: str, node_id: str, phi: TensorRef | None, plan: RoundPlan, *, subflow: bool
    ) -> SentResult:
        if not subflow:  # inside this flow run: nothing to create, the next sibling may go
            signal_running()
            return execute_tree_node(run_path, node_id, phi, plan, self)
        name = f"{node_id} <- {plan.caller}" if plan.caller.key else node_id
        child_flow = node_flow.with_options(
            flow_run_name=name,
            on_running=[signal_running],  # type: ignore[list-item]
            task_runner=thread_task_runner(),
        )
        return child_flow(run_path, node_id, phi, plan)

    def start_task(
        self,
        rt: WorkerAccess,
        fn: Callable[Concatenate[Executor, P], R],
        name: str,
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> Future[R]:
        named = as_task(fn, rt.ctx.config.runtime, name)
        return run_gated(functools.partial(_untagged, functools.partial(named, quote(rt.executor), *args, **kwargs)))

    def call_task(
        self,
        rt: WorkerAccess,
        fn: Callable[Concatenate[Executor, P], R],
        name: str,
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        return self.start_task(rt, fn, name, *args, **kwargs).result()

    def prepare(self, config: ExperimentConfig, cache_root: Path) -> PreparedData:
        return run_prepare(config, cache_root)


def _untagged(call: Callable[[], R]) -> R:
    """Create and run a task run without the job's tags (its flow runs carry them).

    Prefect's task engine takes tag-based concurrency slots for every task run that has
    tags: a request to the server, skipped only for 5 s after one that found no limits.
    On a SQLite server such a request can meet a write lock and wait for its retry (~2 s):
    measured on the 50x3 throughput workload, a 1.9-2.3 s stall of both workers before
    the third round of every run. Untagged task runs make no such request. (So tag-based
    concurrency limits do not apply to bhfl's task runs; its worker slots are its own.)
    """
    with TagsContext(current_tags=set()):
        return call()


class PlainCalls:
    """The very same job code without Prefect: plain calls, plain recursion, direct executor calls.

    No retries and nothing in the Prefect UI; tests use it, and benchmarks/orchestration.py
    measures what the orchestration costs against it.
    """

    name = "plain"

    def invoke(self, job: Invocation[R]) -> R:
        return job.body()

    def gate(self) -> AbstractContextManager[None]:
        return nullcontext()

    def publish(self, config: ExperimentConfig, markdown: str) -> None:
        """(Nothing shows it: the report and MLflow have the same.)"""

    def run_node(
        self, run_path: str, node_id: str, phi: TensorRef | None, plan: RoundPlan, *, subflow: bool
    ) -> SentResult:
        return execute_tree_node(run_path, node_id, phi, plan, self)

    def start_task(
        self,
        rt: WorkerAccess,
        fn: Callable[Concatenate[Executor, P], R],
        name: str,
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> Future[R]:
        return run_in_thread(functools.partial(fn, rt.executor, *args, **kwargs))

    def call_task(
        self,
        rt: WorkerAccess,
        fn: Callable[Concatenate[Executor, P], R],
        name: str,
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        return fn(rt.executor, *args, **kwargs)

    def prepare(self, config: ExperimentConfig, cache_root: Path) -> PreparedData:
        return prepare_data(config, cache_root, log=progress.note)


PREFECT_RUNS = PrefectRuns()
PLAIN_CALLS = PlainCalls()
