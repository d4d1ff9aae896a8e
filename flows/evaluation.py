"""Evaluation as flows see it: every node model (and the baselines) scored on the workers, logged."""

from __future__ import annotations

import time

from bhfl_core.algorithm.round_tail import VIRTUAL_TIME
from bhfl_core.analysis.evaluation import Evaluation
from bhfl_core.analysis.matrix_axes import ModelRef
from bhfl_core.analysis.model_values import ModelValues
from bhfl_core.analysis.time_to_accuracy import round_label
from bhfl_core.learning.metrics import task_metrics
from bhfl_core.placement import Job, place
from flows import progress
from flows.node_runtime import NodeRuntime
from flows.records.run_record import RunRecord
from tasks.evaluation import baseline_models, evaluate_models, node_models


def evaluate_all(rt: NodeRuntime, step: int, final: bool = False) -> Evaluation:
    """Score the node models (and, when ``final``, the configured per-client baselines) on every test set.

    Node models first (during training, with ``eval.during: servers``, the servers
    only), then the baselines (local-only, local adaptation; they train first), each
    phase spread over the workers; both phases' wall times go to MLflow.
    """
    ctx = rt.ctx
    values: list[ModelValues] = []
    seconds: dict[str, float] = {}
    nodes = node_models(ctx, servers_only=not final and ctx.config.eval.during == "servers")
    phases: list[tuple[str, list[ModelRef], list[float]]] = [("time/eval_s", nodes, [1.0] * len(nodes))]
    if final:
        phases.append(("time/baselines_s", *baseline_models(ctx)))
    for timer, models, loads in phases:
        if not models:
            continue
        started = time.time()
        by_name = {m.name: m for m in models}
        jobs = [Job(m.name, max(1, round(load))) for m, load in zip(models, loads)]
        plan = place(jobs, rt.executor.slots(), "lpt")
        batches = [(a.slot, [by_name[j] for j in a.jobs]) for a in plan]
        name = f"evaluate {len(models)} models on " + ", ".join(a.slot.name for a in plan)
        values += rt.orchestration.call_task(rt, evaluate_models, name, batches, rt.run_path)
        seconds[timer] = time.time() - started
    evaluation = Evaluation(ctx.tree, task_metrics(ctx.manifest.task), values, ctx.eval_plan.population)
    # the root's virtual clock at this evaluation: the x axis of time-to-accuracy (report, `bhfl compare`)
    root = ctx.store.load_header(ctx.tree.root_id)
    if root.rounds_done:
        seconds[VIRTUAL_TIME] = root.virtual_s
    from flows.tracking.report import log_evaluation  # matplotlib and the report code: not needed at start-up

    log_evaluation(rt.tracker, evaluation, step, seconds)
    progress.note(f"evaluated {len(values)} models after root round {round_label(step, ctx.tree.root.settings.rounds)}")
    return evaluation


def evaluate_step(rt: NodeRuntime, step: int) -> None:
    """An evaluation during training (``eval.every``), recorded so a resumed run does not repeat it."""
    record = RunRecord.read(rt.ctx.run_path) or rt.record
    if step in record.evaluated_steps:
        return
    rt.ctx.faults.hit("eval", f"step {step}")
    evaluate_all(rt, step=step)
    record.evaluated_steps.append(step)
    record.write(rt.ctx.run_path)
