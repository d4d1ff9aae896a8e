"""What a job and its node executions ask of the way they are run: the ``Orchestration`` protocol.

``flows/orchestration.py`` implements it twice (``PREFECT_RUNS``, ``PLAIN_CALLS``) and
runs node executions through ``flows/training.py``; the job code (the lifecycle, the
launch, the flows, training and evaluation) holds an ``Orchestration`` without knowing
which. This module declares it below all of them, so none of them imports the
implementations to name the type, and ``orchestration.py`` imports none of them back
(``WorkerAccess`` says what a worker call needs of the node execution making it, where
naming ``flows/node_runtime.py``'s ``NodeRuntime`` would point up). Its imports are
types only: the module loads nothing at run time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

if TYPE_CHECKING:
    from prefect import Flow

    from bhfl_core.algorithm.contract import RoundPlan
    from bhfl_core.config.schema import ExperimentConfig
    from bhfl_core.store.transfer import SentResult, TensorRef
    from data_prep.prepare import PreparedData
    from tasks.context import RunContext
    from tasks.executor import Executor

P = ParamSpec("P")
R = TypeVar("R")


class WorkerAccess(Protocol):
    """What a worker call is made through: the node execution's executor and run context (its runtime settings).

    ``flows/node_runtime.py``'s ``NodeRuntime`` is one.
    """

    @property
    def ctx(self) -> RunContext: ...

    @property
    def executor(self) -> Executor: ...


@dataclass(frozen=True)
class Invocation(Generic[R]):
    """A job as either orchestration starts it: its Prefect flow called with ``parameters`` (plain data, as a
    deployment run would bring), or ``body`` called in this thread."""

    flow: Flow[..., R]
    parameters: Mapping[str, Any]
    body: Callable[[], R]
    name: str  # the flow run's name
    tags: Sequence[str] = field(default_factory=tuple)


class Orchestration(Protocol):
    """How a job, its node executions, its worker calls and its data preparation are run."""

    name: str

    def invoke(self, job: Invocation[R]) -> R:
        """Run a whole job (experiment, sweep, pipeline) and return its result."""
        ...

    def gate(self) -> AbstractContextManager[None]:
        """While open, the runs this job creates are created one at a time (flows/creation_gate.py)."""
        ...

    def publish(self, config: ExperimentConfig, markdown: str) -> None:
        """Show ``markdown`` (headlines, the MLflow link) where the job's runs are browsed."""
        ...

    def run_node(
        self, run_path: str, node_id: str, phi: TensorRef | None, plan: RoundPlan, *, subflow: bool
    ) -> SentResult:
        """Execute one internal node from its parent's model (``subflow``: as its own flow run where possible).

        Returns what goes up to the parent as a worker batch does: a ``ChildResult`` by reference.
        """
        ...

    def start_task(
        self,
        rt: WorkerAccess,
        fn: Callable[Concatenate[Executor, P], R],
        name: str,
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> Future[R]:
        """Start ``fn(rt.executor, *args, **kwargs)`` (a worker call of tasks/); its result is waited for later.

        The arguments are checked against ``fn``'s signature, as ``fn`` checks its own
        against the ``WorkerRuntime`` method it submits (tasks/executor.py): typed from the
        flow to the worker.
        """
        ...

    def call_task(
        self,
        rt: WorkerAccess,
        fn: Callable[Concatenate[Executor, P], R],
        name: str,
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        """``fn(rt.executor, *args, **kwargs)`` (a worker call of tasks/), waited for."""
        ...

    def prepare(self, config: ExperimentConfig, cache_root: Path) -> PreparedData:
        """Prepare (or reuse) the experiment's data."""
        ...
