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

Run:  .venv/bin/python benchmarks/backbone_memory.py [--models tiny base] [--examples 32] [--tokens 64]
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

from _env import REPO, offline_quiet

BASE = [
    "model.tiny={vocab_size: 30522, hidden_size: 768, num_hidden_layers: 12, num_attention_heads: 12,"
    " intermediate_size: 3072}"
]
MODELS = {"tiny": [], "base": BASE}


def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024  # kB
    raise KeyError(key)


def child(model: str, dtype: str, examples: int, tokens: int) -> dict[str, float]:
    """One case in this (fresh) process: build, then one TRAIN; memory figures in MB."""
    import peft  # noqa: F401  (imported by the build: counted in ``imports``, not in the model's share)
    import torch
    import transformers  # noqa: F401

    from bhfl_core.algorithm.tree import TrainParams
    from bhfl_core.config.loader import load_config
    from bhfl_core.learning.local_train import train_model
    from bhfl_core.learning.models import build_model

    imports = _status_mb("VmRSS")  # torch, transformers, peft: the same in every case
    overrides = [*MODELS[model], "model.adapter={r: 8}", f"model.backbone_dtype={dtype}", f"model.max_length={tokens}"]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "base"])
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.examples, args.tokens)))
        return
    offline_quiet()
    columns = ["params MB", "RSS MB", "TRAIN peak MB", "above imports MB", "process peak MB", "TRAIN s"]
    print(f"{'model':6} {'backbone':9} " + " ".join(f"{c:>16}" for c in columns) + "  vs float32 (peak, above)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for model in args.models:
        baseline = None
        for dtype in ("float32", "bf16"):
            cmd = [sys.executable, __file__, "--child", model, dtype, "--examples", str(args.examples)]
            cmd += ["--tokens", str(args.tokens)]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO, env=env)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            baseline = baseline or row
            peak = row["TRAIN peak MB"] / baseline["TRAIN peak MB"]
            above = row["above imports MB"] / baseline["above imports MB"]
            cells = " ".join(f"{row[c]:16.1f}" for c in columns)
            print(f"{model:6} {dtype:9} {cells}  {peak:.2f}x, {above:.2f}x", flush=True)


if __name__ == "__main__":
    main()
