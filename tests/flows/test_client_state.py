"""Client states at scale, in a real run of persistent clients (docs/runtime.md, "Client states at scale").

One small run in this process (the in-process executor: its worker code runs here, so
what it touches is seen here), with persistent clients that mix their own model in
(``eta_down: 0.5``: each participation reads the client's state and writes it again)
and edge servers that sample 2 of their 3 clients a round:

- a root round touches the state files of the clients its edge servers sampled, and no
  other client's: every lookup of a node's file goes through ``StateStore.node_path``
  (counted), and nothing lists the folder of node states (``os.scandir``/``listdir``);
- once the run is over, no page of a client's state is in the page cache (where the
  filesystem lets pages go);
- the run folder's size it logged (``runtime/run_folder_bytes``, ``..._per_client``) is
  what ``du -s -B1`` finds on disk.
"""

import os
import subprocess
import threading
from pathlib import Path

import pytest
from mlflow import MlflowClient

from bhfl_core.algorithm import engine
from bhfl_core.store.node_store import StateStore
from flows.experiment import PLAIN_CALLS, run_experiment
from flows.records.disk_usage import RUN_FOLDER_BYTES, RUN_FOLDER_BYTES_PER_CLIENT
from tasks.context import open_run
from tests.page_cache import resident, why_pages_stay
from tests.small import small_config

pytestmark = pytest.mark.integration

CONFIG = (
    "runtime.executor=inprocess",
    "tree.client.persistent=true",
    "tree.client.eta_down=0.5",  # each participation reads the client's last state
    "tree.root.rounds=3",
    "eval.every=0",
)


class Accesses:
    """What a run asks of its node states, in order: cohorts drawn, node files looked up, root commits."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, tuple[str, ...]]] = []  # (kind, node or folder, cohort)
        self._lock = threading.Lock()

    def add(self, kind: str, node: str, cohort: tuple[str, ...] = ()) -> None:
        with self._lock:
            self.events.append((kind, node, cohort))

    def rounds(self, root: str) -> list[tuple[set[str], set[str], int]]:
        """Per root round, between two commits of the root: clients sampled, nodes whose file was looked up,
        listings of the folder of node states."""
        out: list[tuple[set[str], set[str], int]] = []
        for kind, node, cohort in self.events:
            if kind == "save" and node == root:
                out.append((set(), set(), 0))  # the first: the initial model, before round 1
            elif out and kind == "cohort":
                out[-1][0].update(cohort)
            elif out and kind == "path":
                out[-1][1].add(node)
            elif out and kind == "list":
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        return out[:-1]  # after the last root commit: the final evaluation and the run's figures


@pytest.fixture
def accesses(monkeypatch) -> Accesses:
    seen = Accesses()
    node_path, save, sample = StateStore.node_path, StateStore.save, engine.sample_cohort
    scandir, listdir = os.scandir, os.listdir

    def counted_path(self, node_id):
        seen.add("path", node_id)
        return node_path(self, node_id)

    def counted_save(self, node_id, state):
        save(self, node_id, state)
        seen.add("save", node_id)

    def counted_sample(children, cohort, seed, node_id, round_index, rate=None):
        drawn = sample(children, cohort, seed, node_id, round_index, rate)
        seen.add("cohort", node_id, tuple(c.id for c in drawn if c.is_leaf))
        return drawn

    def listing(real):
        def wrapper(path=".", *args):
            if str(path).rstrip("/").endswith("state/nodes"):
                seen.add("list", str(path))
            return real(path, *args)

        return wrapper

    monkeypatch.setattr(StateStore, "node_path", counted_path)
    monkeypatch.setattr(StateStore, "save", counted_save)
    monkeypatch.setattr(engine, "sample_cohort", counted_sample)
    monkeypatch.setattr(os, "scandir", listing(scandir))
    monkeypatch.setattr(os, "listdir", listing(listdir))
    return seen


def test_a_round_touches_only_its_cohort_and_client_states_leave_the_page_cache(tmp_path, accesses):
    result = run_experiment(small_config(*CONFIG), tmp_path, orchestration=PLAIN_CALLS)
    run = Path(result["run_path"])
    tree = open_run(str(run)).tree
    clients = {n.id for n in tree.clients()}

    rounds = accesses.rounds(tree.root_id)
    assert len(rounds) == 3
    for i, (sampled, looked_up, listings) in enumerate(rounds, 1):
        touched = looked_up & clients
        assert sampled and sampled < clients, f"root round {i}: the test needs cohorts smaller than the population"
        assert touched == sampled, f"root round {i}: client files touched outside its cohort: {touched - sampled}"
        assert listings == 0, f"root round {i}: the folder of node states was listed"

    nodes = run / "state" / "nodes"
    kept = {p.name: resident(p) for p in nodes.glob("*.safetensors") if p.stem in clients}
    assert len(kept) == len(clients)  # every client kept a state
    if why_pages_stay(nodes) is None:  # (on tmpfs a file's pages are the file itself)
        assert {name: pages for name, pages in kept.items() if pages[0] > 1} == {}

    # the run folder's size, logged at the end of the run: what du finds on disk (run.json is rewritten after
    # it was measured, within its one block)
    logged = MlflowClient(result["tracking_uri"]).get_run(result["run_id"]).data.metrics
    listed = subprocess.run(["du", "-s", "-B1", str(run)], capture_output=True, text=True, check=True).stdout
    du = int(listed.split()[0])
    assert logged[RUN_FOLDER_BYTES] == result["disk"][RUN_FOLDER_BYTES] == du
    assert logged[RUN_FOLDER_BYTES_PER_CLIENT] == pytest.approx(du / len(clients))
