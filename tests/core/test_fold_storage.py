"""FoldStorage: a batch the parent folds goes into transfer files; a whole round into buffers the worker reuses."""

import torch

from bhfl_core.algorithm.aggregation import WeightedSum
from bhfl_core.store.transfer import Transfer
from tasks.fold_storage import FoldStorage


def test_a_whole_round_folds_into_zeroed_reused_memory_and_other_batches_into_files(tmp_path):
    transfer, storage = Transfer(tmp_path / "transfer"), FoldStorage()
    x = torch.arange(6, dtype=torch.float32)
    tiny = torch.full((6,), 2.0**-60)  # below hi's last bit: what float64 rounds away goes to lo
    pointers, errors = [], []
    for scale in (1.0, 5.0):  # the second round folds other values into the first's buffers: nothing stale counts
        allocate, in_files = storage.allocator(transfer, "edge.w0", whole_round=True)
        fold = WeightedSum(allocate=allocate)
        fold.add((x + 1) * scale, 2)
        fold.add(tiny, 1)
        pointers.append((fold.hi.data_ptr(), fold.lo.data_ptr()))
        errors.append(fold.lo.clone())
        assert in_files == {}  # the sum is no file ...
        fold.close()
        assert torch.equal(fold.mean(), (x + 1) * scale * 2 / 3)
        assert list(in_files) == ["mean"]  # ... what it closes to, and sends, is
        assert torch.equal(Transfer.get(in_files["mean"][0]), fold.mean())
    assert pointers[0] == pointers[1]  # the second round reused the first's buffers ...
    assert errors[0].tolist() == errors[1].tolist() == [2.0**-60] * 6  # ... zeroed: no error carried over
    allocate, in_files = storage.allocator(transfer, "edge.w0", whole_round=False)
    fold = WeightedSum(allocate=allocate)
    fold.add(x, 3)
    assert sorted(in_files) == ["hi", "lo"]  # a batch among several: straight into files the parent maps
    assert torch.equal(Transfer.get(in_files["hi"][0]), (x * 3).double())
    allocate, _ = storage.allocator(transfer, "edge.w0", whole_round=True)
    assert allocate("hi", 4, torch.float64).numel() == 4  # another model size replaces the kept buffers
    assert all(t.numel() == 4 for t in storage._kept.values())


def test_a_whole_round_of_stacked_rows_goes_to_files_and_nothing_is_kept_between_calls(tmp_path):
    """A rule that keeps every child's model (median, Krum: stacked.py) would hold k idle rows between calls in
    reused memory: its rows go to transfer files even for a whole round, freed when the call ends."""
    from bhfl_core.algorithm.stacked import StackedModels

    transfer, storage = Transfer(tmp_path / "transfer"), FoldStorage()
    allocate, in_files = storage.allocator(transfer, "edge.w0", whole_round=True)
    fold = StackedModels(allocate=allocate)
    fold.add("c1", torch.ones(6), 2.0)
    fold.add("c2", torch.zeros(6), 3.0)
    assert sorted(in_files) == ["row0", "row1"] and storage._kept == {}
    assert torch.equal(Transfer.get(in_files["row0"][0]), torch.ones(6))  # folded straight into the file
    fold.close_with(lambda s: s.ordered()[1].row)
    assert sorted(in_files) == ["mean", "row0", "row1"] and torch.equal(Transfer.get(in_files["mean"][0]), fold.closed)
