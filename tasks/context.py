"""What a run is, rebuilt from its run folder alone.

The orchestrator's subflows and the worker processes receive only the run folder (a
string: serialisable, valid in any process that sees the folder) and get everything
else from here: the resolved config, the data manifest, the tree, the state store,
and (workers) the data shards. Nothing of a run lives in a process-global registry;
``open_run`` keeps a few opened contexts in one bounded cache (``OpenedRuns``: its
bound and invalidation), so the many calls of a run do not read its files again.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
import yaml
from torch import nn

from bhfl_core.algorithm.tree import Tree
from bhfl_core.analysis.eval_plan import EvalPlan
from bhfl_core.analysis.model_values import MatrixBuilder
from bhfl_core.config.base import ConfigError
from bhfl_core.config.schema import ExperimentConfig
from bhfl_core.config.topology import build_tree
from bhfl_core.learning.adapter_layout import needs_layout, with_adapter_layout
from bhfl_core.learning.local_train import compact
from bhfl_core.learning.models import build_model
from bhfl_core.learning.task_kinds import TaskFacts, TaskKind, get_task_kind
from bhfl_core.store.node_store import StateStore
from bhfl_core.store.run_layout import BACKBONE_FILE, CONFIG_FILE, DATA_POINTER, STATE_DIR, TIMELINE_DIR
from bhfl_core.store.transfer import Transfer, transfer_folder
from bhfl_core.store.warm_start import load_backbone
from data_prep.manifest import Manifest
from data_prep.prepare import load_shard
from data_prep.shards import load_shards
from tasks.faults import NO_FAULTS, FaultPlan
from tasks.local_cluster import CPU_WORKERS_AUTO_MAX

TEST_CHUNK = 500  # clients' test rows read (and made compact) at a time


@dataclass
class RunContext:
    run_path: Path
    config: ExperimentConfig
    data_root: Path
    manifest: Manifest
    faults: FaultPlan = NO_FAULTS  # BHFL_FAULTS for this attempt, read by ``open`` (one built directly plans none)
    _proxy: dict[tuple[str, tuple[str, ...] | None], dict[str, torch.Tensor]] = field(default_factory=dict)
    _scoring: ScoringTable | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def open(cls, run_path: Path, config: ExperimentConfig | None = None) -> RunContext:
        """The run in ``run_path``; ``config``: its config, already validated by the caller (else read here)."""
        if config is None:
            config = ExperimentConfig.model_validate(
                yaml.safe_load((run_path / CONFIG_FILE).read_text(encoding="utf-8"))
            )
        data_root = Path(json.loads((run_path / DATA_POINTER).read_text(encoding="utf-8"))["data_root"])
        return cls(run_path, config, data_root, Manifest.read(data_root), FaultPlan.for_run(run_path))

    @cached_property
    def tree(self) -> Tree:
        """The run's tree. In a LoRA run where servers fold the adapters' products (``model.adapter.aggregation:
        exact``, ``error_metric``) or nodes cap their rank (``adapter_rank``), with the model's layout of A and B
        filled in (one model built for it: bhfl_core/learning/adapter_layout.py)."""
        tree = build_tree(self.config, self.manifest.tree_clients())
        if needs_layout(tree):
            tree = with_adapter_layout(tree, self.training_model())
        return tree

    @cached_property
    def store(self) -> StateStore:
        clients = frozenset(n.id for n in self.tree.clients())  # read once, written once: not kept in the page cache
        return StateStore(self.run_path / STATE_DIR, self.faults.checkpoint_hook(), uncached=clients.__contains__)

    @cached_property
    def transfer(self) -> Transfer:
        """Where models travel between the run's processes (shared memory unless workers are on other machines)."""
        runtime = self.config.runtime
        return Transfer(transfer_folder(self.run_path, runtime.transfer, local=runtime.executor != "cluster"))

    def build_model(self, seed: int) -> nn.Module:
        """The run's model seeded by ``seed``, on the run's frozen backbone file when it has one."""
        m = self.manifest
        path = self.backbone_path()
        backbone = load_backbone(path) if path is not None else None
        return build_model(self.config.model, m.task, m.labels, m.vocab_size, m.pad_token_id, seed, backbone=backbone)

    def training_model(self) -> nn.Module:
        """The model every worker trains and scores on (seeded by ``seed``): its frozen part is the run's backbone.

        Node vectors are loaded into it with ``set_flat``; for a LoRA run they hold the
        adapters and head only, so whoever reads a node's model (``bhfl export``) must
        build this one, not the initial model (seeded by ``seed + model.init_seed_offset``).
        """
        return self.build_model(self.config.seed)

    def backbone_path(self) -> Path | None:
        """The backbone file of a LoRA run warm-started from a full run (bhfl_core/store/warm_start.py), else None.

        Looked up at each call, not cached: the experiment flow writes it after opening
        the context, before the first model is built.
        """
        path = self.run_path / BACKBONE_FILE
        return path if self.config.model.adapter is not None and path.is_file() else None

    @cached_property
    def task_kind(self) -> TaskKind:
        """The kind of the manifest's ``task``: training transform, scorer, metrics."""
        return get_task_kind(self.manifest.task)

    @cached_property
    def task_facts(self) -> TaskFacts:
        """What the task kind needs of this run: labels and tokenizer ids (manifest), masking rate and seed (config)."""
        m = self.manifest
        return TaskFacts(
            m.task,
            tuple(m.labels),
            m.vocab_size,
            tuple(m.special_ids),
            m.mask_token_id,
            self.config.model.mlm_probability,
            self.config.seed,
        )

    def shard(self, relative: str) -> dict[str, torch.Tensor]:
        return load_shard(self.data_root / relative)

    def proxy(self, split: str, node_id: str | None = None) -> dict[str, torch.Tensor]:
        """The proxy split (root or ``None``: all of it; another server: its languages' share).

        Loaded once per process and node group: every round of every server reuses it.
        """
        shard = self.manifest.proxy_train if split == "train" else self.manifest.proxy_test
        if not shard.size:
            raise ConfigError(
                f"proxy_train: node {node_id or self.tree.root_id!r} trains on proxy data, but the data in "
                f"{self.data_root} has no proxy {split} split (set proxy_train: false for it)"
            )
        languages = None
        if node_id is not None and node_id != self.tree.root_id:
            languages = tuple(sorted({self.tree[c].group or "" for c in self.tree.leaves_under(node_id)}))
        key = (split, languages)
        if key not in self._proxy:
            full = self.shard(shard.path)
            if languages is None:
                self._proxy[key] = full
            else:
                ranges = [shard.language_rows[lang] for lang in languages if lang in shard.language_rows]
                if not ranges:
                    raise ValueError(
                        f"the proxy {split} split has no rows for the languages {languages} under {node_id!r}"
                    )
                self._proxy[key] = {k: torch.cat([v[a:b] for a, b in ranges]) for k, v in full.items()}
        return self._proxy[key]

    def test_sets(
        self, proxy_name: str, narrow: bool = False, only: Sequence[str] | None = None
    ) -> tuple[list[str], dict[str, torch.Tensor], torch.Tensor]:
        """Every client test split (``only``: those clients', in manifest order) and the proxy test split as one
        tagged table (read anew each call: the evaluation keeps its own compact copy, ``scoring_table``).

        Empty splits (a prepared dataset without client test data) are named but have no rows.
        ``narrow``: integer columns in their narrowest type (``local_train.compact``), read a
        chunk of clients at a time, so the int64 rows are never all in memory at once.
        """
        clients = self.manifest.clients
        kept = np.isin(clients.ids, np.asarray(only, dtype=clients.ids.dtype)) if only is not None else slice(None)
        names = [*clients.ids[kept].tolist(), proxy_name]
        sizes = [*clients.test_size[kept].tolist(), self.manifest.proxy_test.size]
        tests = clients.test_path[kept][clients.test_size[kept] > 0].tolist()
        chunk = TEST_CHUNK if narrow else max(len(tests), 1)
        # one read where they are one range; ``narrow``: a chunk of clients at a time, each made compact at once
        parts = [load_shards(self.data_root, tests[i : i + chunk]) for i in range(0, len(tests), chunk)]
        if sizes[-1]:
            parts.append(self.proxy("test"))
        if narrow:
            parts = [compact(part) for part in parts]
        data = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        groups = torch.repeat_interleave(torch.arange(len(names)), torch.tensor(sizes))
        return names, data, groups

    def scoring_table(self, proxy_name: str) -> ScoringTable:
        """``test_sets`` as the task's scorer reads it, and where each split's rows are (built once).

        Its integer columns are held in the narrowest integer type that holds their values
        (token ids of a 30k vocabulary in int16, masks in int8: a quarter or an eighth of
        int64; batches widen them again, ``local_train.widened``): 10,000 clients' test rows
        take ~45 MB a worker instead of ~250 MB.

        The task kind prepares the table once (masked LM: the evaluation masks, drawn from
        the run seed over the whole table), so every model, and every subset of clients a
        model is scored on, sees the same rows the same way.

        Where the evaluation's population is a sample (``eval.clients: N``) every model is
        scored on the sample's splits only (``EvalPlan``), so only theirs are read: at
        100,000 clients and a sample of 10,000 a tenth of the rows. (Not for a task that
        prepares the table: the masked LM's evaluation masks are drawn over the whole table,
        and the trivial baselines count the same masks.)
        """
        with self._lock:
            if self._scoring is None:
                prepare = self.task_kind.scoring_table
                plan = self.eval_plan
                only = plan.population if prepare is None and not plan.complete else None
                names, data, groups = self.test_sets(proxy_name, narrow=prepare is None, only=only)
                table = prepare(data, self.task_facts) if prepare is not None else dict(data)
                sizes = torch.bincount(groups, minlength=len(names))
                starts = torch.cumsum(sizes, 0) - sizes  # the rows are concatenated split after split
                self._scoring = ScoringTable(names, compact(table), groups, starts, sizes)
            return self._scoring

    @cached_property
    def matrix_builder(self) -> MatrixBuilder:
        """What reduces a scored model's blocks to its metrics, for the plan's population."""
        return MatrixBuilder(self.tree, self.task_kind.metrics, self.eval_plan.population)

    @cached_property
    def eval_plan(self) -> EvalPlan:
        """Which client test splits each model is scored on (``eval.clients``, ``eval.client_model_sample``)."""
        return EvalPlan(self.tree, self.config.seed, *self.config.eval.sample_sizes())


