"""scale.py's reference: the same client trainings as a plain FedAvg loop in one process, no Prefect, MLflow or Dask.

``loop_child`` runs in a fresh process (``scale.py --loop-child RUN PLAN``) on the data
bhfl prepared for the case, with the project's own loaders; ``run_loop`` starts and
measures it like a bhfl run (benchmarks/scale.py's docstring says what it does and
does not do).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from _scale_case import Case
from _scale_measure import Figures, child_env, measure, phase_peaks, phases

SCALE = Path(__file__).resolve().with_name("scale.py")  # the command whose hidden --loop-child runs loop_child


def loop_child(run_path: Path, plan: dict[str, Any]) -> None:
    """In a fresh process: the plain FedAvg loop on the run's prepared data; prints its timestamps as JSON."""
    started = psutil.Process().create_time()
    import numpy as np
    import torch

    from bhfl_core.algorithm.tree import Role
    from bhfl_core.learning.local_train import train_model
    from tasks.client_training import LocalTrainer
    from tasks.context import RunContext

    imported = time.time()
    ctx = RunContext.open(run_path)  # the run's config, data manifest and tree: the project's loaders
    cfg, tree = ctx.config, ctx.tree
    edges = [[c.id for c in tree.children(n.id)] for n in tree if n.role == Role.EDGE]
    data_ready = time.time()
    torch.set_num_threads(cfg.runtime.torch_threads)
    device = torch.device("cpu")
    model = ctx.build_model(cfg.seed + cfg.model.init_seed_offset)
    # A client's training rows as bhfl's worker loads them (whatever the data layout on disk is).
    rows_of = LocalTrainer(ctx, model, device)._data
    params = [p for p in model.parameters() if p.requires_grad]
    global_weights = [p.detach().clone() for p in params]
    rng = np.random.default_rng(cfg.seed)
    per_edge = plan["per_edge"]
    first, trainings, examples = 0.0, 0, 0
    for _ in range(plan["rounds"]):
        cohort = [str(cid) for ids in edges for cid in rng.choice(ids, per_edge, replace=per_edge > len(ids)).tolist()]
        total, new = 0, [torch.zeros_like(w) for w in global_weights]
        for cid in cohort:
            first = first or time.time()
            node = tree[cid]
            rows = rows_of(node)[0]
            with torch.no_grad():
                for p, w in zip(params, global_weights):
                    p.copy_(w)
            result = train_model(model, rows, node.settings.train, int(rng.integers(2**31)), device)
            with torch.no_grad():
                for acc, p in zip(new, params):
                    acc.add_(p.detach(), alpha=float(result.examples))
            total += result.examples
            trainings += 1
        global_weights = [acc / max(total, 1) for acc in new]
        examples += total
    last = time.time()
    with torch.no_grad():
        for p, w in zip(params, global_weights):
            p.copy_(w)
    _, test, _ = ctx.test_sets("proxy")  # every client's test rows and the proxy test rows, as evaluation loads them
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(test["labels"]), cfg.eval.batch_size):
            batch = {k: v[i : i + cfg.eval.batch_size] for k, v in test.items()}
            if "attention_mask" in batch:
                width = int(batch["attention_mask"].sum(dim=1).max())
                batch = {k: v[:, :width] if v.dim() == 2 else v for k, v in batch.items()}
            labels = batch.pop("labels")
            correct += int((model(**batch).logits.argmax(-1) == labels).sum())
    done = time.time()
    print(
        json.dumps(
            {
                "start": started,
                "flow": imported,
                "data": data_ready,
                "first": first,
                "last": last,
                "eval_start": last,
                "eval_end": done,
                "trainings": trainings,
                "examples": examples,
                "accuracy": correct / max(len(test["labels"]), 1),
            }
        )
    )


def run_loop(args: argparse.Namespace, case: Case, run_path: Path) -> Figures:
    plan = {"rounds": case.rounds, "per_edge": case.per_edge_round}
    cmd = [sys.executable, str(SCALE), "--loop-child", str(run_path), json.dumps(plan)]
    m = measure(cmd, child_env(args), args.interval)
    t = json.loads(m.stdout[-1][1])
    fig = phases(t, m.exited, t["trainings"])
    fig["close"] = math.nan  # the loop's training ends where its evaluation starts
    fig.update(
        {
            "pss_mb": m.sampler.peak_pss_mb(),
            **phase_peaks(m.sampler, t, m.exited),
            "cpu_s": m.sampler.cpu_s,
            "accuracy": t["accuracy"],
            "examples": t["examples"],
        }
    )
    return fig
