"""Training the tree: each internal node's execution, as a Prefect subflow run or a plain call.

Every child execution and worker call goes through the run's orchestration
(flows/orchestration.py: ``run_node``, ``call_task``, ``start_task``), the synchronous
and the asynchronous ones alike, so each is a Prefect run with the run's retries under
``PREFECT_RUNS`` and a plain call under ``PLAIN_CALLS``.

Flow shape (what the Prefect UI shows under ``bhfl-experiment``)::

    node: root                         (subflow: one execution of the root = T_root rounds)
      node: <server>                   (subflow per execution of each internal node; siblings run concurrently)
        node: edge-<lang>
          train-clients x batches      (task per worker batch; the batch trains in that worker's process)
        proxy-train                    (task, where the server has proxy data)
      node: <asynchronous server>
        train-clients x calls          (task per client call, started and folded as each arrives)

``runtime.subflow_depth`` keeps deeper executions inside their parent's flow run.
The server rounds (NODEOPT on flat vectors, checkpoints) run here, in the orchestrating
process; client training and proxy training run on the run's executor. Models travel
as message files (``state/messages``) between node executions and tasks, and come back
from workers as weighted sums.
"""

from __future__ import annotations

import functools
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from bhfl_core.algorithm.async_engine import execute_async_node
from bhfl_core.algorithm.contract import ChildResult, MemberLoss, RoundPlan
from bhfl_core.algorithm.engine import execute_node
from bhfl_core.algorithm.engine_hooks import PendingResult, PendingTrain
from bhfl_core.algorithm.node_state import NodeResult, RoundKey
from bhfl_core.algorithm.residuals import needs
from bhfl_core.algorithm.rule_registry import AggregationRule
from bhfl_core.algorithm.rules import rule_for
from bhfl_core.algorithm.tree import Node, TrainParams, planned_steps
from bhfl_core.algorithm.virtual_clock import ClockParams, client_call_s
from bhfl_core.placement import Job, place
from bhfl_core.store.transfer import SentResult, TensorRef, Transfer, receive_result, send_result
from flows import progress
from flows.creation_gate import run_gated, run_in_thread
from flows.evaluation import evaluate_step
from flows.node_runtime import NodeRuntime, node_runtime, worker_utilisation
from tasks.client_training import BatchCall
from tasks.context import mark_once
from tasks.executor import gather
from tasks.time_model import load_time_model, record_timings
from tasks.training import proxy_train, score_candidates, train_clients
from tasks.worker import SentTrain

if TYPE_CHECKING:
    from flows.orchestration_protocol import Orchestration


