"""Peak memory vs number of clients: the same round size (200 clients) over 100 to 2,000 clients.

Node states live on disk (one safetensors file per node), a worker process reuses one
model instance and folds its clients into one running sum, so the memory of training
should be bounded by the workers, not by the number of clients. For each size this
script runs ``bhfl run`` as a user does (a flat tree: the root samples
``min(200, clients)`` clients per round; tiny model; 2 root rounds; the local cluster of
worker processes; its own Prefect server) and samples the PSS of the whole process
tree (benchmarks/_proc.py): the peak during training (first client training to the
last aggregate, from the run's timeline) and over the whole run. Evaluation scores the
root only (``eval.client_models: false``): scoring 2,000 client models on 2,000 test
splits is a different workload. Data preparation runs first, untimed.

Run:  .venv/bin/python benchmarks/memory.py [--clients 100 500 2000] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _env import REPO, offline_quiet
from _proc import TreeSampler

LANGUAGES = 5
PER_ROUND = 200
SHRINK = [
    "name=memory-bench",
    "data.sizes={median: 24, sigma: 0.5, min: 10, max: 60}",
    "data.proxy={train_per_language: 40, test_per_language: 20}",
    (
        "model.tiny={vocab_size: 1000, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2,"
        " intermediate_size: 64}"
    ),
    "model.max_length=32",
    "tree.flat=true",
    "tree.groups={}",
    "tree.root.rounds=2",
    "tree.root.proxy_train=false",
    "tree.client.train={lr: 0.003, epochs: 1, batch_size: 16}",
    "eval.client_models=false",
]


def overrides(clients: int, extra: list[str]) -> list[str]:
    return [
        *SHRINK,
        f"data.clients_per_language={clients // LANGUAGES}",
        f"tree.root.cohort={min(PER_ROUND, clients)}",
        *extra,
    ]


def measure(clients: int, extra: list[str], run_dir: Path) -> dict[str, float]:
    sets = [arg for o in overrides(clients, extra) for arg in ("--set", o)]
    env = {**os.environ, "PREFECT_HOME": str(run_dir / ".prefect")}
    env.pop("PREFECT_API_URL", None)
    bhfl = str(Path(sys.executable).with_name("bhfl"))
    subprocess.run(
        [bhfl, "prepare", "configs/embedded.yaml", *sets, "--run-dir", str(run_dir)],
        check=True,
        capture_output=True,
        cwd=REPO,
        env=env,
    )
    proc = subprocess.Popen(
        [bhfl, "run", "configs/embedded.yaml", *sets, "--run-dir", str(run_dir)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    with TreeSampler(proc.pid) as sampler:
        _, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"bhfl run ({clients} clients) failed:\n{err[-3000:]}")
    run_path = next((run_dir / "memory-bench").iterdir())
    timeline = json.loads((run_path / "run.json").read_text())["timeline"]
    return {
        "clients": clients,
        "train_pss_mb": sampler.peak_pss_mb(timeline["first_training"], timeline["last_aggregate"]),
        "run_pss_mb": sampler.peak_pss_mb(),
        "train_s": timeline["last_aggregate"] - timeline["first_training"],
        "wall_s": timeline["finished"] - timeline["process_start"],
        "cpu_s": sampler.cpu_s,
        "node_files": len(list((run_path / "state" / "nodes").glob("*.safetensors"))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 500, 2000])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    offline_quiet()
    rows = []
    for n in args.clients:
        if n % LANGUAGES:
            parser.error(f"--clients {n}: must be a multiple of {LANGUAGES} (clients per language)")
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(measure(n, args.overrides, Path(tmp)))
    print(f"peak PSS of the process tree (orchestrator, {PER_ROUND} clients per round, workers, Prefect server), MB")
    print(
        f"{'clients':>8} {'training':>9} {'whole run':>10} {'train s':>8} {'wall s':>7} {'CPU s':>7} {'node files':>10}"
    )
    for r in rows:
        print(
            f"{r['clients']:8d} {r['train_pss_mb']:9.0f} {r['run_pss_mb']:10.0f} {r['train_s']:8.1f} "
            f"{r['wall_s']:7.1f} {r['cpu_s']:7.1f} {r['node_files']:10d}"
        )
    base = rows[0]["train_pss_mb"]
    print(
        "training peak relative to the first size: "
        + ", ".join(f"{r['clients']}: {r['train_pss_mb'] / base:.2f}x" for r in rows)
    )


if __name__ == "__main__":
    main()
