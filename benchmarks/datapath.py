"""The per-client data path at real model sizes: bhfl's against a plain loop doing the same bookkeeping.

Everything a client costs except its forward and backward passes: loading its state,
down-aggregation, getting the parent's model, loading it into the model, reading the
trained model back, folding it into the parent's aggregate, checkpointing it, and
sending the fold back to the parent, which merges and finalizes it (per round, shared
by the round's clients). TRAIN is replaced by one in-place update of every parameter
(the optimizer step both paths would take) and, optionally, ``--train-s`` seconds of
sleep standing for a GPU's forward and backward: time in which a CPU thread is free,
so what bhfl writes in the background is hidden behind it, as in a real run.

- **bhfl**: the real worker code: ``tasks.client_training.train_clients`` (the engine's
  EXECUTENODE per client, the parent's aggregation rule folding on the worker into the
  buffers it reuses (tasks/fold_storage.py) and closing the fold to the round's mean
  there, as the one worker that holds a whole round does; checkpoints written in the
  background), ``send_result`` /
  ``receive_result`` (what crosses the process boundary), the parent's ``fold_results``
  and ``node_up`` (finalize and NODEOPT). One worker, in this process.
- **loop**: a plain single-process FedAvg loop: the global model in memory, clients'
  models in a dict (persistent clients; on disk as safetensors when they do not fit in a
  quarter of the free memory), a float32 in-place fold.

Scenarios: ``replace`` (the throughput workload: clients start from the parent's model
and keep nothing) and ``persistent`` (clients keep their model and mix the parent's in
with eta_down 0.5: a load, a down-aggregation and a checkpoint per client).

Printed per size and scenario: milliseconds per client for both, and bhfl's ratio. And
per size, the disk's floor for a persistent client: the milliseconds a plain
``write`` + ``fsync`` of one state of that size takes on this machine (the median of 3, in
the folder the runs use). bhfl makes every client's state durable before its round
counts (what lets a killed run resume without redoing or losing a client's round), so
with ``--train-s 0`` its persistent figure cannot fall below that floor; the loop keeps
its clients' states in memory and writes nothing.

``--device cuda``: the model trains on the GPU in both. bhfl's worker folds on the GPU and
copies the fold out once per batch (as a GPU worker does); the parent stays on the CPU (the
orchestrator). The loop keeps everything on the GPU (persistent clients too, when they fit
in a quarter of its free memory).

Run:  .venv/bin/python benchmarks/datapath.py [--sizes 10 110 350] [--clients 4] [--train-s 0 1] [--device cuda]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import psutil
import torch
from _env import REPO, offline_quiet
from safetensors.torch import load_file, save_file
from torch import nn

CHUNK = 10_000_000  # parameters per tensor of the stand-in model
WEIGHTS = (37.0, 61.0, 89.0, 113.0, 151.0, 173.0, 199.0, 223.0)  # clients' example counts


class Flat(nn.Module):
    """A model of ``size`` float32 parameters in tensors of 10M (no forward: TRAIN is simulated)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        sizes = [CHUNK] * (size // CHUNK) + ([size % CHUNK] if size % CHUNK else [])
        self.parts = nn.ParameterList(nn.Parameter(torch.zeros(n)) for n in sizes)


def step(model: nn.Module, client: int, train_s: float) -> None:
    """The stand-in for TRAIN: a sleep (forward and backward on a GPU), then an update of every parameter."""
    if train_s:
        time.sleep(train_s)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * (client + 1))


# ---------------------------------------------------------------- bhfl's path


@dataclass
class BenchContext:
    """What ``train_clients`` reads of a run: its tree, store, transfer folder and config."""

    root: Path
    tree: object
    config: object

    @cached_property
    def store(self):  # type: ignore[no-untyped-def]
        from bhfl_core.store.node_store import StateStore

        return StateStore(self.root / "state")

    @cached_property
    def transfer(self):  # type: ignore[no-untyped-def]
        from bhfl_core.store.transfer import Transfer, transfer_folder

        return Transfer(transfer_folder(self.root, "auto", local=True))


