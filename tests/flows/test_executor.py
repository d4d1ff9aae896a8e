"""Executors: the local cluster's worker slots, a user-started Dask cluster's slots."""

import pytest
import torch

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


def test_local_workers_are_warm_before_they_take_work():
    """Each worker runs the warm-up preload before it registers; in a fresh process it imports what calls need."""
    import subprocess
    import sys

    from distributed import Client

    cluster = local_cluster.start_local_cluster(RuntimeConfig(workers=1), {})
    try:
        with Client(cluster.scheduler_address, set_as_default=False) as client:
            preloads = client.run(lambda dask_worker: [p.name for p in dask_worker.preloads])
            assert list(preloads.values()) == [["tasks.worker_warmup"]]
    finally:
        cluster.close()
    fresh = "import sys; from tasks.worker_warmup import dask_setup; dask_setup(None); " + (
        "print(*(m in sys.modules for m in ('tasks.worker', 'transformers.models.bert.modeling_bert', 'datasets')))"
    )
    out = subprocess.run([sys.executable, "-c", fresh], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["True", "True", "True"]