class FlowHooks:
    """EngineHooks for servers: child servers as node executions, clients as worker batches.

    How those run (Prefect runs or plain calls) is the runtime's ``orchestration``.
    Models go to the workers and come back by reference (``bhfl_core/store/transfer.py``).
    """

    def __init__(self, rt: NodeRuntime) -> None:
        self.rt = rt
        self.round_started: dict[int, float] = {}
        self._sent: dict[str, _Sent] = {}  # async: node -> the latest model sent, and its file

    # ------------------------------------------------------------ children

    def _run_child(self, child: Node, phi: TensorRef, plan: RoundPlan) -> SentResult:
        depth = self.rt.ctx.config.runtime.subflow_depth
        subflow = depth is None or child.depth <= depth
        return self.rt.orchestration.run_node(self.rt.run_path, child.id, phi, plan, subflow=subflow)

    def _run_servers(self, servers: list[Node], phi: TensorRef, plans: Mapping[str, RoundPlan]) -> list[ChildResult]:
        """Execute child servers, concurrently unless ``runtime.parallel_subtrees`` is off; results in cohort order.

        Each child runs in its own thread (a copy of this context: Prefect nests its
        subflow under this flow run); the subflows are created one at a time.
        """
        if not self.rt.ctx.config.runtime.parallel_subtrees:
            sent = [self._run_child(c, phi, plans[c.id]) for c in servers]
        else:
            sent = gather([run_gated(functools.partial(self._run_child, c, phi, plans[c.id])) for c in servers])
        return [receive_result(s, None) for s in sent]

    def _run_clients(
        self, node: Node, leaves: list[Node], phi: TensorRef, plan: RoundPlan, alone: bool
    ) -> list[ChildResult]:
        """The round's clients as worker batches; ``alone``: nothing else (child servers, proxy TRAIN) joins their fold.

        When one batch holds them all, its worker closes the fold (``AggregationRule.close``).
        """
        runtime = self.rt.ctx.config.runtime
        keep, select = needs(node.settings.res_up)

        def params(train: TrainParams) -> TrainParams:
            return train if plan.epochs is None else replace(train, epochs=plan.epochs)

        jobs = [Job(c.id, planned_steps(int(c.weight), params(c.settings.train))) for c in leaves if c.settings.train]
        model = load_time_model(self.rt.ctx.run_path) if runtime.placement == "learned" else None
        placed = place(jobs, self.rt.executor.slots(), runtime.placement, model)
        spread = ", ".join(f"{len(a.jobs)} on {a.slot.name}" for a in placed)
        name = f"train {node.id} r{(plan.caller.round or 0) + 1} [{len(jobs)} clients: {spread}]"
        batch_call = BatchCall(keep=keep, select=select, whole_round=alone and len(placed) == 1)
        batches = [(a.slot, list(a.jobs)) for a in placed]
        sent = self.rt.orchestration.call_task(
            self.rt, train_clients, name, batches, self.rt.run_path, plan, phi, batch_call
        )
        rule = rule_for(node.settings.aggregate)
        results = [receive_result(s, rule) for s in sent]
        if runtime.placement == "learned":
            record_timings(self.rt.ctx.run_path, [(w.device_kind, w.steps, w.seconds) for r in results for w in r.work])
        order = {c.id: i for i, c in enumerate(leaves)}
        for client_id in sorted((d for r in results for d in r.dropped), key=order.__getitem__):
            progress.note(
                f"client {client_id} failed and was dropped from {node.id} round {(plan.caller.round or 0) + 1}"
            )
        return results

    def run_children(
        self, node: Node, cohort: list[Node], theta: torch.Tensor, plans: Mapping[str, RoundPlan]
    ) -> list[ChildResult]:
        self.round_started[next(iter(plans.values())).caller.round or 0] = time.time()
        phi = self.rt.ctx.transfer.put(f"{node.id}.down", theta)
        servers = [c for c in cohort if not c.is_leaf]
        leaves = [c for c in cohort if c.is_leaf]
        try:
            results = self._run_servers(servers, phi, plans)
            if leaves:  # one plan for all of them: the node's children share its round and its epochs
                alone = not servers and not node.settings.proxy_async
                results += self._run_clients(node, leaves, phi, plans[leaves[0].id], alone)
        finally:
            self.rt.ctx.transfer.done_with(phi)  # every child has read it (a retried batch ran inside _run_clients)
        return results

    # ------------------------------------------------ asynchronous nodes (bhfl_core/algorithm/async_engine.py)

    def start_child(self, node: Node, child: Node, theta: torch.Tensor, plan: RoundPlan) -> PendingResult:
        """Begin one child execution from ``theta`` (a client: a one-client batch on a worker; a server: a thread)."""
        rt = self.rt
        sent = self._sent.get(node.id)
        if sent is None or sent.theta is not theta:  # one file per model version, not per dispatch
            if sent is not None:
                sent.retire()
            sent = _Sent(theta, rt.ctx.transfer.put(f"{node.id}.down-{plan.caller.round}", theta))
            self._sent[node.id] = sent
        phi = sent.use()
        if not child.is_leaf:
            return _ServerCall(run_gated(functools.partial(self._run_child, child, phi, plan)), sent)
        slots = rt.executor.slots()
        slot = slots[(plan.caller.round or 0) % len(slots)]
        name = f"train {child.id} r{(plan.caller.round or 0) + 1} [async, on {slot.name}]"
        batch = [(slot, [child.id])]  # one client, its own model back (not folded): the node folds it when it arrives
        pending = rt.orchestration.start_task(
            rt, train_clients, name, batch, rt.run_path, plan, phi, BatchCall(fold=False)
        )
        return _ClientCall(child.id, pending, rule_for(node.settings.aggregate), sent)

    def call_duration(self, node: Node, child: Node, plan: RoundPlan) -> float | None:
        """A client call's virtual duration (its planned steps over its speed, plus transfers); servers: None."""
        if not child.is_leaf or child.settings.train is None:
            return None
        cfg = self.rt.ctx.config
        clock = ClockParams(**cfg.tree.clock.model_dump())
        return client_call_s(cfg.seed, clock, child, plan.epochs, plan.caller.round or 0)

    # ------------------------------------------------------------ the node's own steps

    def train(self, node: Node, theta: torch.Tensor, key: RoundKey, plan: RoundPlan) -> NodeResult:
        """Proxy TRAIN of a server, on a worker (the model travels by reference)."""
        ctx = self.rt.ctx
        assert node.settings.train is not None
        steps = planned_steps(ctx.manifest.proxy_train.size, node.settings.train)
        slot = place([Job(node.id, steps)], self.rt.executor.slots(), "lpt")[0].slot
        theta_ref = ctx.transfer.put(f"{node.id}.proxy-in", theta)
        try:
            sent: SentTrain = self.rt.orchestration.call_task(
                self.rt,
                proxy_train,
                f"proxy-train {node.id} r{key.round + 1} [on {slot.name}]",
                slot,
                self.rt.run_path,
                node.id,
                key,
                theta_ref,
            )
        finally:
            ctx.transfer.done_with(theta_ref)
        trained = Transfer.get(sent.model)
        Transfer.drop(sent.model)
        return NodeResult(trained, sent.loss, sent.examples, sent.steps)

    def start_train(self, node: Node, theta: torch.Tensor, key: RoundKey) -> PendingTrain:
        """Proxy TRAIN alongside the node's children (``proxy_train: async``): the same task, in its own thread.

        One at a time per node (the engines wait for it before starting the next), so its
        files are the node's usual ``proxy-in``/``proxy-out``.
        """
        return run_in_thread(functools.partial(self.train, node, theta, key, RoundPlan(key.caller)))

    def score(self, node: Node, candidates: Sequence[torch.Tensor]) -> list[float]:
        """A tuned NODEOPT's candidates scored on the server's held-out proxy rows, on a worker."""
        ctx = self.rt.ctx
        refs = [ctx.transfer.put(f"{node.id}.candidate-{i}", c) for i, c in enumerate(candidates)]
        slot = self.rt.executor.slots()[0]
        name = f"{node.id}: score {len(refs)} candidates on {slot.name}"
        try:
            losses: list[float] = self.rt.orchestration.call_task(
                self.rt, score_candidates, name, slot, self.rt.run_path, node.id, refs
            )
        finally:
            for ref in refs:
                ctx.transfer.done_with(ref)
        return losses

    def train_personal(self, node: Node, personal: torch.Tensor, anchor: torch.Tensor, key: RoundKey) -> NodeResult:
        raise RuntimeError(f"{node.id} is a server; only clients keep a personal (Ditto) model")

    def round_done(self, node: Node, key: RoundKey, theta: torch.Tensor, metrics: dict[str, float]) -> None:
        rt = self.rt
        is_root = node.parent is None
        if is_root:  # a round ends where the next one starts (its commit may be settled later: RoundCommits)
            ended = self.round_started.get(key.round + 1, time.time())
            started = self.round_started.get(key.round, ended)
            metrics = {**metrics, **worker_utilisation(rt, started, ended)}
        if not node.is_leaf:  # committed, not yet logged: a resume logs it from the saved state (experiment.py)
            rt.ctx.faults.hit("round", f"{node.id} round {key.round + 1}")
        rt.tracker.log_node(node.id, metrics, step=key.round + 1)
        progress.node_round(node.id, node.depth, key.round, metrics)
        every = rt.ctx.config.eval.every
        is_last = key.round + 1 >= node.settings.rounds
        if is_root and is_last:
            mark_once(rt.ctx.run_path, "last_aggregate")
        if is_root and every and (key.round + 1) % every == 0 and not is_last:
            evaluate_step(rt, key.round + 1)


