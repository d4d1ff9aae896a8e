"""Cold versus cached data preparation: the same config prepared twice into a fresh cache.

Prints the wall time of a cold preparation (load/generate, partition, tokenise, write
shards, manifest, report) and of the second call (fingerprint match: no loading, no
tokenisation), inline (plain calls) and through the ``prepare-data`` Prefect flow (a
task per step; the temporary Prefect server is started by a warm-up flow first, so
its start-up is not counted). Also prints the partition summary of the config.
Run:  .venv/bin/python benchmarks/data_cache.py [CONFIG] [--set KEY=VALUE ...]
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
        from prefect import flow
        from prefect.settings import temporary_settings

        from bhfl_core.config.loader import load_config
        from data_prep.prepare import prepare_data
        from flows.data import run_prepare

        config = load_config(args.config, args.overrides)
        times: dict[str, float] = {}
        started = time.perf_counter()
        cold = prepare_data(config, Path(tmp) / "inline", log=lambda _: None)
        times["inline cold"] = time.perf_counter() - started
        started = time.perf_counter()
        cached = prepare_data(config, Path(tmp) / "inline", log=lambda _: None)
        times["inline cached"] = time.perf_counter() - started
        assert not cold.cached and cached.cached

        with temporary_settings(updates={"flows.heartbeat_frequency": None}):
            flow(name="warm-up")(lambda: None)()
            for label in ("flow cold", "flow cached"):
                started = time.perf_counter()
                run_prepare(config, Path(tmp) / "flow")
                times[label] = time.perf_counter() - started

        print((cold.report_dir / "partition.md").read_text())
        print(f"{'preparation':<16}{'seconds':>10}")
        for label, seconds in times.items():
            print(f"{label:<16}{seconds:>10.3f}")


if __name__ == "__main__":
    main()
