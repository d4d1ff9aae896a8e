"""scale.py's measurements of a process: its tree's memory and CPU, its output lines on arrival, its phases.

A measured process runs to its end while a thread samples its process tree
(benchmarks/_proc.py) and two more timestamp every line of its stdout and stderr;
``phases`` turns the boundaries a run reports (its timeline) into contiguous phase
seconds that add up to its wall time.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil
from _env import REPO
from _proc import TreeSampler

Figures = dict[str, Any]


class Sampler(TreeSampler):
    """benchmarks/_proc.py's process-tree sampler (CPU and PSS every ``interval`` s), plus each process's peak fds."""

    def __init__(self, pid: int, interval: float) -> None:
        super().__init__(pid, interval_s=interval, pss_interval_s=interval)
        self.fds: dict[int, int] = {}  # pid -> most open file descriptors seen

    def sample(self) -> None:
        super().sample()
        for proc in self._processes():
            try:
                self.fds[proc.pid] = max(self.fds.get(proc.pid, 0), proc.num_fds())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue


def _drain(stream: IO[str], into: list[tuple[float, str]]) -> threading.Thread:
    """Read ``stream`` line by line in a thread, each line with the wall time it arrived."""

    def read() -> None:
        for line in stream:
            into.append((time.time(), line.rstrip("\n")))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


@dataclass
class Measured:
    started: float  # the process's creation time
    exited: float
    stdout: list[tuple[float, str]]
    stderr: list[tuple[float, str]]
    sampler: Sampler


def measure(cmd: list[str], env: dict[str, str], interval: float) -> Measured:
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = psutil.Process(proc.pid).create_time()
    out: list[tuple[float, str]] = []
    err: list[tuple[float, str]] = []
    with Sampler(proc.pid, interval) as sampler:
        readers = [_drain(proc.stdout, out), _drain(proc.stderr, err)]  # type: ignore[arg-type]
        proc.wait()
        exited = time.time()
        for reader in readers:
            reader.join()
    if proc.returncode:
        tail = "\n".join(line for _, line in err[-60:])
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}):\n{tail}")
    return Measured(started, exited, out, err, sampler)


def child_env(args: argparse.Namespace) -> dict[str, str]:
    """This checkout first on the path (workers included); no Prefect server, home or MLflow store of the caller's."""
    drop = ("PREFECT_API_URL", "PREFECT_HOME", "MLFLOW_TRACKING_URI")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    if args.prefect_api_url:
        env["PREFECT_API_URL"] = args.prefect_api_url
    return env


def disk_bytes(path: Path) -> int:
    """Allocated size on disk of everything under ``path`` (du's figure)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total


PHASE_PEAKS = {  # figure -> (from, to) boundaries: the peak PSS within each stretch of the run
    "pss_startup": ("start", "flow"),
    "pss_prepare": ("flow", "data"),
    "pss_setup": ("data", "first"),
    "pss_train": ("first", "last"),
    "pss_evaluate": ("last", "eval_end"),
    "pss_report": ("eval_end", "exit"),
}


def phase_peaks(sampler: Sampler, t: dict[str, float], exited: float) -> Figures:
    """The peak PSS (MB) of each stretch of the run (a sample on a boundary counts in both)."""
    bounds = {**t, "exit": exited}
    return {key: sampler.peak_pss_mb(bounds[a], bounds[b]) for key, (a, b) in PHASE_PEAKS.items()}


def phases(t: dict[str, float], exited: float, trainings: int) -> Figures:
    """Phase seconds from boundaries ``t`` (absent ones NaN) and the figures derived from them."""
    nan = math.nan
    g = {k: t.get(k, nan) for k in ("start", "flow", "data", "first", "last", "eval_start", "eval_end")}
    close = g["eval_start"] - g["last"]
    evaluate = g["eval_end"] - g["eval_start"]
    if math.isnan(close):  # no start of the evaluation: close folded into evaluate
        evaluate = g["eval_end"] - g["last"]
    train = g["last"] - g["first"]
    wall = exited - g["start"]
    return {
        "wall": wall,
        "startup": g["flow"] - g["start"],
        "prepare": g["data"] - g["flow"],
        "setup": g["first"] - g["data"],
        "train": train,
        "close": close,
        "evaluate": evaluate,
        "report": exited - g["eval_end"],
        "after_share": (exited - g["last"]) / train,
        "cps_wall": trainings / wall,
        "cps_train": trainings / train,
        "trainings": trainings,
    }