def execute_tree_node(
    run_path: str, node_id: str, phi: TensorRef | None, plan: RoundPlan, orchestration: Orchestration
) -> SentResult:
    """EXECUTENODE for one internal node from its parent's model; returns what goes up to the parent, by reference.

    (In memory it would be simpler, but Prefect keeps a subflow's return value until the
    whole experiment's flow ends: a model-sized one per server execution.)
    """
    with node_runtime(run_path, orchestration) as rt:
        ctx = rt.ctx
        node = ctx.tree[node_id]
        start = Transfer.get(phi) if phi is not None else None
        run = execute_async_node if node.settings.asynchronous is not None else execute_node
        result = run(ctx.tree, node, start, ctx.store, FlowHooks(rt), ctx.config.seed, plan)
        losses = (MemberLoss(node_id, result.loss, result.examples),) if result.examples else ()
        up = ChildResult(
            members=(node_id,),
            model=result.theta,
            weight=node.weight,
            losses=losses,
            virtual_s=result.virtual_s,
            sent_bytes=result.sent_bytes,
        )
        if node.parent is None:  # the root: its model is in its checkpoint, and nobody folds it
            return SentResult(replace(up, model=None))
        return send_result(up, None, ctx.transfer, f"{node_id}.up.{secrets.token_hex(4)}")


