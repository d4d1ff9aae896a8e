"""Same config and seed -> bit-identical node states, whatever runs it, with dropout on.

Runs the B-HFL example (FedAdam both ways, proxy training, up- and down-residuals), so
every stateful piece (optimiser moments, residual accumulators and their own states)
is covered, with dropout 0.1 (every hub model has it; dropout draws from torch's
process-wide generator, so two trainings sharing a process would draw each other's
masks). The same run is made through Prefect on the run's own local cluster (2 worker
processes, with a transient worker failure that Prefect retries), without Prefect in
this one process (1 worker), on a local cluster of 4 workers with another placement,
and on a separately started Dask cluster; each run prepares its data from scratch in
its own folder. All must give the same bytes; another seed must not.
"""

from pathlib import Path

import pytest

from bhfl_core.store.node_store import StateStore
from flows.experiment import PLAIN_CALLS, run_experiment
from tasks import faults
from tasks.context import open_run, opened_runs
from tests.small import small_config

# own_data_cache: each run prepares its data afresh in its own folder
pytestmark = [pytest.mark.integration, pytest.mark.own_data_cache]

BASE = ("tree.root.rounds=2", "eval.every=0", "model.tiny.dropout=0.1")


def _node_files(run_path: str) -> dict[str, bytes]:
    nodes = Path(run_path) / "state" / "nodes"
    return {p.name: p.read_bytes() for p in sorted(nodes.glob("*.safetensors"))}


def test_bhfl_example_is_bit_identical_across_workers_executors_and_placements(tmp_path, monkeypatch, dask_cluster):
    cfg = small_config(*BASE, config="bhfl-full.yaml")
    # a transient failure in a worker: the batch task fails once and Prefect retries it
    # (runtime.retries = 1); clients it had finished are not trained again, and nothing changes
    counter = tmp_path / "fault-counts.txt"
    monkeypatch.setenv(faults.ENV, "client@3:raise")
    monkeypatch.setenv(faults.COUNTER_ENV, str(counter))
    via_prefect = run_experiment(cfg, tmp_path / "a")
    assert faults.shared_counts(str(counter))["client"] > 3  # the fault fired in a worker and the run went on
    monkeypatch.delenv(faults.ENV)
    monkeypatch.delenv(faults.COUNTER_ENV)
    reference = _node_files(via_prefect["run_path"])
    assert "root.safetensors" in reference and len(reference) >= 6
    model = open_run(via_prefect["run_path"]).build_model(0)
    assert model.config.hidden_dropout_prob == 0.1 == model.config.attention_probs_dropout_prob

    others = {
        "inline, this process, 1 worker": run_experiment(
            small_config(*BASE, "runtime.executor=inprocess", config="bhfl-full.yaml"),
            tmp_path / "b",
            orchestration=PLAIN_CALLS,
        ),
        "inline, local cluster of 4 workers, round robin": run_experiment(
            small_config(*BASE, "runtime.workers=4", "runtime.placement=round_robin", config="bhfl-full.yaml"),
            tmp_path / "c",
            orchestration=PLAIN_CALLS,
        ),
        "Prefect, user-started Dask cluster, learned placement": run_experiment(
            small_config(
                *BASE,
                "runtime.executor=cluster",
                f"runtime.cluster={dask_cluster}",
                "runtime.placement=learned",
                config="bhfl-full.yaml",
            ),
            tmp_path / "d",
        ),
    }
    # the user's workers serve run after run: once the run ended, neither keeps its context (data, tree, store)
    from distributed import Client

    from tasks.worker import busy_intervals

    ended = others["Prefect, user-started Dask cluster, learned placement"]["run_path"]
    assert sorted(busy_intervals(Path(ended))) == ["w0", "w1"]  # both opened it
    with Client(dask_cluster, set_as_default=False) as client:
        kept = client.run(opened_runs)
    assert len(kept) == 2 and all(str(Path(ended).resolve()) not in paths for paths in kept.values()), kept
    for how, result in others.items():
        files = _node_files(result["run_path"])
        assert files.keys() == reference.keys(), how
        assert [n for n in reference if files[n] != reference[n]] == [], how
        assert result["headline"] == via_prefect["headline"], how

    # the residual machinery really ran: its optimiser states exist and accumulators were consumed
    store = StateStore(Path(via_prefect["run_path"]) / "state")
    assert int(store.load("root").opt_res["up0"]["step"]) == 2
    assert int(store.load("edge-de").opt_res["down0"]["step"]) >= 1
    assert not list((store.root / "residuals").rglob("*.safetensors"))

    # and a different seed changes the result
    other = run_experiment(
        small_config(*BASE, "seed=1", "runtime.executor=inprocess", config="bhfl-full.yaml"),
        tmp_path / "e",
        orchestration=PLAIN_CALLS,
    )
    assert _node_files(other["run_path"])["root.safetensors"] != reference["root.safetensors"]
