"""Client states leave the page cache, servers' stay: residency read with mincore(2), on real files.

A persistent population of 10,000 clients writes 10,000 state files per 10 rounds,
each read once when its client is next sampled (docs/runtime.md, "Client states at
scale"): the store drops a client's pages once its file is durable and once a model
or header read for scoring is done with, and leaves a server's (read again every round).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch

from bhfl_core.algorithm.node_state import NodeState
from bhfl_core.store.atomic import atomic_path, drop_cached
from bhfl_core.store.node_store import StateStore
from tests.page_cache import PAGE, read_all, resident, why_pages_stay

SIZE = 1 << 18  # floats: a 1 MiB model, 256 pages


@pytest.fixture
def drops_pages(tmp_path: Path) -> Path:
    """``tmp_path``, on a filesystem whose clean pages POSIX_FADV_DONTNEED drops; else the test is skipped."""
    if (why := why_pages_stay(tmp_path)) is not None:
        pytest.skip(why)
    return tmp_path


def _state(seed: int) -> NodeState:
    return NodeState(model=torch.randn(SIZE, generator=torch.Generator().manual_seed(seed)), rounds_done=1)


def test_a_clients_state_leaves_the_page_cache_once_durable_and_a_servers_stays(drops_pages):
    store = StateStore(drops_pages, uncached={"en-000"}.__contains__)
    store.save("en-000", _state(0))
    store.save("edge-en", _state(1))
    kept, pages = resident(store.node_path("en-000"))
    assert pages > 256 and kept <= 1, f"{kept} of {pages} pages of a client's state stayed in the page cache"
    kept, pages = resident(store.node_path("edge-en"))
    assert kept == pages, f"a server's state, read again next round, lost {pages - kept} of {pages} pages"
    assert torch.equal(store.load("en-000").theta, _state(0).theta)  # dropped, not damaged

    with store.background_commits() as view:  # a worker's commits, written in a thread: the same filter
        view.commit("en-001", _state(2))
        view.commit("en-000", _state(3))
    assert resident(store.node_path("en-000"))[0] <= 1
    assert resident(store.node_path("en-001"))[0] == resident(store.node_path("en-001"))[1]  # not a client here

    plain = StateStore(drops_pages / "plain")  # a store built without a filter drops nothing
    plain.save("en-000", _state(0))
    assert resident(plain.node_path("en-000"))[0] == resident(plain.node_path("en-000"))[1]


def test_a_clients_model_read_for_scoring_is_a_copy_and_its_pages_are_dropped(drops_pages):
    store = StateStore(drops_pages, uncached={"en-000"}.__contains__)
    for node, seed in (("en-000", 0), ("edge-en", 1)):
        store.save(node, _state(seed))
        read_all(store.node_path(node))  # e.g. the engine's read of its last state, or a backup tool
    model = store.load_model("en-000")
    assert model is not None and torch.equal(model, _state(0).theta)
    kept, pages = resident(store.node_path("en-000"))
    assert kept <= 1, f"{kept} of {pages} pages of a client's file stayed after its model was read"
    store.node_path("en-000").unlink()  # the copy owes nothing to the file
    assert torch.equal(model, _state(0).theta)

    server = store.load_model("edge-en")
    assert server is not None and torch.equal(server, _state(1).theta)
    assert resident(store.node_path("edge-en"))[0] == resident(store.node_path("edge-en"))[1]


def test_a_clients_header_read_drops_what_the_kernel_read_ahead(drops_pages):
    store = StateStore(drops_pages, uncached={"en-000"}.__contains__)
    store.save("en-000", _state(0))
    read_all(store.node_path("en-000"))
    assert store.load_info("en-000")["rounds_done"] == 1
    assert store.load_header("en-000").rounds_done == 1
    assert resident(store.node_path("en-000"))[0] <= 1
    assert store.load_info("en-999") == {} and store.load_header("en-999").rounds_done == 0  # none yet


def test_the_atomic_writer_drops_on_request_and_drop_cached_leaves_mapped_pages(drops_pages):
    kept_file, dropped_file = drops_pages / "kept.bin", drops_pages / "dropped.bin"
    for path, drop in ((kept_file, False), (dropped_file, True)):
        with atomic_path(path, drop_cache=drop) as tmp:
            tmp.write_bytes(os.urandom(64 * PAGE))
    assert resident(kept_file) == (64, 64) and resident(dropped_file)[0] == 0

    with open(kept_file, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        assert sum(mapped[i] for i in range(0, len(mapped), PAGE)) >= 0  # every page mapped in
        drop_cached(kept_file)
        assert resident(kept_file) == (64, 64)  # mapped pages stay: drop after use, not before
    drop_cached(kept_file)
    assert resident(kept_file)[0] == 0
    drop_cached(drops_pages / "gone.bin")  # nothing there: nothing to do
