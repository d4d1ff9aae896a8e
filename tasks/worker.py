"""A worker process: its device, its model instances, one call at a time.

Client training, proxy training and evaluation run in long-lived worker processes
(Dask workers, see tasks/executor.py). Each holds its own device and one model
instance per model shape it has served, and runs one call at a time: torch's random
generator, which dropout draws from, is process-wide, so a training must own its
process while it runs. Each call seeds it from (seed, node, round), so results do not
depend on which worker ran what, or on how many there are.

Everything a call needs is rebuilt from the run folder (``tasks.context.open_run``),
so any worker that sees the folder can serve any run. This module imports no Prefect:
workers stay light and never talk to the Prefect API.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from distributed import WorkerPlugin, get_worker
from torch import nn

from bhfl_core.algorithm.contract import RoundPlan
from bhfl_core.algorithm.node_state import RoundKey
from bhfl_core.algorithm.rules import rule_for
from bhfl_core.analysis.matrix_axes import ModelRef
from bhfl_core.analysis.model_values import ModelValues
from bhfl_core.learning.params import get_flat
from bhfl_core.store.transfer import SentResult, TensorRef, Transfer, send_result
from tasks.client_training import BatchCall, LocalTrainer, device_kind, train_clients
from tasks.context import TIMELINE_DIR, RunContext, open_run
from tasks.fold_storage import FoldStorage
from tasks.heap import trim_heap
from tasks.scoring import score_models

PLUGIN = "bhfl"
DEVICE_ENV = "BHFL_DEVICE"  # cpu, cuda, cuda:N (unset: the process's CUDA device when there is one)
_MODELS_KEPT = 2
_CUBLAS_CONFIG_WARNING = r"Deterministic behavior was enabled .* CuBLAS"  # see gpu_deterministic
BUSY_DIR = Path(TIMELINE_DIR) / "busy"  # one file of (start, end) lines per worker
R = TypeVar("R")


@dataclass(frozen=True)
class SentTrain:
    """A proxy TRAIN's result on the wire: the trained model by reference, and its statistics."""

    model: TensorRef
    loss: float
    examples: int
    steps: int


def worker_device(setting: str | None = None) -> torch.device:
    """The device this process trains on; on a GPU, with torch's deterministic kernels (``gpu_deterministic``)."""
    setting = setting or os.environ.get(DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(setting)
    if device.type == "cuda":
        gpu_deterministic()
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)  # what builds on "the" GPU (a quantised backbone, model.quantization) uses it
    return device


def gpu_deterministic() -> None:
    """Make this process's CUDA kernels give the same bits on every run.

    Some CUDA kernels are nondeterministic by default (scatter-adds in backward passes
    add with atomics in whatever order threads finish), so two runs of one seed could
    part in the last bits and, over rounds, much further. torch's deterministic
    algorithms are PyTorch's documented remedy (its "Reproducibility" notes);
    ``warn_only``: an op without a deterministic kernel warns, naming itself, instead of
    stopping a run. CPU workers are left alone: their kernels are deterministic at a
    fixed thread count.

    Two of that mode's defaults cost a GPU worker more than they give it (H200, BERT-base
    TRAIN at batch 16, where the CPU queues kernels as fast as the GPU runs them):

    - cuBLAS's debug variable ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which PyTorch asks
      for, made every step of the plain loop 2.1x slower (21 -> 45 ms). cuBLAS gives the
      same bits on every run when one stream is active, and also on several streams when
      each has its own workspace (cuBLAS documentation, "Results reproducibility"):
      PyTorch gives each (handle, stream) pair its own. A worker trains on one stream, so
      the variable is not set here (one the user sets is kept), and PyTorch's warning
      about it is silenced.
    - Filling every new uninitialised tensor with NaN (``fill_uninitialized_memory``), a
      guard against code that reads memory it never wrote: one more kernel per
      allocation. No torch op and no bhfl code reads such memory (CPU workers, which never
      fill, give the same bits on every run), so the fill is off.
    """
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    warnings.filterwarnings("ignore", message=_CUBLAS_CONFIG_WARNING, category=UserWarning)
    torch.backends.cudnn.benchmark = False


