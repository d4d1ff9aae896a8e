"""Training the tree: each internal node's execution, as a Prefect subflow run or a plain call.

Flow shape (what the Prefect UI shows under ``bhfl-experiment``)::

    node: root                         (subflow: one execution of the root = T_root rounds)
      node: <server>                   (subflow per execution of each internal node; siblings run concurrently)
        node: edge-<lang>
          train-clients x batches      (task per worker batch; the batch trains in that worker's process)
        proxy-train                    (task, where the server has proxy data)

``runtime.subflow_depth`` keeps deeper executions inside their parent's flow run.
The server rounds (NODEOPT on flat vectors, checkpoints) run here, in the orchestrating
process; client training and proxy training run on the run's executor. Models travel
as message files (``state/messages``) between node executions and tasks, and come back
from workers as weighted sums.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from prefect import Task, flow
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import quote

from bhfl_core.algorithm.async_engine import execute_async_node
from bhfl_core.algorithm.engine import PROXY_STEPS, VIRTUAL_TIME, PendingResult, execute_node
from bhfl_core.algorithm.node_state import Caller, NodeResult, RoundKey
from bhfl_core.algorithm.node_step import ChildrenReport
from bhfl_core.algorithm.residuals import Candidate, needs
from bhfl_core.algorithm.tempo import omega, tempo_epochs
from bhfl_core.algorithm.tree import Node, TrainParams
from bhfl_core.algorithm.virtual_clock import ClockParams, call_duration, client_speed
from bhfl_core.config.schema import ExperimentConfig
from bhfl_core.learning.local_train import planned_steps
from bhfl_core.placement import Job, place
from bhfl_core.store.node_store import StateStore
from bhfl_core.store.run_layout import STATE_DIR
from bhfl_core.store.tempo_schedule import epochs_for, read_schedule, record_round, schedule_path
from data_prep.prepare import PreparedData, prepare_data
from flows import progress
from flows.creation_gate import run_gated, run_in_thread, signal_running
from flows.data import run_prepare
from flows.evaluation import evaluate_step
from flows.node_runtime import NodeRuntime, Orchestration, node_runtime, worker_utilisation
from tasks import faults
from tasks.client_training import WorkerReport
from tasks.context import mark_once
from tasks.executor import PendingCall, gather
from tasks.time_model import load_time_model, record_timings
from tasks.training import proxy_train, score_candidates, train_clients, with_retries

TASK_THREADS = 64  # threads that wait on worker calls (cheap; the work is on the workers)


def thread_task_runner() -> Any:
    """The task runner of the run's flows: threads that wait on worker calls.

    (Typed ``Any``: prefect's annotation of ``Flow.with_options(task_runner=...)`` accepts
    no concrete runner without a cast.)
    """
    return ThreadPoolTaskRunner(max_workers=TASK_THREADS)


class FlowHooks:
    """EngineHooks for servers: child servers as node executions, clients as worker batches.

    How those run (Prefect runs or plain calls) is the runtime's ``orchestration``.
    """

    def __init__(self, rt: NodeRuntime) -> None:
        self.rt = rt
        self.round_started: dict[int, float] = {}
        self.sent_up: dict[int, dict[str, torch.Tensor]] = {}  # Tempo, at the root: round -> edge -> model sent up
        self._sent: dict[str, tuple[torch.Tensor, str]] = {}  # async: node -> (latest model sent, its message)

    # ------------------------------------------------------------ Tempo (seeds/001, bhfl_core/algorithm/tempo.py)

    def _tempo_file(self) -> Path:
        return schedule_path(self.rt.ctx.run_path / STATE_DIR)

    def _tempo_root(self, node: Node) -> bool:
        return self.rt.ctx.config.tree.tempo and node.parent is None

    def _client_epochs(self, node: Node, key: RoundKey) -> int | None:
        """Tempo: the epochs of an edge's clients in the root round that called the edge (None: their own).

        Root round 0 and an edge without entry in the schedule: ``tree.client.train.epochs`` (c).
        """
        ctx, caller = self.rt.ctx, key.caller
        if not ctx.config.tree.tempo or caller.round is None or node.parent != caller.node_id:
            return None
        if ctx.tree[caller.node_id].parent is not None:
            return None
        c = ctx.config.tree.client.train.epochs
        return epochs_for(self._tempo_file(), caller.round, node.id, c) if caller.round else None

    def _tempo_record(self, node: Node, done_round: int, models: dict[str, torch.Tensor], theta: torch.Tensor) -> None:
        """Eq. 9 after root round ``done_round``: store the epochs of round ``done_round + 1``, log omegas and epochs.

        ``theta`` is the root's model at the end of the round (after its proxy TRAIN, if any);
        ``models`` the edges' models as sent up in that round.
        """
        path, c = self._tempo_file(), self.rt.ctx.config.tree.client.train.epochs
        omegas = {m: omega(models[m], theta) for m in sorted(models)}
        record_round(path, done_round + 1, omegas, tempo_epochs(omegas, c))
        used = {m: c if not done_round else epochs_for(path, done_round, m, c) for m in omegas}
        values = {f"tempo/omega/{m}": w for m, w in omegas.items()}
        values.update({f"tempo/epochs/{m}": float(e) for m, e in used.items()})
        self.rt.tracker.log_node(node.id, values, step=done_round + 1)

    def _tempo_catch_up(self, node: Node, key: RoundKey, theta: torch.Tensor) -> None:
        """A run resumed between the commit of root round t-1 and its schedule entry: recompute it from the store.

        The edges' saved models are those they sent up in round t-1, and ``theta`` (the
        root's model at the start of round t) is its model at the end of round t-1.
        """
        if not key.round or key.round in read_schedule(self._tempo_file()):
            return
        store, previous = self.rt.ctx.store, Caller(node.id, key.round - 1).key
        models = {
            c.id: store.load(c.id).theta
            for c in self.rt.ctx.tree.children(node.id)
            if store.load_info(c.id).get("exec_caller") == previous
        }
        self._tempo_record(node, key.round - 1, models, theta)

    # ------------------------------------------------------------ children

    def _run_child(self, child: Node, phi_path: str, caller: Caller) -> str:
        depth = self.rt.ctx.config.runtime.subflow_depth
        subflow = depth is None or child.depth <= depth
        return self.rt.orchestration.run_node(self.rt.run_path, child.id, phi_path, caller, subflow=subflow)

    def _run_servers(self, servers: list[Node], phi_path: str, caller: Caller) -> list[str]:
        """Execute child servers, concurrently unless ``runtime.parallel_subtrees`` is off; results in cohort order.

        Each child runs in its own thread (a copy of this context: Prefect nests its
        subflow under this flow run); the subflows are created one at a time.
        """
        if not self.rt.ctx.config.runtime.parallel_subtrees:
            return [self._run_child(c, phi_path, caller) for c in servers]
        futures = [run_gated(functools.partial(self._run_child, c, phi_path, caller)) for c in servers]
        return gather(futures)

    def _run_clients(
        self, node: Node, leaves: list[Node], phi_path: str, caller: Caller, key: RoundKey
    ) -> list[WorkerReport]:
        runtime = self.rt.ctx.config.runtime
        keep, select = needs(node.settings.res_up)
        epochs = self._client_epochs(node, key)

        def params(train: TrainParams) -> TrainParams:
            return train if epochs is None else replace(train, epochs=epochs)

        jobs = [Job(c.id, planned_steps(int(c.weight), params(c.settings.train))) for c in leaves if c.settings.train]
        model = load_time_model(self.rt.ctx.run_path) if runtime.placement == "learned" else None
        plan = place(jobs, self.rt.executor.slots(), runtime.placement, model)
        spread = ", ".join(f"{len(a.jobs)} on {a.slot.name}" for a in plan)
        name = f"train {node.id} r{key.round + 1} [{len(jobs)} clients: {spread}]"
        reports: list[WorkerReport] = self.rt.orchestration.call_task(
            self.rt,
            train_clients,
            name,
            [(a.slot, list(a.jobs)) for a in plan],
            self.rt.run_path,
            caller,
            phi_path,
            keep,
            select,
            epochs,
        )
        if runtime.placement == "learned":
            record_timings(
                self.rt.ctx.run_path, [(r.device_kind, steps, s) for r in reports for _, steps, s in r.timings]
            )
        return reports

    def run_children(self, node: Node, cohort: list[Node], theta: torch.Tensor, key: RoundKey) -> ChildrenReport:
        self.round_started[key.round] = time.time()
        ctx = self.rt.ctx
        tempo = self._tempo_root(node)
        if tempo:
            self._tempo_catch_up(node, key, theta)
        phi_path = ctx.store.write_message(f"{node.id}.down", theta)
        caller = key.as_caller()
        report = ChildrenReport()
        losses: dict[str, tuple[float, int]] = {}  # child -> (training loss of its last round, examples)
        servers = [c for c in cohort if not c.is_leaf]
        leaves = [c for c in cohort if c.is_leaf]
        for child, up_path in zip(servers, self._run_servers(servers, phi_path, caller)):
            theta_child = StateStore.read_message(up_path)
            report.virtual_s = max(report.virtual_s, self._server_seconds(child))
            report.aggregate.add(theta_child, child.weight)
            if tempo:
                self.sent_up.setdefault(key.round, {})[child.id] = theta_child
            if node.settings.res_up:
                report.candidates.append(Candidate(child.id, theta_child, child.weight))
            last = ctx.store.load_info(child.id).get("metrics", {})  # the child's last round, saved with it
            if last.get("Training/examples"):
                losses[child.id] = (last["Training/loss"], int(last["Training/examples"]))
        if leaves:
            order = {c.id: i for i, c in enumerate(cohort)}
            workers = self._run_clients(node, leaves, phi_path, caller, key)
            report.virtual_s = max(report.virtual_s, self._slowest_client(node, leaves, key))
            for worker in workers:
                report.aggregate.merge(worker.aggregate)
                report.candidates.extend(worker.candidates)
                report.dropped.extend(worker.dropped)
                losses.update(worker.losses)
            # one order whatever the placement: selection ties and float sums then agree across worker counts
            report.candidates.sort(key=lambda c: order.get(c.node_id, len(order)))
            report.dropped.sort(key=order.__getitem__)
            for client_id in report.dropped:
                progress.note(f"client {client_id} failed and was dropped from {node.id} round {key.round + 1}")
            report.metrics["Training/clients"] = float(len(leaves))
        if losses:  # example-weighted mean of the children's last-round client loss, in a fixed order
            ordered = [losses[k] for k in sorted(losses)]
            seen = sum(n for _, n in ordered)
            report.metrics["Training/loss"] = sum(loss * n for loss, n in ordered) / max(seen, 1)
            report.metrics["Training/examples"] = float(seen)
        return report

    # ------------------------------------------------ asynchronous nodes (bhfl_core/algorithm/async_engine.py)

    def start_child(self, node: Node, child: Node, theta: torch.Tensor, caller: Caller) -> PendingResult:
        """Begin one child execution from ``theta`` (a client: a one-client batch on a worker; a server: a thread)."""
        rt = self.rt
        cached = self._sent.get(node.id)
        if cached is None or cached[0] is not theta:  # one message per model version, not per dispatch
            cached = (theta, rt.ctx.store.write_message(f"{node.id}.down-{caller.round}", theta))
            self._sent[node.id] = cached
        phi_path = cached[1]
        if not child.is_leaf:
            future = run_gated(functools.partial(self._run_child, child, phi_path, caller))
            return _ServerCall(future, functools.partial(self._server_seconds, child))
        slots = rt.executor.slots()
        slot = slots[(caller.round or 0) % len(slots)]
        pending = rt.executor.submit(slot, "train_clients", rt.run_path, caller, [child.id], phi_path, 0, None, None)
        return _ClientCall(child.id, pending)

    def call_duration(self, node: Node, child: Node, caller: Caller) -> float | None:
        """A client call's virtual duration (its planned steps over its speed, plus transfers); servers: None."""
        if not child.is_leaf or child.settings.train is None:
            return None
        return self._client_seconds(child, child.settings.train, caller)

    def _client_seconds(self, child: Node, train: TrainParams, caller: Caller) -> float:
        cfg = self.rt.ctx.config
        clock = ClockParams(**cfg.tree.clock.model_dump())
        speed = client_speed(cfg.seed, child.id, child.group, clock)
        steps = planned_steps(int(child.weight), train)
        return call_duration(steps, speed, clock, cfg.seed, child.id, caller.round or 0)

    def _slowest_client(self, node: Node, leaves: list[Node], key: RoundKey) -> float:
        """A synchronous round waits for its slowest client call (with Tempo's epochs where they apply)."""
        epochs = self._client_epochs(node, key)
        seconds = [
            self._client_seconds(
                c, c.settings.train if epochs is None else replace(c.settings.train, epochs=epochs), key.as_caller()
            )
            for c in leaves
            if c.settings.train is not None
        ]
        return max(seconds, default=0.0)

    def _server_seconds(self, child: Node) -> float:
        """A child server's last execution on the virtual clock (saved with its state)."""
        return float(self.rt.ctx.store.load_info(child.id).get("metrics", {}).get(VIRTUAL_TIME, 0.0))

    # ------------------------------------------------------------ the node's own steps

    def train(self, node: Node, theta: torch.Tensor, key: RoundKey) -> tuple[torch.Tensor, dict[str, float]]:
        """Proxy TRAIN of a server, on a worker (the model travels as a message file)."""
        ctx = self.rt.ctx
        assert node.settings.train is not None
        steps = planned_steps(ctx.manifest.proxy_train.size, node.settings.train)
        slot = place([Job(node.id, steps)], self.rt.executor.slots(), "lpt")[0].slot
        theta_path = ctx.store.write_message(f"{node.id}.proxy-in", theta)
        out_path, metrics = self.rt.orchestration.call_task(
            self.rt,
            proxy_train,
            f"proxy-train {node.id} r{key.round + 1} [on {slot.name}]",
            slot,
            self.rt.run_path,
            node.id,
            key,
            theta_path,
        )
        return StateStore.read_message(out_path), metrics

    def start_train(self, node: Node, theta: torch.Tensor, key: RoundKey) -> PendingResult:
        """Proxy TRAIN alongside the node's children (``proxy_train: async``): the same task, in its own thread.

        One at a time per node (the engines wait for it before starting the next), so its
        message files are the node's usual ``proxy-in``/``proxy-out``.
        """
        return _TrainCall(run_in_thread(functools.partial(self.train, node, theta, key)))

    def score(self, node: Node, candidates: Sequence[torch.Tensor]) -> list[float]:
        """A tuned NODEOPT's candidates scored on the server's held-out proxy rows, on a worker."""
        ctx = self.rt.ctx
        paths = [ctx.store.write_message(f"{node.id}.candidate-{i}", c) for i, c in enumerate(candidates)]
        slot = self.rt.executor.slots()[0]
        name = f"{node.id}: score {len(paths)} candidates on {slot.name}"
        losses: list[float] = self.rt.orchestration.call_task(
            self.rt, score_candidates, name, slot, self.rt.run_path, node.id, paths
        )
        return losses

    def train_personal(
        self, node: Node, personal: torch.Tensor, anchor: torch.Tensor, key: RoundKey
    ) -> tuple[torch.Tensor, dict[str, float]]:
        raise RuntimeError(f"{node.id} is a server; only clients keep a personal (Ditto) model")

    def round_done(self, node: Node, key: RoundKey, theta: torch.Tensor, metrics: dict[str, float]) -> None:
        rt = self.rt
        is_root = node.parent is None
        if is_root:
            metrics = {**metrics, **worker_utilisation(rt, self.round_started.get(key.round, time.time()), time.time())}
        if self._tempo_root(node) and key.round in self.sent_up:  # before evaluation and the round's fault point
            self._tempo_record(node, key.round, self.sent_up.pop(key.round), theta)
        if not node.is_leaf:  # committed, not yet logged: a resume logs it from the saved state (experiment.py)
            faults.hit("round", f"{node.id} round {key.round + 1}")
        rt.tracker.log_node(node.id, metrics, step=key.round + 1)
        progress.node_round(node.id, node.depth, key.round, metrics)
        every = rt.ctx.config.eval.every
        is_last = key.round + 1 >= node.settings.rounds
        if is_root and is_last:
            mark_once(rt.ctx.run_path, "last_aggregate")
        if is_root and every and (key.round + 1) % every == 0 and not is_last:
            evaluate_step(rt, key.round + 1)


