"""Models between processes by reference (mapped files), and client checkpoints written in the background."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from bhfl_core.algorithm.aggregation_rule import MeanRule
from bhfl_core.algorithm.contract import ChildResult, MemberLoss
from bhfl_core.algorithm.node_state import Caller, NodeState
from bhfl_core.algorithm.residuals import Candidate
from bhfl_core.algorithm.rule_registry import AggregateParams
from bhfl_core.store import transfer as transfer_module
from bhfl_core.store.node_store import StateStore
from bhfl_core.store.transfer import TensorRef, Transfer, receive_result, send_result, transfer_folder


def test_put_and_get_round_trip_and_replace_atomically(tmp_path):
    transfer = Transfer(tmp_path / "t")
    x = torch.randn(1000, dtype=torch.float32)
    ref = transfer.put("root.down", x)
    got = Transfer.get(ref)
    assert torch.equal(got, x) and ref == TensorRef(str(tmp_path / "t" / "root.down"), 1000, "float32")
    again = transfer.put("root.down", x + 1)  # the next round: a reader of the old file keeps its copy
    assert torch.equal(got, x) and torch.equal(Transfer.get(again), x + 1)
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["root.down"]  # no temporary file left
    ints = torch.arange(-3, 3) << 40  # secure aggregation's masked sums: int64, bit for bit
    assert torch.equal(Transfer.get(transfer.put("ints", ints)), ints)
    with pytest.raises(ValueError, match="float32, float64 and int64"):
        transfer.put("bytes", torch.arange(3, dtype=torch.uint8))
    Transfer.drop(again)
    with pytest.raises(FileNotFoundError, match="missing"):
        Transfer.get(again)


def test_a_fold_made_in_mapped_files_is_sent_without_a_copy(tmp_path):
    """A worker folds into files it allocated; sending references them, receiving maps them and removes them."""
    transfer, rule = Transfer(tmp_path / "t"), MeanRule(AggregateParams())
    allocated = {}

    def allocate(part, numel, dtype):
        allocated[part] = transfer.allocate(f"batch.{part}", numel, dtype)
        return allocated[part][1]

    partial = rule.start(Caller("A", 0), allocate=allocate)
    xs = [torch.randn(500) for _ in range(3)]
    for i, x in enumerate(xs):
        rule.contribute(partial, f"c{i}", x, float(i + 1))
    candidate = Candidate("c2", xs[2], 3.0, 0.25)
    result = ChildResult(
        members=("c0", "c1", "c2"), partial=partial, losses=(MemberLoss("c0", 0.5, 1),), candidates=(candidate,)
    )
    sent = send_result(result, rule, transfer, "batch", allocated)
    assert sent.partial == {part: ref for part, (ref, _) in allocated.items()}  # the files folded into, not copies
    files = {p.name for p in (tmp_path / "t").iterdir()}
    assert len(files) == 3 and "batch.candidate-0" in files  # hi, lo and the candidate's model
    got = receive_result(sent, rule)
    assert not any((tmp_path / "t").iterdir())  # mapped, then removed
    want = sum(w * x.double() for w, x in zip((1, 2, 3), xs)) / 6
    assert torch.equal(rule.finalize(got.partial, None).input, want.float())
    assert got.members == result.members and got.losses == result.losses
    assert torch.equal(got.candidates[0].theta, xs[2]) and got.candidates[0].loss == 0.25


def test_mapped_models_are_shared_pages_not_copies(tmp_path):
    """A process that reads a model it was sent maps the file's pages: its own (anonymous) memory does not grow."""
    transfer = Transfer(tmp_path / "t")
    ref = transfer.put("phi", torch.ones(25_000_000))  # 100 MB
    code = (
        "import psutil, torch\n"
        "from bhfl_core.store.transfer import TensorRef, Transfer\n"
        "p = psutil.Process()\n"
        "m = p.memory_info()\n"
        f"x = Transfer.get(TensorRef({ref.path!r}, {ref.numel}))\n"
        "assert float(x.sum()) == x.numel()\n"
        "n = p.memory_info()\n"
        "print((n.rss - n.shared - m.rss + m.shared) / 1e6, (n.shared - m.shared) / 1e6)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    private_mb, shared_mb = map(float, out.split())
    assert private_mb < 10 and shared_mb > 90, (
        f"reading a mapped 100 MB model: {private_mb} MB private, {shared_mb} shared"
    )


def test_the_transfer_folder_follows_runtime_transfer(tmp_path, monkeypatch):
    monkeypatch.setattr(transfer_module, "SHM", tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    run = tmp_path / "run"
    assert transfer_folder(run, "run_folder", local=True) == run / "state" / "transfer"
    assert transfer_folder(run, "memory", local=True).parent == tmp_path / "shm"
    assert transfer_folder(run, "auto", local=False) == run / "state" / "transfer"  # a cluster's workers see the run
    monkeypatch.setattr(transfer_module, "SHM_MIN_FREE", 1 << 60)  # no room: the run folder
    assert transfer_folder(run, "auto", local=True) == run / "state" / "transfer"
    # at the end of an attempt memory is freed, files in the run folder stay for inspection
    in_memory, on_disk = Transfer(transfer_folder(run, "memory", True)), Transfer(run / "state" / "transfer")
    for t in (in_memory, on_disk):
        t.done_with(t.put("sent", torch.zeros(3)))  # a parent's model, once its children have it
        t.put("x", torch.zeros(3))
    assert not (in_memory.folder / "sent").exists() and (on_disk.folder / "sent").exists()
    for t in (in_memory, on_disk):
        t.release()
    assert not in_memory.folder.exists() and (on_disk.folder / "x").exists()


def test_background_commits_write_in_order_and_are_durable_when_the_block_ends(tmp_path):
    store = StateStore(tmp_path)
    written: list[tuple[str, str]] = []
    hold = threading.Event()

    def slow(tmp: Path) -> None:
        hold.wait(5)
        written.append((threading.current_thread().name, tmp.name))

    with StateStore(tmp_path, before_replace=slow).background_commits() as background:
        for i in range(3):
            background.commit(f"c{i}", NodeState(model=torch.full((4,), float(i)), rounds_done=1))
        assert not store.has("c0")  # commit returned before the write: the caller trains the next client
        hold.set()
    assert [name.split(".")[1] for _, name in written] == ["c0", "c1", "c2"]  # one writer, in order
    assert all(thread.startswith("bhfl-commit") for thread, _ in written)
    assert [store.load_model(f"c{i}").tolist() for i in range(3)] == [[float(i)] * 4 for i in range(3)]


def test_a_failed_background_write_fails_the_block_and_leaves_no_temporary_file(tmp_path):
    def full(tmp: Path) -> None:
        if tmp.name.startswith(".c1."):  # (the temporary name's random part may hold "c1" too)
            raise OSError(28, "No space left on device")

    failing = StateStore(tmp_path, before_replace=full)
    with pytest.raises(OSError, match="No space left"), failing.background_commits() as background:
        for i in range(3):
            background.commit(f"c{i}", NodeState(model=torch.zeros(2), rounds_done=1))
    store = StateStore(tmp_path)
    assert store.has("c0") and not store.has("c1") and store.has("c2")
    assert not [p for p in tmp_path.rglob("*.tmp")]


@pytest.mark.skipif(not Path("/dev/shm").is_dir() or not os.access("/dev/shm", os.W_OK), reason="no /dev/shm")
def test_memory_transfers_live_in_dev_shm(tmp_path):
    folder = transfer_folder(tmp_path, "memory", local=True)
    assert folder.parent == Path("/dev/shm") and folder.name.startswith("bhfl-")
    assert transfer_folder(tmp_path, "memory", local=True) == folder  # the same run: the same folder (resume clears it)
