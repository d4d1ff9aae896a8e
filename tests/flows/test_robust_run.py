"""The robust rules and FedNova in the real pipeline: one edge each, trimmed means at the servers.

Node files must be bit-identical with one in-process worker (every edge's round is one
batch: its worker closes the fold, so the median and Krum are computed there), with two
and four worker processes (the clients' models come back as stacked batches the parent
merges and computes on), and after a kill + resume; an edge's model must be the rule
applied to what its clients sent.
"""

from pathlib import Path

import pytest
import torch

from bhfl_core.algorithm.fednova_norm import local_norm
from bhfl_core.algorithm.robust import coordinate_median, krum
from bhfl_core.algorithm.stacked import Member
from flows.experiment import PLAIN_CALLS, run_experiment
from tasks.context import RunContext
from tests.flows.kill_chain import killed_and_resumed, node_files
from tests.small import SMALL, small_config

pytestmark = pytest.mark.integration

ROBUST = [
    "tree.edge.cohort=3",  # all 3 clients: a real median, and Krum's n = 3 > 2f + 2 with f = 0
    "tree.nodes.edge-en.aggregate={kind: median}",
    "tree.nodes.edge-fr.aggregate={kind: krum, byzantine: 0, keep: 2}",
    "tree.nodes.edge-de.aggregate={kind: fednova}",
    # two of its clients FedProx SGD: normalised by (1 - (1 - lr·mu)^s) / (lr·mu), not an integer (fednova_norm.py)
    "tree.nodes.de-00.train={optimizer: sgd, lr: 0.05, mu: 1.0, epochs: 1, batch_size: 4}",
    "tree.nodes.de-01.train={optimizer: sgd, lr: 0.05, mu: 1.0, epochs: 1, batch_size: 4}",
    "tree.server.aggregate={kind: trimmed_mean, trim: 0.25}",  # child servers' models, stacked at the parent
]


def _run(folder: Path, *overrides: str) -> dict:
    return run_experiment(small_config(*ROBUST, *overrides), folder, orchestration=PLAIN_CALLS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("robust")
    return {
        "inprocess": _run(base / "a", "runtime.executor=inprocess"),
        "workers": _run(base / "b", "runtime.executor=local", "runtime.workers=2"),
        "four": _run(base / "d", "runtime.executor=local", "runtime.workers=4"),  # an edge's 3 clients: 3 batches
        "mean": run_experiment(
            small_config("tree.edge.cohort=3", "runtime.executor=inprocess"), base / "c", orchestration=PLAIN_CALLS
        ),
    }


def test_robust_runs_are_bit_identical_with_one_two_and_four_workers_and_differ_from_the_mean(runs):
    first = node_files(Path(runs["inprocess"]["run_path"]))
    assert first == node_files(Path(runs["workers"]["run_path"]))
    assert first == node_files(Path(runs["four"]["run_path"]))
    mean = node_files(Path(runs["mean"]["run_path"]))
    for node in ("edge-en", "edge-fr", "edge-de", "west", "root"):
        assert first[f"{node}.safetensors"] != mean[f"{node}.safetensors"], node


@pytest.mark.parametrize("run", ["inprocess", "workers", "four"])
def test_each_edge_holds_its_rule_applied_to_what_its_clients_sent(runs, run):
    ctx = RunContext.open(Path(runs[run]["run_path"]))
    store = ctx.store

    def sent(edge: str) -> list[Member]:
        """The clients the edge's last round called, with the models they saved (= sent), sorted by name."""
        last = f"{edge}:{store.load(edge).rounds_done - 1}"
        called = sorted(c for c in ctx.tree[edge].children if store.load_header(c).exec_caller == last)
        assert len(called) == 3
        return [Member(c, store.load_model(c), ctx.tree[c].weight) for c in called]

    assert torch.equal(store.load_model("edge-en"), coordinate_median(sent("edge-en")))
    assert torch.equal(store.load_model("edge-fr"), krum(sent("edge-fr"), byzantine=0, keep=2))
    clients = sent("edge-de")
    mean = sum(m.weight * m.row.double() for m in clients) / sum(m.weight for m in clients)
    assert (store.load_model("edge-de").double() - mean).abs().max() > 1e-6  # FedNova: not the plain mean
    assert all(local_norm(ctx.tree[c]) % 1 > 0 for c in ("de-00", "de-01"))  # FedProx SGD's: not step counts


@pytest.mark.timeout(900)
def test_a_robust_run_killed_mid_way_resumes_bit_identically(runs, tmp_path):
    """SIGKILL once the fourth server round is committed, then `bhfl resume`: the same node files."""
    run_path = killed_and_resumed([*SMALL, *ROBUST, "runtime.executor=inprocess"], tmp_path)
    assert node_files(run_path) == node_files(Path(runs["inprocess"]["run_path"]))