def star(clients: int, persistent: bool):  # type: ignore[no-untyped-def]
    """root -> clients, the root a FedAvg server; clients persistent with eta_down 0.5, or replaced each round."""
    from bhfl_core.algorithm.node_opt import NodeOptParams
    from bhfl_core.algorithm.tree import Node, NodeSettings, Role, TrainParams, Tree

    client = NodeSettings(
        persistent=persistent, train=TrainParams(), opt_down=NodeOptParams(eta=0.5 if persistent else 1.0)
    )
    ids = [f"c{i}" for i in range(clients)]
    nodes = {c: Node(c, Role.CLIENT, 1, "root", (), client, WEIGHTS[i]) for i, c in enumerate(ids)}
    nodes["root"] = Node("root", Role.ROOT, 0, None, tuple(ids), NodeSettings(), sum(WEIGHTS[:clients]))
    return Tree(nodes, "root")


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer reads the time it took."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bhfl_rounds(
    size: int, clients: int, persistent: bool, train_s: float, rounds: int, folder: Path, device: torch.device
) -> float:
    """Seconds per client of bhfl's data path (rounds after the first), TRAIN's stand-in excluded."""
    from bhfl_core.algorithm.aggregation_rule import fold_results
    from bhfl_core.algorithm.contract import RoundPlan
    from bhfl_core.algorithm.node_state import NodeState, RoundKey
    from bhfl_core.algorithm.node_step import node_up
    from bhfl_core.algorithm.rules import rule_for
    from bhfl_core.config.loader import load_config
    from bhfl_core.learning.params import get_flat, set_flat
    from bhfl_core.store.transfer import Transfer, receive_result, send_result
    from tasks.client_training import BatchCall, LocalTrainer, train_clients
    from tasks.fold_storage import FoldStorage

    class Trainer(LocalTrainer):
        def train(self, node, theta, key, plan):  # type: ignore[no-untyped-def]
            from bhfl_core.algorithm.node_state import NodeResult

            set_flat(self.model, theta)
            step(self.model, int(node.id[1:]), train_s)
            return NodeResult(get_flat(self.model), 0.0, int(node.weight), 1)

    cfg = load_config(REPO / "configs" / "embedded.yaml", ["runtime.executor=inprocess"])
    ctx = BenchContext(folder, star(clients, persistent), cfg)
    rule = rule_for(ctx.tree.root.settings.aggregate)
    trainer = Trainer(ctx, Flat(size).to(device), device)  # type: ignore[arg-type]
    folds = FoldStorage()
    state = NodeState(model=torch.zeros(size), exec_caller="")
    ids = list(ctx.tree.root.children)
    timings = []
    for r in range(rounds):
        started = time.perf_counter()
        plan = RoundPlan(RoundKey("root", r).as_caller())
        phi = ctx.transfer.put("root.down", state.theta)  # the parent's model, once per round
        allocate, allocated = folds.allocator(ctx.transfer, "root.w0", True)  # as tasks/worker.py does
        on_cpu = allocate if device.type == "cpu" else None
        whole = BatchCall(whole_round=True)
        result = train_clients(ctx, trainer, plan, ids, Transfer.get(phi), whole, on_cpu)  # type: ignore[arg-type]
        sent = send_result(result, rule, ctx.transfer, "w0", allocated)
        del result
        received = receive_result(sent, rule)
        key = RoundKey("root", r)
        folded = fold_results(rule, key, [received], [*ids, "root"])
        state, _, _ = node_up(state, folded, {}, ctx.tree.root.settings, key)
        _sync(device)
        timings.append(time.perf_counter() - started - clients * train_s)
    ctx.transfer.clear()
    return sum(timings[1:]) / (len(timings) - 1) / clients


# ---------------------------------------------------------------- the plain loop


