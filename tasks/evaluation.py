"""The worker call for evaluation, and what to evaluate: node models and per-client baselines.

The scoring itself runs on the workers (tasks/scoring.py); this module decides which
models a final or intermediate evaluation scores and what each costs (for placement).
``evaluate_models`` is a plain function: the run's orchestration calls it directly or as
the Prefect task ``evaluate-models`` (flows/orchestration.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from bhfl_core.analysis.matrix_axes import ModelRef
from bhfl_core.analysis.model_values import ModelValues
from bhfl_core.placement import Slot
from tasks.context import RunContext
from tasks.executor import Executor, gather
from tasks.scoring import local_only_rounds
from tasks.worker import WorkerRuntime


def node_models(ctx: RunContext, servers_only: bool = False) -> list[ModelRef]:
    """Every server model and (``eval.client_models``, unless ``servers_only``) every persistent
    client model and Ditto personal model."""
    nodes = [ModelRef.of_node(n.id) for n in ctx.tree.servers()]
    if ctx.config.eval.client_models and not servers_only:
        population = set(ctx.eval_plan.population)
        clients = [n for n in ctx.tree.clients() if n.id in population and ctx.store.has(n.id)]
        nodes += [ModelRef.of_node(n.id) for n in clients if n.settings.persistent]
        nodes += [ModelRef.personal(n.id) for n in clients if n.settings.personal is not None]
    return nodes


def baseline_models(ctx: RunContext) -> tuple[list[ModelRef], list[float]]:
    """The per-client baselines the config asks for, with a relative cost for placement.

    Cost ~ rows trained (x3: a training step costs about three inference passes) plus
    the evaluation pass every model pays.
    """
    models: list[ModelRef] = []
    loads: list[float] = []
    ev = ctx.config.eval
    test_rows = int(ctx.manifest.clients.test_size.sum()) + ctx.manifest.proxy_test.size
    population = set(ctx.eval_plan.population)
    for client in ctx.tree.clients():
        if client.id not in population:
            continue
        train = client.settings.train
        assert train is not None
        rows = ctx.manifest.clients.by_id(client.id).train.size * train.epochs
        if ev.local_adaptation is not None:
            models.append(ModelRef.adapted(client.id))
            loads.append(test_rows + 3.0 * rows * ev.local_adaptation.rounds)
        if ev.local_only is not None:
            models.append(ModelRef.local_only(client.id))
            loads.append(test_rows + 3.0 * rows * local_only_rounds(ctx, client.id))
    return models, loads


def evaluate_models(
    executor: Executor, batches: Sequence[tuple[Slot, list[ModelRef]]], run_path: str
) -> list[ModelValues]:
    """Every model's metrics on its test sets, each batch scored on its slot (tasks/scoring.py)."""
    return [
        values
        for part in gather([executor.submit(slot, WorkerRuntime.evaluate, run_path, m) for slot, m in batches])
        for values in part
    ]
