"""Per-process context of a run, rebuilt from the run folder alone.

Tasks receive only the run folder (a string: cacheable, serialisable, valid in any
worker process) and get everything else from here: the resolved config, the data
manifest, the tree, the state store, and a pool of reusable model instances. The
context is built once per process and run folder.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
import yaml
from torch import nn

from bhfl_core.config import ExperimentConfig
from bhfl_core.mlm import MaskingSpec
from bhfl_core.models import build_model
from bhfl_core.state_store import StateStore
from bhfl_core.topology import ClientInfo, build_tree
from bhfl_core.tree import Tree
from data_prep.manifest import ClientEntry, Manifest
from data_prep.prepare import load_shard
from tasks import faults

CONFIG_FILE = "config.yaml"
DATA_POINTER = "data.json"


def resolve_devices(setting: str) -> list[torch.device]:
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return [torch.device("cpu")]
    if not torch.cuda.is_available():
        raise RuntimeError("runtime.device is 'cuda' but no CUDA device is available (use 'auto' or 'cpu')")
    return [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]


def resolve_workers(config: ExperimentConfig, devices: list[torch.device]) -> int:
    """``auto``: one worker per GPU, or two CPU workers sharing the cores."""
    if config.runtime.workers != "auto":
        return int(config.runtime.workers)
    return len(devices) if devices[0].type == "cuda" else min(2, os.cpu_count() or 1)


class ModelPool:
    """Model instances reused across clients: at most one per worker, built lazily.

    A worker task takes an instance, loads a flat parameter vector into it, trains,
    and gives it back; instances are never shared by two tasks at once.
    """

    def __init__(self, build: Callable[[], nn.Module], devices: list[torch.device]) -> None:
        self._build = build
        self._devices = devices
        self._free: queue.SimpleQueue[tuple[nn.Module, torch.device]] = queue.SimpleQueue()
        self._made = 0
        self._lock = threading.Lock()

    @contextmanager
    def take(self) -> Iterator[tuple[nn.Module, torch.device]]:
        try:
            item = self._free.get_nowait()
        except queue.Empty:
            with self._lock:
                device = self._devices[self._made % len(self._devices)]
                self._made += 1
            item = (self._build().to(device), device)
        try:
            yield item
        finally:
            self._free.put(item)


@dataclass
class RunContext:
    run_path: Path
    config: ExperimentConfig
    data_root: Path
    manifest: Manifest
    _proxy: dict[tuple[str, tuple[str, ...] | None], dict[str, torch.Tensor]] = field(default_factory=dict)
    _tests: tuple[list[str], dict[str, torch.Tensor], torch.Tensor] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def open(cls, run_path: Path) -> RunContext:
        config = ExperimentConfig.model_validate(yaml.safe_load((run_path / CONFIG_FILE).read_text()))
        data_root = Path(json.loads((run_path / DATA_POINTER).read_text())["data_root"])
        return cls(run_path, config, data_root, Manifest.read(data_root))

    @cached_property
    def tree(self) -> Tree:
        clients = [ClientInfo(c.id, c.language, c.train.size, c.edge, c.cluster) for c in self.manifest.clients]
        return build_tree(self.config, clients)

    @cached_property
    def store(self) -> StateStore:
        return StateStore(self.run_path / "state", faults.checkpoint_hook())

    @cached_property
    def devices(self) -> list[torch.device]:
        return resolve_devices(self.config.runtime.device)

    @cached_property
    def workers(self) -> int:
        return resolve_workers(self.config, self.devices)

    @cached_property
    def clients(self) -> dict[str, ClientEntry]:
        return {c.id: c for c in self.manifest.clients}

    @cached_property
    def models(self) -> ModelPool:
        return ModelPool(lambda: self.build_model(self.config.seed), self.devices)

    def build_model(self, seed: int) -> nn.Module:
        m = self.manifest
        return build_model(self.config.model, m.task, m.labels, m.vocab_size, m.pad_token_id, seed)

    @cached_property
    def masking(self) -> MaskingSpec:
        """Masked-LM masking of this run (task ``mlm``): the tokenizer's ids from the manifest."""
        m = self.manifest
        if m.mask_token_id is None:
            raise ValueError(f"the data of this run (task {m.task!r}) has no mask token id")
        return MaskingSpec(tuple(m.special_ids), m.mask_token_id, m.vocab_size, self.config.model.mlm_probability)

    def shard(self, relative: str) -> dict[str, torch.Tensor]:
        return load_shard(self.data_root / relative)

    def proxy(self, split: str, node_id: str | None = None) -> dict[str, torch.Tensor]:
        """The proxy split (root or ``None``: all of it; another server: its languages' share).

        Loaded once per process and node group: every round of every server reuses it.
        """
        shard = self.manifest.proxy_train if split == "train" else self.manifest.proxy_test
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
                    raise ValueError(f"the proxy {split} split has no rows for the languages {languages} under {node_id!r}")
                self._proxy[key] = {k: torch.cat([v[a:b] for a, b in ranges]) for k, v in full.items()}
        return self._proxy[key]

    def test_sets(self, proxy_name: str) -> tuple[list[str], dict[str, torch.Tensor], torch.Tensor]:
        """Every client test split and the proxy test split as one tagged table (built once)."""
        with self._lock:
            if self._tests is None:
                names = [c.id for c in self.manifest.clients] + [proxy_name]
                parts = [self.shard(c.test.path) for c in self.manifest.clients] + [self.proxy("test")]
                data = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
                groups = torch.cat([torch.full((len(p["input_ids"]),), i, dtype=torch.int64) for i, p in enumerate(parts)])
                self._tests = (names, data, groups)
            return self._tests


_CONTEXTS: dict[str, RunContext] = {}
_CONTEXTS_LOCK = threading.Lock()


def get_context(run_path: str | Path) -> RunContext:
    key = str(Path(run_path).resolve())
    with _CONTEXTS_LOCK:
        if key not in _CONTEXTS:
            _CONTEXTS[key] = RunContext.open(Path(key))
        return _CONTEXTS[key]


def forget_context(run_path: str | Path) -> None:
    _CONTEXTS.pop(str(Path(run_path).resolve()), None)