def loop_rounds(
    size: int, clients: int, persistent: bool, train_s: float, rounds: int, folder: Path, device: torch.device
) -> float:
    """Seconds per client of the plain loop's bookkeeping (rounds after the first), TRAIN's stand-in excluded."""
    model = Flat(size).to(device)
    params = list(model.parameters())
    weights = WEIGHTS[:clients]
    glob = torch.zeros(size, device=device)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
    in_memory = clients * size * 4 < free / 4
    kept: dict[int, torch.Tensor] = {}
    timings = []
    for _ in range(rounds):
        started = time.perf_counter()
        acc = torch.zeros(size, device=device)
        for c in range(clients):
            start = glob
            if persistent:
                own = kept.get(c) if in_memory else _load(folder, c, device)
                if own is not None:
                    start = torch.lerp(own, glob, 0.5)
            with torch.no_grad():  # the model's weights from the vector (a copy: training must not change it)
                for p, part in zip(params, start.split([p.numel() for p in params])):
                    p.copy_(part)
            step(model, c, train_s)
            trained = torch.nn.utils.parameters_to_vector(params).detach()
            acc.add_(trained, alpha=weights[c])
            if persistent:
                if in_memory:
                    kept[c] = trained
                else:
                    save_file({"model": trained.cpu()}, str(folder / f"c{c}.safetensors"))
        glob = acc / sum(weights)
        _sync(device)
        timings.append(time.perf_counter() - started - clients * train_s)
    return sum(timings[1:]) / (len(timings) - 1) / clients


def write_floor_s(size: int, folder: Path, repeats: int = 3) -> float:
    """Median seconds to write ``size`` float32 values to a new file and fsync it: the floor of a durable state."""
    values = memoryview(torch.ones(size).numpy()).cast("B")
    times = []
    for i in range(repeats):
        path = folder / f"floor{i}.bin"
        started = time.perf_counter()
        with open(path, "wb") as fh:
            fh.write(values)
            fh.flush()
            os.fsync(fh.fileno())
        times.append(time.perf_counter() - started)
        path.unlink()
    return sorted(times)[len(times) // 2]


def _load(folder: Path, client: int, device: torch.device) -> torch.Tensor | None:
    path = folder / f"c{client}.safetensors"
    return load_file(str(path), device=str(device))["model"] if path.exists() else None


# ---------------------------------------------------------------- the invocation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[10, 110, 350], help="millions of parameters")
    parser.add_argument("--clients", type=int, default=4, help="clients per round (at most 8)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per measurement (the first is not counted)")
    parser.add_argument("--train-s", nargs="+", type=float, default=[0.0, 1.0], help="TRAIN stand-in seconds")
    parser.add_argument("--scenarios", nargs="+", default=["replace", "persistent"])
    parser.add_argument("--device", default="cpu", help="where the model trains: cpu, cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    offline_quiet()
    torch.set_num_threads(1)  # as a worker trains
    print(f"{'size':>6} {'scenario':>10} {'train s':>7} {'loop ms/client':>15} {'bhfl ms/client':>15} {'ratio':>6}")
    for millions in args.sizes:
        size = millions * 1_000_000
        floor = Path(tempfile.mkdtemp(prefix="bhfl-datapath-floor-", dir=REPO))
        try:
            print(f"{millions:>5}M  write floor: {1e3 * write_floor_s(size, floor):.0f} ms a client state", flush=True)
        finally:
            shutil.rmtree(floor, ignore_errors=True)
        for scenario in args.scenarios:
            for train_s in args.train_s:
                row = {}
                for name, fn in (("loop", loop_rounds), ("bhfl", bhfl_rounds)):
                    folder = Path(tempfile.mkdtemp(prefix=f"bhfl-datapath-{name}-", dir=REPO))
                    try:
                        persistent = scenario == "persistent"
                        row[name] = fn(size, args.clients, persistent, train_s, args.rounds, folder, device)
                    finally:
                        shutil.rmtree(folder, ignore_errors=True)
                        gc.collect()
                ratio = row["bhfl"] / row["loop"] if row["loop"] else math.nan
                print(
                    f"{millions:>5}M {scenario:>10} {train_s:>7.1f} {1e3 * row['loop']:>15.0f} "
                    f"{1e3 * row['bhfl']:>15.0f} {ratio:>5.2f}x",
                    flush=True,
                )


if __name__ == "__main__":
    main()