def execute_tree_node(
    run_path: str, node_id: str, phi_path: str | None, caller: Caller, orchestration: Orchestration
) -> str:
    """EXECUTENODE for one internal node, from and to message files; returns the path of theta_T."""
    with node_runtime(run_path, orchestration) as rt:
        ctx = rt.ctx
        node = ctx.tree[node_id]
        phi = StateStore.read_message(phi_path) if phi_path else None
        run = execute_async_node if node.settings.asynchronous is not None else execute_node
        result = run(ctx.tree, node, phi, ctx.store, FlowHooks(rt), ctx.config.seed, caller)
        return ctx.store.write_message(f"{node_id}.up", result.theta)


class _ClientCall:
    """A one-client worker batch started by an asynchronous node; ``result`` waits for it."""

    def __init__(self, client_id: str, pending: PendingCall) -> None:
        self.client_id, self.pending = client_id, pending

    def result(self) -> NodeResult | None:
        report: WorkerReport = self.pending.result()
        if report.aggregate.empty:  # failed and dropped (runtime.on_client_failure: drop)
            progress.note(f"client {self.client_id} failed and was dropped")
            return None
        loss, _ = report.losses[self.client_id]
        return NodeResult(report.aggregate.mean(), {"Training/loss": loss})


class _TrainCall:
    """A proxy TRAIN started alongside the node's children; its virtual duration is its steps (speed 1)."""

    def __init__(self, future: Future[tuple[torch.Tensor, dict[str, float]]]) -> None:
        self.future = future

    def result(self) -> NodeResult:
        theta, metrics = self.future.result()
        return NodeResult(theta, metrics, virtual_s=metrics.get(PROXY_STEPS, 0.0))