def _model_key(ctx: RunContext) -> str:
    """What a cached model instance depends on: the model settings, the data's shape, and the backbone file.

    The backbone file (path and modification time) tells apart two runs of one config
    warm-started from different full runs, whose frozen parts differ.
    """
    m = ctx.manifest
    path = ctx.backbone_path()
    backbone = None if path is None else [str(path), path.stat().st_mtime_ns]
    return json.dumps(
        [ctx.config.model.model_dump(mode="json"), m.task, m.labels, m.vocab_size, m.pad_token_id, backbone]
    )


class WorkerRuntime:
    """One worker process's state; its methods are what the orchestrator submits.

    A call names the method itself, ``executor.submit(slot, WorkerRuntime.train_clients,
    ...)`` (tasks/executor.py), so mypy checks its arguments against the method's
    signature; each executor calls it on the runtime of the slot's process.
    """

    def __init__(self, name: str, device: torch.device) -> None:
        self.name, self.device, self.kind = name, device, device_kind(device)
        self._lock = threading.Lock()  # one call at a time, even on a worker with several threads
        self._models: OrderedDict[str, nn.Module] = OrderedDict()
        self._folds = FoldStorage()  # a CPU worker's fold buffers (reused for whole rounds)

    def describe(self) -> dict[str, str]:
        """Who this worker is: what placement needs (name, device, kind) and where it runs (host, pid)."""
        return {
            "name": self.name,
            "device": str(self.device),
            "kind": self.kind,
            "host": socket.gethostname(),
            "pid": str(os.getpid()),
        }

    def _trainer(self, ctx: RunContext) -> LocalTrainer:
        """A trainer on this worker's model instance for the run's model (built once, reused)."""
        key = _model_key(ctx)
        model = self._models.pop(key, None)
        if model is None:
            model = ctx.training_model().to(self.device)  # weights are loaded per use
        self._models[key] = model
        while len(self._models) > _MODELS_KEPT:
            self._models.popitem(last=False)
        return LocalTrainer(ctx, model, self.device)

    @contextlib.contextmanager
    def _call(self, run_path: str) -> Iterator[RunContext]:
        """Hold the worker for one call at its run's torch threads; log its busy interval in the run folder.

        The run's intra-op threads (default 1): CPU kernels split reductions by thread, so
        the thread count is part of what makes a result bit-identical across workers. Set
        for the call and restored after it, under the worker's lock: an in-process worker
        shares its process (and a sweep's other runs) with the orchestrator's own math.
        """
        with self._lock:
            started = time.time()
            ctx = open_run(run_path)
            threads = torch.get_num_threads()
            torch.set_num_threads(ctx.config.runtime.torch_threads)
            try:
                yield ctx
            finally:
                torch.set_num_threads(threads)
                trim_heap()  # what the call freed goes back to the system, holes in the heap included
                folder = ctx.run_path / BUSY_DIR
                folder.mkdir(parents=True, exist_ok=True)
                with open(folder / f"{self.name}.txt", "a", encoding="utf-8") as fh:
                    fh.write(f"{started:.6f} {time.time():.6f}\n")

    def train_clients(
        self,
        run_path: str,
        plan: RoundPlan,
        client_ids: list[str],
        phi: TensorRef,
        batch_call: BatchCall,
    ) -> SentResult:
        """A batch of clients from the parent model ``phi`` (``client_training.train_clients``), sent back by reference.

        On a CPU worker the batch is folded straight into files of the run's transfer
        folder, so nothing is copied to send it, or, when it is the whole round, into
        memory the worker reuses (tasks/fold_storage.py); a GPU worker folds on its device
        and copies the fold out once (``batch_call.whole_round``: the round's mean, closed on the device).
        """
        with self._call(run_path) as ctx:
            allocate, allocated = self._folds.allocator(
                ctx.transfer, f"{plan.caller}.{self.name}", batch_call.whole_round
            )
            trainer = self._trainer(ctx)
            try:
                on_cpu = allocate if self.device.type == "cpu" else None
                result = train_clients(ctx, trainer, plan, client_ids, Transfer.get(phi), batch_call, on_cpu)
            except BaseException:
                for ref, _ in allocated.values():  # a failed batch's fold goes nowhere: its memory back now
                    Transfer.drop(ref)
                raise
            rule = rule_for(ctx.tree[plan.caller.node_id].settings.aggregate)
            batch = f"{plan.caller}.{self.name}.{secrets.token_hex(4)}"  # a worker may hold two batches of a round
            sent = send_result(result, rule, ctx.transfer, batch, allocated)
            for ref, _ in allocated.values():  # a closed fold's sum: folded into, then replaced by its mean
                if ref not in (sent.partial or {}).values():
                    Transfer.drop(ref)
            return sent

    def proxy_train(self, run_path: str, node_id: str, key: RoundKey, theta: TensorRef) -> SentTrain:
        """TRAIN a server's model (``theta``) on its proxy split; the trained model goes back by reference."""
        with self._call(run_path) as ctx:
            result = self._trainer(ctx).train(ctx.tree[node_id], Transfer.get(theta), key, RoundPlan(key.caller))
            ref = ctx.transfer.put(f"{node_id}.proxy-out", result.theta)
            return SentTrain(ref, result.loss, result.examples, result.steps)

    def held_out_losses(self, run_path: str, node_id: str, candidates: list[TensorRef]) -> list[float]:
        """Losses of candidate models on a server's held-out proxy rows (NODEOPT ``interp``)."""
        with self._call(run_path) as ctx:
            return self._trainer(ctx).score(ctx.tree[node_id], [Transfer.get(c) for c in candidates])

    def evaluate(self, run_path: str, models: list[ModelRef]) -> list[ModelValues]:
        with self._call(run_path) as ctx:
            return score_models(ctx, self._trainer(ctx), models)

    def initial_model(self, run_path: str) -> TensorRef:
        """The run's initial model (seeded by ``seed + model.init_seed_offset``), by reference."""
        with self._call(run_path) as ctx:
            cfg = ctx.config
            return ctx.transfer.put("initial", get_flat(ctx.build_model(cfg.seed + cfg.model.init_seed_offset)))


