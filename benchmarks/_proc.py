"""Memory and CPU of a whole process tree (a run's orchestrator, its workers, its servers).

A run is several processes, so a figure of one process (``ru_maxrss``) hides most of
it. ``TreeSampler`` polls a root process and all its descendants:
the peak of the summed PSS (proportional set size: shared pages, e.g. the libraries
forked workers share, are split between the processes instead of counted in each) and
the CPU seconds of every process seen (the last reading per pid, so processes that
exited before the end still count). The series of readings is kept, so a phase's peak
(e.g. training, from the run's timeline) can be read afterwards.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Self

import psutil


class _Poller:
    """Calls ``sample`` every ``interval_s`` in a daemon thread between ``__enter__`` and ``__exit__``."""

    def __init__(self, interval_s: float, name: str) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    @property
    def active(self) -> bool:
        return True

    def sample(self) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> Self:
        if self.active:
            self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self.active:
            self._thread.join()


class TreeSampler(_Poller):
    """CPU times every ``interval_s`` (cheap: /proc/PID/stat), PSS every ``pss_interval_s``.

    PSS is costly to read (the kernel walks the page tables: ~10 ms for a process that
    imported torch), so reading it for six processes every 0.1 s would take half a core
    from the processes measured, more for a run of many processes than for the
    one-process loop it is compared with; memory peaks last seconds, 1 s catches them.
    """

    def __init__(self, pid: int, interval_s: float = 0.1, pss_interval_s: float = 1.0) -> None:
        super().__init__(interval_s, "tree-sampler")
        self.root = psutil.Process(pid)
        self.pss_interval_s = pss_interval_s
        self._next_pss = 0.0
        self.series: list[tuple[float, int]] = []  # (wall time, summed PSS bytes)
        self._cpu: dict[tuple[int, float], float] = {}  # (pid, create time) -> user + system seconds

    def _processes(self) -> list[psutil.Process]:
        try:
            return [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def sample(self) -> None:
        now = time.time()
        with_pss = now >= self._next_pss
        pss = 0
        for proc in self._processes():
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    self._cpu[(proc.pid, proc.create_time())] = times.user + times.system
                    if with_pss:
                        pss += proc.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        if with_pss:
            self.series.append((now, pss))
            self._next_pss = now + self.pss_interval_s

    @property
    def cpu_s(self) -> float:
        return sum(self._cpu.values())

    def peak_pss_mb(self, start: float = float("-inf"), end: float = float("inf")) -> float:
        """The highest summed PSS (MB) read between ``start`` and ``end`` (wall times)."""
        inside = [pss for t, pss in self.series if start <= t <= end]
        return max(inside, default=0) / 2**20


class GpuSampler(_Poller):
    """GPU 0's busy share and memory every ``interval_s``, through NVML (``nvidia-ml-py``); inert without one.

    NVML's utilisation is the share of its last sample period (1/6 s to 1 s, by GPU)
    in which a kernel was running: "busy", not how much of the GPU a kernel used.
    """

    def __init__(self, interval_s: float = 0.1) -> None:
        super().__init__(interval_s, "gpu-sampler")
        self.series: list[tuple[float, int, int]] = []  # (wall time, busy %, memory used bytes)
        self._handle = _nvml_handle()

    @property
    def active(self) -> bool:
        return self._handle is not None

    def sample(self) -> None:
        import pynvml

        rates = pynvml.nvmlDeviceGetUtilizationRates(self._handle)
        used = pynvml.nvmlDeviceGetMemoryInfo(self._handle).used
        self.series.append((time.time(), int(rates.gpu), int(used)))

    def busy(self, start: float, end: float) -> float:
        """Mean busy % of the readings between ``start`` and ``end`` (NaN: none, or no GPU)."""
        inside = [busy for t, busy, _ in self.series if start <= t <= end]
        return sum(inside) / len(inside) if inside else float("nan")

    def peak_memory_mb(self) -> float:
        return max((used for _, _, used in self.series), default=0) / 2**20 if self.active else float("nan")

    def timeline(self, start: float, end: float, buckets: int = 20) -> str:
        """Busy % over ``[start, end]`` in ``buckets`` equal slices, e.g. ``5 40 38 ...``: utilisation over time."""
        if not self.active or not end > start:
            return ""
        width = (end - start) / buckets
        return " ".join(f"{self.busy(start + i * width, start + (i + 1) * width):.0f}" for i in range(buckets))


def _nvml_handle() -> object | None:
    """GPU 0's NVML handle, or None where there is no NVML or no NVIDIA GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # no nvidia-ml-py, no driver, no GPU: nothing to sample
        return None
