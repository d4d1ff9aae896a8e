"""Orchestration share: the same experiment with Prefect subflows/tasks and inline (no Prefect).

Both runs execute identical node and worker code on the same executor (the run's local
cluster of worker processes) and the same prepared data; inline replaces Prefect
subflows and task runs by plain calls. So the difference in training time is what the
orchestration costs (flow and task runs against the Prefect server, and that server's
CPU, which the workers compete with). The two modes alternate (``--repeats`` pairs),
the medians are compared, so the ratio holds on a noisy machine.

Run:  .venv/bin/python benchmarks/orchestration.py [--repeats 3] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from _env import REPO, offline_quiet

offline_quiet()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=str(REPO / "configs" / "embedded.yaml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("PREFECT_HOME", str(Path(tmp) / ".prefect"))
        from bhfl_core.config.loader import load_config
        from flows.experiment import PLAIN_CALLS, PREFECT_RUNS, run_experiment

        config = load_config(args.config, args.overrides)
        results: dict[str, list[tuple[dict, float]]] = {"inline": [], "prefect": []}
        for _ in range(args.repeats):
            for mode, runs in results.items():  # inline first also warms the data cache for both
                started = time.time()
                result = run_experiment(
                    config, Path(tmp), orchestration=PLAIN_CALLS if mode == "inline" else PREFECT_RUNS
                )
                runs.append((result, time.time() - started))
    print(
        f"{'mode':8} {'setup_s':>8} {'train_s':>8} {'eval_s':>8} {'total_s':>8}  "
        f"root/union/acc   (medians of {args.repeats})"
    )
    train = {}
    for mode, runs in results.items():
        med = {
            k: statistics.median(r["timings"][k] for r, _ in runs)
            for k in ("time/setup_s", "time/train_s", "time/final_eval_s")
        }
        train[mode] = med["time/train_s"]
        accuracy = runs[0][0]["headline"].get("root/union/accuracy", float("nan"))
        print(
            f"{mode:8} {med['time/setup_s']:8.1f} {med['time/train_s']:8.1f} {med['time/final_eval_s']:8.1f} "
            f"{statistics.median(w for _, w in runs):8.1f}  {accuracy:.4f}"
        )
        print(f"{'':8} train_s of each run: " + ", ".join(f"{r['timings']['time/train_s']:.1f}" for r, _ in runs))
    print(
        f"orchestration share of training time: {1 - train['inline'] / train['prefect']:.1%} "
        f"({train['prefect'] - train['inline']:.1f} s of {train['prefect']:.1f} s)"
    )


if __name__ == "__main__":
    main()
