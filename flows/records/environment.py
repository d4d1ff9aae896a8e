"""What a run records about where it ran: git commit, package versions, CPU kernels, peak memory."""

from __future__ import annotations

import importlib.metadata
import subprocess
from pathlib import Path


def package_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def git_commit() -> str:
    """The project's git commit (``+dirty`` with uncommitted changes); ``unknown`` outside a checkout."""
    repo = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10, check=False
        )
        if commit.returncode:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo,
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        ).stdout.strip()
        return commit.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_capability() -> str:
    """The vector instruction set of torch's CPU kernels here: ``AVX512``, ``AVX2``, ... (ATEN_CPU_CAPABILITY caps it).

    Recorded because it changes results: kernels of different widths sum in different orders,
    so the same config and seed round differently, and a few rounds of training turn that into
    accuracy differences as large as the spread over seeds (docs/runtime.md, "Reproducibility").
    """
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def environment_text() -> str:
    """Installed distributions (``name==version``), logged with every run so two runs are comparable."""
    names = sorted(
        {f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions() if d.metadata["Name"]}
    )
    return "\n".join(names) + "\n"


def peak_rss_mb(reset: bool) -> float:
    """This process's peak resident memory (MB) since the last reset (Linux; NaN elsewhere).

    Resetting (``/proc/self/clear_refs`` = 5) lets each phase report its own peak, so
    training memory is not hidden behind data preparation or evaluation. Worker
    processes are not included (benchmarks/throughput.py measures the process tree).
    """
    try:
        status = Path("/proc/self/status").read_text(encoding="utf-8")
        peak = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) / 1024
        if reset:
            Path("/proc/self/clear_refs").write_text("5", encoding="utf-8")
        return peak
    except (OSError, StopIteration, ValueError):
        return float("nan")