class BhflWorkerPlugin(WorkerPlugin):
    """Gives every Dask worker of the cluster a ``WorkerRuntime`` (registered by the orchestrator)."""

    name = PLUGIN
    idempotent = True  # registering again (every run, every resume) keeps the workers' runtimes and models

    def setup(self, worker: Any) -> None:
        self.runtime = WorkerRuntime(str(worker.name), worker_device())


def call(method: Callable[..., R], kwargs: Mapping[str, Any], *args: Any) -> R:
    """What the executor submits to a Dask worker: ``method`` (a ``WorkerRuntime`` method) of this worker's runtime.

    The arguments were checked against ``method`` where the call was made
    (``Executor.submit``); the keyword ones travel as one mapping so that none can meet
    a keyword of Dask's own ``submit``.
    """
    plugin: Any = get_worker().plugins[PLUGIN]
    runtime: WorkerRuntime = plugin.runtime
    return method(runtime, *args, **kwargs)


def busy_intervals(run_path: Path) -> dict[str, list[tuple[float, float]]]:
    """Every worker's busy intervals in this run (wall clock), from the files ``WorkerRuntime`` appends."""
    out: dict[str, list[tuple[float, float]]] = {}
    folder = run_path / BUSY_DIR
    for path in sorted(folder.glob("*.txt")) if folder.is_dir() else []:
        rows = (line.split() for line in path.read_text(encoding="utf-8").splitlines())
        out[path.stem] = [(float(a), float(b)) for a, b in (r for r in rows if len(r) == 2)]
    return out
