"""Orchestration share: the same experiment with Prefect subflows/tasks and inline (no Prefect).

Both runs execute identical node and worker code (flows.experiment.FlowHooks with
inline=False/True) on the same prepared data, so the difference in training time is
what Prefect orchestration costs (subflow and task runs against the local server).
Run:  .venv/bin/python benchmarks/orchestration.py [--set KEY=VALUE ...]
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from _env import config_args, offline_quiet

offline_quiet()


def main() -> None:
    args = config_args(__doc__)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("PREFECT_HOME", str(Path(tmp) / ".prefect"))
        from bhfl_core.config_loader import load_config
        from flows.experiment import run_experiment

        config = load_config(args.config, args.overrides)
        results = {}
        for mode in ("inline", "prefect"):  # inline first also warms the data cache for both
            started = time.time()
            result = run_experiment(config, Path(tmp), inline=mode == "inline")
            results[mode] = (result, time.time() - started)
    print(f"{'mode':8} {'setup_s':>8} {'train_s':>8} {'eval_s':>8} {'total_s':>8}  root/union/acc")
    for mode, (result, wall) in results.items():
        t = result["timings"]
        print(f"{mode:8} {t['time/setup_s']:8.1f} {t['time/train_s']:8.1f} {t['time/final_eval_s']:8.1f} {wall:8.1f}"
              f"  {result['headline'].get('root/union/accuracy', float('nan')):.4f}")
    inline_t = results["inline"][0]["timings"]["time/train_s"]
    prefect_t = results["prefect"][0]["timings"]["time/train_s"]
    print(f"orchestration share of training time: {1 - inline_t / prefect_t:.1%} "
          f"({prefect_t - inline_t:.1f} s of {prefect_t:.1f} s)")


if __name__ == "__main__":
    main()
