"""What a process keeps between runs (docs/runtime.md): bounded, renewed when stale, or nothing at all.

No Prefect, no data: the caches are tested on their own, with the context's opening and
the worker's run replaced by stand-ins.
"""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bhfl_core.config.schema import RuntimeConfig
from bhfl_core.store.run_layout import CONFIG_FILE, DATA_POINTER
from tasks import context, faults, worker
from tasks.executor import ProcessWorker
from tasks.faults import HITS_FILE, NO_FAULTS, FaultPlan


def test_a_fault_plan_counts_a_run_attempt_in_its_folder_across_processes(tmp_path, monkeypatch):
    monkeypatch.delenv(faults.COUNTER_ENV, raising=False)
    monkeypatch.delenv(faults.ENV, raising=False)
    assert FaultPlan.for_run(tmp_path) is NO_FAULTS  # nothing planned: a no-op, no file
    NO_FAULTS.hit("client")
    assert not (tmp_path / HITS_FILE).exists() and NO_FAULTS.checkpoint_hook() is None

    monkeypatch.setenv(faults.ENV, "client@3:raise,checkpoint@1:enospc")
    orchestrator, worker_process = FaultPlan.for_run(tmp_path), FaultPlan.for_run(tmp_path)  # one file, two plans
    orchestrator.hit("client")
    worker_process.hit("client")
    with pytest.raises(RuntimeError, match=r"injected fault at client #3 \(en-01\)"):
        orchestrator.hit("client", "en-01")
    hook = worker_process.checkpoint_hook()
    assert hook is not None
    with pytest.raises(OSError, match="No space left on device"):
        hook(Path("root.safetensors.tmp"))
    assert faults.shared_counts(str(tmp_path / HITS_FILE)) == {"client": 3, "checkpoint": 1}
    (tmp_path / HITS_FILE).unlink()  # the next attempt starts with the timeline cleared: counted afresh
    FaultPlan.for_run(tmp_path).hit("client")
    assert faults.shared_counts(str(tmp_path / HITS_FILE)) == {"client": 1}

    monkeypatch.setenv(faults.COUNTER_ENV, str(tmp_path / "across-runs.txt"))  # a test's own counter file wins
    FaultPlan.for_run(tmp_path / "another-run").hit("client")
    assert faults.shared_counts(str(tmp_path / "across-runs.txt")) == {"client": 1}


def test_opened_runs_are_bounded_renewed_when_their_files_change_and_forgotten(tmp_path, monkeypatch):
    opened: list[Path] = []

    def fake_open(path: Path, config: object = None) -> object:
        opened.append(path)
        return SimpleNamespace(path=path)

    monkeypatch.setattr(context.RunContext, "open", fake_open)
    runs = []
    for name in "abc":
        run = tmp_path / name
        run.mkdir()
        (run / CONFIG_FILE).write_text("name: x\n")
        (run / DATA_POINTER).write_text("{}")
        runs.append(run)
    cache = context.OpenedRuns(size=2)
    a = cache.open(runs[0])
    assert cache.open(str(runs[0])) is a and opened == [runs[0]]  # one open per run and attempt
    cache.open(runs[1])
    cache.open(runs[2])  # over the bound: a, the least recently asked for, goes
    cache.open(runs[1])
    assert opened == runs  # b was kept
    assert cache.open(runs[0]) is not a and opened == [*runs, runs[0]]

    stat = (runs[0] / DATA_POINTER).stat()
    os.utime(runs[0] / DATA_POINTER, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the next attempt rewrote it
    renewed = cache.open(runs[0])
    assert opened[-1] == runs[0] and len(opened) == 5 and cache.open(runs[0]) is renewed
    cache.forget(runs[0])
    cache.open(runs[0])
    assert len(opened) == 6


def test_a_worker_call_runs_at_its_runs_threads_and_gives_the_process_its_own_back(tmp_path, monkeypatch):
    # an older run record's `torch_threads: null` reads as the documented default, 1
    runtime_config = RuntimeConfig.model_validate({"torch_threads": None})
    run = SimpleNamespace(run_path=tmp_path, config=SimpleNamespace(runtime=runtime_config))
    monkeypatch.setattr(worker, "open_run", lambda path: run)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runtime = worker.WorkerRuntime("w", torch.device("cpu"))
        with runtime._call(str(tmp_path)):
            assert torch.get_num_threads() == 1 == RuntimeConfig().torch_threads
        assert torch.get_num_threads() == 2
        with pytest.raises(ValueError), runtime._call(str(tmp_path)):
            raise ValueError("a failing call gives the threads back too")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_in_process_worker_is_one_runtime_per_process_replaced_for_another_device():
    kept = ProcessWorker()
    first = kept.get("cpu")
    assert kept.get("cpu") is first
    other = kept.get("cpu:0")
    assert other is not first and other.device == torch.device("cpu:0") and kept.get("cpu:0") is other