class _ServerCall:
    """A child server's execution started by an asynchronous node, with its virtual duration once done."""

    def __init__(self, future: Future[str], seconds: Callable[[], float]) -> None:
        self.future, self.seconds = future, seconds

    def result(self) -> NodeResult:
        theta = StateStore.read_message(self.future.result())
        return NodeResult(theta, virtual_s=self.seconds())


@flow(name="node", validate_parameters=False)
def node_flow(run_path: str, node_id: str, phi_path: str | None, caller: Caller) -> str:
    """One execution of an internal node as a Prefect subflow."""
    return execute_tree_node(run_path, node_id, phi_path, caller, PREFECT_RUNS)


class PrefectRuns:
    """Node executions as subflow runs, worker calls as task runs (with retries), data as a subflow.

    Runs are *created* one at a time through the experiment's creation gate
    (flows/creation_gate.py) and then go on concurrently.
    """

    name = "prefect"

    def run_node(self, run_path: str, node_id: str, phi_path: str | None, caller: Caller, *, subflow: bool) -> str:
        if not subflow:  # inside this flow run: nothing to create, the next sibling may go
            signal_running()
            return execute_tree_node(run_path, node_id, phi_path, caller, self)
        name = f"{node_id} <- {caller}" if caller.key else node_id
        child_flow = node_flow.with_options(
            flow_run_name=name,
            on_running=[signal_running],  # type: ignore[list-item]
            task_runner=thread_task_runner(),
        )
        return child_flow(run_path, node_id, phi_path, caller)

    def call_task(self, rt: NodeRuntime, task_: Task[..., Any], name: str, *args: Any) -> Any:
        named = with_retries(task_, rt.ctx.config.runtime, name, on_running=[signal_running])
        return run_gated(functools.partial(named, quote(rt.executor), *args)).result()

    def prepare(self, config: ExperimentConfig, cache_root: Path) -> PreparedData:
        return run_prepare(config, cache_root)


class PlainCalls:
    """The very same node code without Prefect: plain recursion and direct executor calls.

    No retries and nothing in the Prefect UI; tests use it, and benchmarks/orchestration.py
    measures what the orchestration costs against it.
    """

    name = "plain"

    def run_node(self, run_path: str, node_id: str, phi_path: str | None, caller: Caller, *, subflow: bool) -> str:
        return execute_tree_node(run_path, node_id, phi_path, caller, self)

    def call_task(self, rt: NodeRuntime, task_: Task[..., Any], name: str, *args: Any) -> Any:
        return task_.fn(rt.executor, *args)

    def prepare(self, config: ExperimentConfig, cache_root: Path) -> PreparedData:
        return prepare_data(config, cache_root, log=progress.note)


PREFECT_RUNS = PrefectRuns()
PLAIN_CALLS = PlainCalls()