@dataclass(frozen=True)
class ScoringTable:
    """Every client test split and the proxy's as one table: ``names[i]``'s rows are ``starts[i]`` to
    ``starts[i] + sizes[i]``, tagged ``i`` in ``groups``."""

    names: list[str]
    data: dict[str, torch.Tensor]
    groups: torch.Tensor
    starts: torch.Tensor
    sizes: torch.Tensor


Stamp = tuple[int, int]  # modification times (ns) of a run's config and data pointer


class OpenedRuns:
    """The run contexts this process has opened, by run folder, so a run's calls share one.

    Bound: ``size`` runs, the least recently asked for dropped first; each context holds
    tensors (the proxy and test splits, loaded on first use), so a long-lived process (a
    user's Dask worker serving run after run, a sweep) must not keep them all.
    Invalidation: an entry stands while its run's config and data pointer files keep their
    modification times. A resume that changed ``runtime.*`` keys rewrites the config, and
    every attempt rewrites the data pointer, so each attempt opens its run afresh (and its
    fault plan, ``RunContext.faults``, is read again); the earlier attempt's context is
    dropped then. ``forget`` drops a run's context when the run ends.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._opened: OrderedDict[Path, tuple[Stamp, RunContext]] = OrderedDict()

    def open(self, run_path: str | Path, config: ExperimentConfig | None = None) -> RunContext:
        """The context of the run in ``run_path`` as its files are now (``config``: see ``open_run``)."""
        path = Path(run_path).resolve()
        stamp = ((path / CONFIG_FILE).stat().st_mtime_ns, (path / DATA_POINTER).stat().st_mtime_ns)
        with self._lock:
            kept = self._opened.pop(path, None)
            ctx = kept[1] if kept is not None and kept[0] == stamp else RunContext.open(path, config)
            self._opened[path] = (stamp, ctx)
            while len(self._opened) > self._size:
                self._opened.popitem(last=False)
            return ctx

    def forget(self, run_path: str | Path) -> None:
        """Drop the context of the run in ``run_path``, if one is kept: the run has ended here."""
        with self._lock:
            self._opened.pop(Path(run_path).resolve(), None)

    def paths(self) -> list[str]:
        """The run folders whose contexts are kept, least recently asked for first."""
        with self._lock:
            return [str(path) for path in self._opened]


# A sweep's points run in threads of one orchestrator, as many at once as it has local workers
# (at most CPU_WORKERS_AUTO_MAX with `workers: auto`): every point running keeps its context.
# Finished runs leave through ``forget_run``, in the orchestrator and (``Executor.forget``) in every worker of
# the run's cluster, so the bound is only reached by runs in progress.
_OPENED = OpenedRuns(size=CPU_WORKERS_AUTO_MAX)


def open_run(run_path: str | Path, config: ExperimentConfig | None = None) -> RunContext:
    """The run's context, opened once per process and attempt (``OpenedRuns``).

    ``config``: the run's config, already validated by the caller (the experiment flow
    passes the one it wrote to ``config.yaml``), so it is not read and validated again.
    """
    return _OPENED.open(run_path, config)


def forget_run(run_path: str | Path) -> None:
    """Free this process's context of a run that has ended (its proxy and test tensors)."""
    _OPENED.forget(run_path)


def opened_runs() -> list[str]:
    """The run folders this process keeps a context of (what a long-lived worker holds: tests, diagnostics)."""
    return _OPENED.paths()


def mark_once(run_path: Path, event: str) -> None:
    """Record the wall time of the first occurrence of ``event`` in this run (any process, first wins).

    The run's timeline (``run.json``: first client training, ...) is read from these
    files, which any worker can create on a shared folder without a lock.
    """
    path = run_path / TIMELINE_DIR / event
    if path.exists():
        return
    path.parent.mkdir(exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as fh:
        fh.write(repr(time.time()))


def read_marks(run_path: Path) -> dict[str, float]:
    folder = run_path / TIMELINE_DIR
    if not folder.is_dir():
        return {}
    return {
        p.name: float(p.read_text(encoding="utf-8") or "nan")
        for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".")
    }