class _Sent:
    """A model version an asynchronous node sent, in its transfer file, and the calls still using it.

    The file is removed once the node has moved to a newer version and every call sent
    this one has returned (a queued call maps the file only when its worker starts it).
    """

    def __init__(self, theta: torch.Tensor, ref: TensorRef) -> None:
        self.theta, self.ref = theta, ref
        self.users, self.current = 0, True
        self._lock = threading.Lock()

    def use(self) -> TensorRef:
        with self._lock:
            self.users += 1
        return self.ref

    def done(self) -> None:
        with self._lock:
            self.users -= 1
            if not self.users and not self.current:
                Transfer.drop(self.ref)

    def retire(self) -> None:
        with self._lock:
            self.current = False
            if not self.users:
                Transfer.drop(self.ref)


class _ClientCall:
    """A one-client worker batch started by an asynchronous node; ``result`` waits for it (once)."""

    def __init__(self, client_id: str, pending: Future[list[SentResult]], rule: AggregationRule, sent: _Sent) -> None:
        self.client_id, self.rule = client_id, rule
        self.received: Future[ChildResult | None] = Future()

        def receive() -> ChildResult | None:
            try:
                (one,) = pending.result()  # the call runs from its start; waited for here
                result = receive_result(one, rule)
            finally:
                sent.done()
            if result.model is None:  # failed and dropped (runtime.on_client_failure: drop)
                progress.note(f"client {client_id} failed and was dropped")
                return None
            return result

        self._receive = receive

    def result(self) -> ChildResult | None:
        """The call's result, received once (its files are mapped and removed on the first ask)."""
        if not self.received.done():
            try:
                self.received.set_result(self._receive())
            except BaseException as exc:
                self.received.set_exception(exc)
        return self.received.result()


class _ServerCall:
    """A child server's execution started by an asynchronous node; ``result`` waits for it (received once)."""

    def __init__(self, future: Future[SentResult], sent: _Sent) -> None:
        self.received: Future[ChildResult] = Future()
        future.add_done_callback(lambda _: sent.done())
        self._future = future

    def result(self) -> ChildResult:
        if not self.received.done():
            try:
                self.received.set_result(receive_result(self._future.result(), None))
            except BaseException as exc:
                self.received.set_exception(exc)
        return self.received.result()
