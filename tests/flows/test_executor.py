"""Executors: the local cluster's worker slots, a user-started Dask cluster's slots."""

import pytest
import torch

from bhfl_core.config.base import ConfigError
from bhfl_core.config.schema import RuntimeConfig
from tasks import local_cluster
from tasks.executor import cluster_workers

pytestmark = pytest.mark.integration


def test_local_slots_per_gpu_and_per_core(monkeypatch):
    monkeypatch.setattr(
        local_cluster, "resolve_devices", lambda setting: [torch.device("cuda:0"), torch.device("cuda:1")]
    )
    assert local_cluster.local_slots(RuntimeConfig(workers_per_device=2)) == [
        ("cuda0-0", "cuda:0"),
        ("cuda0-1", "cuda:0"),
        ("cuda1-0", "cuda:1"),
        ("cuda1-1", "cuda:1"),
    ]
    assert [n for n, _ in local_cluster.local_slots(RuntimeConfig(workers_per_device=2, workers=3))] == [
        "cuda0-0",
        "cuda0-1",
        "cuda1-0",
    ]
    monkeypatch.setattr(local_cluster, "resolve_devices", lambda setting: [torch.device("cpu")])
    assert local_cluster.local_slots(RuntimeConfig(workers=3)) == [("cpu-0", "cpu"), ("cpu-1", "cpu"), ("cpu-2", "cpu")]


def test_a_user_started_cluster_is_set_up_and_its_workers_listed(dask_cluster):
    workers = cluster_workers(dask_cluster, RuntimeConfig(executor="cluster", cluster=dask_cluster))
    assert [(w["name"], w["device"], w["kind"]) for w in workers] == [("w0", "cpu", "cpu"), ("w1", "cpu", "cpu")]
    assert len({w["pid"] for w in workers}) == 2  # separate processes
    one = cluster_workers(dask_cluster, RuntimeConfig(executor="cluster", cluster=dask_cluster, workers=1))
    assert [w["name"] for w in one] == ["w0"]


def test_a_cluster_without_workers_is_a_message_with_the_fix_not_a_traceback():
    """A scheduler no worker has joined yet (the README's walk-through run too early, a worker that exited):
    a ConfigError (one paragraph, exit 2, `bhfl resume`), saying how to start a worker and check it joined."""
    from distributed import LocalCluster

    with LocalCluster(n_workers=0, host="127.0.0.1", protocol="tcp://", dashboard_address="127.0.0.1:0") as empty:
        address = empty.scheduler_address
        with pytest.raises(ConfigError, match=r"runtime\.cluster: the Dask scheduler at .* has no workers") as err:
            cluster_workers(address, RuntimeConfig(executor="cluster", cluster=address))
    assert f"dask worker {address} --nthreads 1" in str(err.value)
    assert "Registered to" in str(err.value)


def test_local_workers_are_warm_before_they_take_work(capfd):
    """Workers run the warm-up preload before they register, without Dask's profiler; it imports what calls need,
    and they hold the libraries frozen out of the cyclic collector, which is on. A Ctrl-C (SIGINT to the
    command's process group, workers included) leaves them to the command: no traceback."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from distributed import Client

    cluster = local_cluster.start_local_cluster(RuntimeConfig(workers=1), {})
    try:
        with Client(cluster.scheduler_address, set_as_default=False) as client:
            preloads = client.run(lambda dask_worker: [p.name for p in dask_worker.preloads])
            assert list(preloads.values()) == [["tasks.worker_warmup"]]
            callbacks = client.run(lambda dask_worker: sorted(dask_worker.periodic_callbacks))
            assert all("profile" not in names for names in callbacks.values())  # Dask's sampler is off
            assert all("heartbeat" in names for names in callbacks.values())  # (the names are what we think)
            import gc

            collector = client.run(lambda: (gc.isenabled(), gc.get_freeze_count()))
            # forked from the forkserver, which imported the libraries frozen (tasks/forkserver_preload.py)
            assert all(on and frozen > 100_000 for on, frozen in collector.values()), collector
            (pid,) = client.run(os.getpid).values()
            os.kill(pid, signal.SIGINT)
            time.sleep(0.5)
            assert list(client.run(os.getpid).values()) == [pid]  # the same process (a nanny restarts a dead one)
    finally:
        cluster.close()
    assert "KeyboardInterrupt" not in capfd.readouterr().err
    fresh = "import gc, sys; from tasks.worker_warmup import dask_setup; dask_setup(None); " + (
        "print(*(m in sys.modules for m in ('tasks.worker', 'transformers.models.bert.modeling_bert', 'datasets')), "
        "gc.isenabled(), gc.get_freeze_count() > 100_000)"  # a spawned (GPU) worker imports frozen too
    )
    out = subprocess.run([sys.executable, "-c", fresh], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["True", "True", "True", "True", "True"]


def test_gpu_workers_run_deterministic_kernels_without_cublas_debug_mode():
    """``gpu_deterministic``: torch's deterministic algorithms on (warn only), no NaN fill, no CUBLAS_WORKSPACE_CONFIG.

    In a fresh process (the settings are process-wide). The cuBLAS variable made each
    BERT-base step ~2.8x slower on an H200 while the bits stayed the same; PyTorch's
    warning about its absence is silenced, other warnings are not.
    """
    import os
    import subprocess
    import sys

    probe = (
        "import os, warnings, torch\n"
        "from tasks.worker import gpu_deterministic\n"
        "gpu_deterministic()\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.warn('Deterministic behavior was enabled with either `torch.use_deterministic_algorithms(True)`"
        " or `at::Context::setDeterministicAlgorithms(true)`, but this operation is not deterministic because it"
        " uses CuBLAS and you have CUDA >= 10.2.', UserWarning)\n"
        "    warnings.warn('another warning', UserWarning)\n"
        "print(torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),"
        " torch.utils.deterministic.fill_uninitialized_memory, os.environ.get('CUBLAS_WORKSPACE_CONFIG'),"
        " [str(w.message) for w in seen])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120, env=env
    )
    assert out.stdout.strip() == "True True False None ['another warning']"
