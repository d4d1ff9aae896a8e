"""Memory per worker of a LoRA client's TRAIN: the frozen backbone in float32 against bf16 (``model.backbone_dtype``).

For each model (the embedded default's tiny BERT; BERT-base dimensions built from a
config, vocabulary 30,522: 109M parameters) and each backbone dtype, a fresh process
builds the model as a worker does (``build_model``, ``model.adapter: {r: 8}``), then runs
one client's TRAIN (``train_model``: 1 epoch over ``--examples`` random token rows of
``--tokens``, batches of 8, AdamW) and reports, from ``/proc/self/status``:

* ``params MB``: the model's parameter bytes (backbone + adapters + head);
* ``RSS MB``: resident memory after the build, before TRAIN;
* ``TRAIN peak MB``: the peak resident memory during TRAIN (the kernel's high-water mark,
  reset after the build through ``/proc/self/clear_refs``): what a worker holds while
  training, the figure that decides how many fit in a machine;
* ``above imports MB``: the TRAIN peak less the process's memory after its imports
  (torch, transformers, peft: ~0.5 GB, the same in every case): the model's and TRAIN's share;
* ``process peak MB``: the whole process's peak, the build included. The model is built
  in float32 and then lowered (the seeded draws are the float32 run's), so a bf16 worker
  holds the float32 backbone for a moment while building: at BERT-base that moment stays
  below its TRAIN peak (measured), at larger models with short batches it may not.

The float32 baseline is measured in the same run, one process per case, so the figures
compare like for like. Linux only (``/proc``).

``--device cuda`` (a GPU, with ``pip install '.[gpu]'`` for bitsandbytes): the same cases
on the GPU, plus the backbone quantised to 4 bits (``model.quantization: {bits: 4}``,
QLoRA's NF4) and 8 bits (LLM.int8()), and the memory read from torch's CUDA allocator
instead of ``/proc``: ``params MB`` as above (a quantised layer's packed bytes),
``GPU after build MB`` (allocated once the model is on the GPU), ``GPU TRAIN peak MB``
(the allocator's peak during TRAIN, reset after the build) and ``TRAIN s``; the ratios are
against float32 on the same GPU. A case the machine cannot run (no bitsandbytes) prints
its reason instead of figures.

Run:  .venv/bin/python benchmarks/backbone_memory.py [--models tiny base] [--examples 32] [--tokens 64] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _env import REPO, offline_quiet

BASE = [
    "model.tiny={vocab_size: 30522, hidden_size: 768, num_hidden_layers: 12, num_attention_heads: 12,"
    " intermediate_size: 3072}"
]
MODELS = {"tiny": [], "base": BASE}
PRECISIONS = {  # the config overrides of each backbone precision
    "float32": [],
    "bf16": ["model.backbone_dtype=bf16"],
    "4bit": ["model.quantization={bits: 4}", "runtime.device=cuda"],
    "8bit": ["model.quantization={bits: 8}", "runtime.device=cuda"],
}
CPU_COLUMNS = ["params MB", "RSS MB", "TRAIN peak MB", "above imports MB", "process peak MB", "TRAIN s"]
GPU_COLUMNS = ["params MB", "GPU after build MB", "GPU TRAIN peak MB", "TRAIN s"]


def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024  # kB
    raise KeyError(key)


def child(model: str, dtype: str, examples: int, tokens: int, device_name: str = "cpu") -> dict[str, float]:
    """One case in this (fresh) process: build, then one TRAIN; memory figures in MB (``GPU_COLUMNS`` on a GPU)."""
    import peft  # noqa: F401  (imported by the build: counted in ``imports``, not in the model's share)
    import torch
    import transformers  # noqa: F401

    from bhfl_core.algorithm.tree import TrainParams
    from bhfl_core.config.loader import load_config
    from bhfl_core.learning.local_train import train_model
    from bhfl_core.learning.models import build_model

    imports = _status_mb("VmRSS")  # torch, transformers, peft: the same in every case
    overrides = [*MODELS[model], "model.adapter={r: 8}", *PRECISIONS[dtype], f"model.max_length={tokens}"]
    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)  # a quantised backbone is loaded onto the current device, as in a worker
    cfg = load_config(REPO / "configs" / "embedded.yaml", overrides)
    labels = [f"l{i}" for i in range(10)]
    vocab = cfg.model.tiny.vocab_size
    net = build_model(cfg.model, "classification", labels, vocab, 0, cfg.seed)
    gen = torch.Generator().manual_seed(0)
    data = {
        "input_ids": torch.randint(5, vocab, (examples, tokens), generator=gen),
        "attention_mask": torch.ones(examples, tokens, dtype=torch.long),
        "labels": torch.randint(0, len(labels), (examples,), generator=gen),
    }
    params = sum(p.numel() * p.element_size() for p in net.parameters()) / 2**20
    if device.type == "cuda":
        return _on_gpu(net, data, params, device)
    rss = _status_mb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak RSS) to the current RSS
    started = time.perf_counter()
    result = train_model(net, data, TrainParams(lr=1e-3, batch_size=8), seed=1, device=torch.device("cpu"))
    train_peak = _status_mb("VmHWM")
    return {
        "imports MB": imports,
        "params MB": params,
        "RSS MB": rss,
        "TRAIN peak MB": train_peak,
        "above imports MB": train_peak - imports,
        # ru_maxrss (kB on Linux) is not reset by clear_refs: the whole process's peak, the build included
        "process peak MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "TRAIN s": time.perf_counter() - started,
        "loss": result.loss,
    }


def _on_gpu(net: Any, data: dict[str, Any], params: float, device: Any) -> dict[str, float]:
    """TRAIN on the GPU; its memory from torch's CUDA allocator (what decides how many workers share a GPU)."""
    import torch

    from bhfl_core.algorithm.tree import TrainParams
    from bhfl_core.learning.local_train import train_model

    net.to(device)  # (a quantised backbone is there already; moving it again is a no-op)
    torch.cuda.synchronize(device)
    built = torch.cuda.memory_allocated(device) / 2**20
    torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    result = train_model(net, data, TrainParams(lr=1e-3, batch_size=8), seed=1, device=device)
    torch.cuda.synchronize(device)
    return {
        "params MB": params,
        "GPU after build MB": built,
        "GPU TRAIN peak MB": torch.cuda.max_memory_allocated(device) / 2**20,
        "TRAIN s": time.perf_counter() - started,
        "loss": result.loss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "base"])
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: GPU memory, and 4-/8-bit backbones too")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.examples, args.tokens, args.device)))
        return
    offline_quiet()
    gpu = args.device != "cpu"
    columns = GPU_COLUMNS if gpu else CPU_COLUMNS
    peak_column, share_column = "TRAIN peak MB", "above imports MB"
    if gpu:
        peak_column, share_column = "GPU TRAIN peak MB", "GPU after build MB"
    share = "build" if gpu else "above"
    print(f"{'model':6} {'backbone':9} " + " ".join(f"{c:>18}" for c in columns) + f"  vs float32 (peak, {share})")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for model in args.models:
        baseline = None
        for dtype in ("float32", "bf16", "4bit", "8bit") if gpu else ("float32", "bf16"):
            cmd = [sys.executable, __file__, "--child", model, dtype, "--examples", str(args.examples)]
            cmd += ["--tokens", str(args.tokens), "--device", args.device]
            done = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=REPO, env=env)
            if done.returncode:  # e.g. no bitsandbytes: say why, go on with the other cases
                why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
                print(f"{model:6} {dtype:9} not run: {why}", flush=True)
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            baseline = baseline or row
            peak = row[peak_column] / baseline[peak_column]
            part = row[share_column] / baseline[share_column]
            cells = " ".join(f"{row[c]:18.1f}" for c in columns)
            print(f"{model:6} {dtype:9} {cells}  {peak:.2f}x, {part:.2f}x", flush=True)


if __name__ == "__main__":
    main()
