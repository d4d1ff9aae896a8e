"""Peak memory vs number of clients: the same tree with 50 and with 1000 clients.

Node states live on disk (one safetensors file per node), workers reuse one model
instance each, and a worker folds its clients into one running sum, so peak memory
should be bounded by the workers in flight, not by the number of clients. Each size
runs in its own process (real Prefect flows, tiny model, 2 root rounds, the same
cohort per edge round) and reports its peak RSS (``ru_maxrss``) and wall time. Data
preparation (generating and tokenising the corpus) runs first in a separate process,
so the figures are those of an experiment run: training and evaluation.

Run:  .venv/bin/python benchmarks/memory.py [--clients 50 1000] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _env import REPO, offline_quiet
LANGUAGES = 5
SHRINK = [
    "name=memory-bench",
    "data.sizes={median: 24, sigma: 0.5, min: 10, max: 60}",
    "data.proxy={train_per_language: 40, test_per_language: 20}",
    "model.tiny={vocab_size: 1000, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2, intermediate_size: 64}",
    "model.max_length=32",
    "tree.root.rounds=2",
    "tree.edge.rounds=1",
    "tree.edge.cohort=10",
    "tree.client.train={lr: 0.003, epochs: 1, batch_size: 16}",
]


def child(clients: int, overrides: list[str], run_root: Path, prepare_only: bool) -> None:
    offline_quiet()
    from bhfl_core.config_loader import load_config
    from flows.experiment import run_experiment

    config = load_config(REPO / "configs" / "embedded.yaml",
                         [*SHRINK, f"data.clients_per_language={clients // LANGUAGES}", *overrides])
    if prepare_only:
        from data_prep.prepare import prepare_data

        prepare_data(config, run_root / "cache", log=lambda _: None)
        return
    os.environ["PREFECT_HOME"] = str(run_root / ".prefect")
    started = time.time()
    result = run_experiment(config, run_root)
    wall = time.time() - started
    state_files = len(list((Path(result["run_path"]) / "state" / "nodes").glob("*.safetensors")))
    print(json.dumps({
        "clients": clients, "wall_s": wall, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "state_files": state_files, **{k.split("/")[1]: v for k, v in {**result["timings"], **result["memory"]}.items()},
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[50, 1000])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--prepare-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.overrides, Path(args.root), args.prepare_only)
        return
    rows = []
    for n in args.clients:
        if n % LANGUAGES:
            parser.error(f"--clients {n}: must be a multiple of {LANGUAGES} (clients per language)")
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, __file__, "--child", str(n), "--root", tmp, *[f"--set={o}" for o in args.overrides]]
            subprocess.run([*cmd, "--prepare-only"], check=True, capture_output=True, cwd=REPO)
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print("peak RSS in MB (whole run, and per phase: setup / training / final evaluation); wall times in s")
    print(f"{'clients':>8} {'RSS run':>8} {'setup':>7} {'train':>7} {'eval':>7} {'wall s':>7} {'setup s':>8} "
          f"{'train s':>8} {'eval s':>7} {'node files':>10}")
    for r in rows:
        print(f"{r['clients']:8d} {r['peak_rss_mb']:8.0f} {r['peak_rss_setup_mb']:7.0f} {r['peak_rss_train_mb']:7.0f} "
              f"{r['peak_rss_eval_mb']:7.0f} {r['wall_s']:7.1f} {r['setup_s']:8.1f} {r['train_s']:8.1f} "
              f"{r['final_eval_s']:7.1f} {r['state_files']:10d}")


if __name__ == "__main__":
    main()
