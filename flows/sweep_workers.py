"""Where a sweep's points run: one set of workers they share, and how many points go at once.

When every point runs on ``runtime.executor: local`` (or one given ``cluster``) with the
same ``runtime`` settings, the sweep starts one worker cluster and every point places its
work on it (a worker serves any run: tasks/worker.py), so N experiments share N workers
instead of starting N clusters on the same cores. An experiment alternates between
worker calls and its own server rounds, evaluation and bookkeeping in the orchestrator,
so one experiment in flight per shared worker keeps every worker busy while each waits
on the others' calls no longer than one call per worker.
"""

from __future__ import annotations

from collections.abc import Sequence

from bhfl_core.config.schema import RuntimeConfig, dump
from bhfl_core.config.sweep import Sweep


def shared_runtime(sweep: Sweep, labels: Sequence[str]) -> RuntimeConfig | None:
    """The ``runtime`` every point in ``labels`` has, if they can share one set of workers; else None.

    Shareable: a local cluster (``executor: local``) or a given one (``executor: cluster``),
    with identical ``runtime`` settings (a grid over ``runtime.workers`` gets a cluster per point).
    """
    runtimes = {repr(dump(sweep[label].config)["runtime"]): sweep[label].config.runtime for label in labels}
    if len(runtimes) != 1:
        return None
    (runtime,) = runtimes.values()
    return runtime if runtime.executor in ("local", "cluster") else None


def default_parallel(runtime: RuntimeConfig | None, cluster: str | None) -> int:
    """Experiments in flight by default: one per shared worker (module docstring); 1 without shared workers."""
    if runtime is None:
        return 1
    if runtime.executor == "local":
        from tasks.local_cluster import local_slots

        return len(local_slots(runtime))
    from tasks.executor import cluster_workers

    return len(cluster_workers(cluster or runtime.cluster or "", runtime))


def resolve_lazy_imports(sweep: Sweep) -> None:
    """Resolve, in this thread, every transformers name the points' orchestration imports.

    transformers resolves its top-level names lazily, and two threads resolving one name
    at once can fail (``ImportError: cannot import name 'PreTrainedTokenizerFast'``: seen
    when two experiments of a sweep prepared their data side by side). Once resolved, a
    name is a plain module attribute.
    """
    import transformers

    from bhfl_core.learning.task_kinds import get_task_kind

    names = {"AutoConfig", "AutoTokenizer", "BertConfig", "PreTrainedTokenizerBase", "PreTrainedTokenizerFast"}
    names |= {get_task_kind(p.config.data.task).auto_class for p in sweep}
    for name in sorted(names):
        getattr(transformers, name)
