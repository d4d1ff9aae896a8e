"""Aggregation, metrics, placement, state store, flat parameters."""

import subprocess
import sys
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
import torch

from bhfl_core.algorithm.aggregation import WeightedSum
from bhfl_core.algorithm.node_opt import NodeOptParams
from bhfl_core.algorithm.node_state import NodeState
from bhfl_core.analysis.distribution import worst_fraction_mean
from bhfl_core.learning.metrics import accuracy, macro_f1
from bhfl_core.learning.params import get_flat, set_flat
from bhfl_core.placement import split_by_load
from bhfl_core.store.node_store import StateStore


def test_weighted_sum_merge_equals_single_sum():
    xs = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0]), torch.tensor([0.5, 0.5])]
    ws = [1.0, 2.0, 5.0]
    whole = WeightedSum()
    for x, w in zip(xs, ws):
        whole.add(x, w)
    left, right = WeightedSum(), WeightedSum()
    left.add(xs[0], ws[0])
    right.add(xs[1], ws[1])
    right.add(xs[2], ws[2])
    left.merge(right)
    expected = [(1 * 1 + 2 * 3 + 5 * 0.5) / 8, (1 * 2 + 2 * -1 + 5 * 0.5) / 8]
    assert whole.mean().tolist() == pytest.approx(expected)
    assert torch.equal(left.mean(), whole.mean())
    with pytest.raises(ValueError):
        WeightedSum().mean()
    with pytest.raises(ValueError):
        WeightedSum().add(xs[0], 0)


def test_metrics_by_hand():
    # truth rows, predictions columns: class 0: 3 right, 1 predicted as 1; class 1: 1 right; class 2 absent
    c = torch.tensor([[3, 1, 0], [0, 1, 0], [0, 0, 0]])
    assert accuracy(c) == pytest.approx(4 / 5)
    f1_0 = 2 * 3 / (4 + 3)  # 2TP / (true + predicted)
    f1_1 = 2 * 1 / (1 + 2)
    assert macro_f1(c) == pytest.approx((f1_0 + f1_1) / 2)  # absent class 2 not averaged
    assert worst_fraction_mean([0.9, 0.1, 0.5, 0.7] * 5) == pytest.approx(0.1)  # lowest 2 of 20


def test_split_by_load_balances_and_is_deterministic():
    items = ["a", "b", "c", "d", "e"]
    loads = [10, 1, 9, 2, 8]
    plan = split_by_load(items, loads, 2)
    assert sorted(item for batch in plan for item in batch) == items
    totals = sorted(sum(loads[items.index(i)] for i in b) for b in plan)
    assert totals == [13, 17]  # LPT: a(10)->w0, c(9)->w1, e(8)->w1, d(2)->w0, b(1)->w0
    assert plan == split_by_load(items, loads, 2)
    assert split_by_load(items[:1], loads[:1], 4) == [["a"]]  # never empty lists


def test_state_store_roundtrip_and_atomicity(tmp_path):
    store = StateStore(tmp_path)
    assert store.load("x") == NodeState()
    st = NodeState(
        torch.arange(4.0), {"m": torch.ones(4), "step": torch.tensor(3)}, {"v": torch.zeros(4)}, rounds_done=5
    )
    store.save("x", st)
    back = store.load("x")
    assert torch.equal(back.model, st.model) and back.rounds_done == 5
    assert torch.equal(back.opt_up["m"], st.opt_up["m"]) and int(back.opt_up["step"]) == 3
    assert set(back.opt_down) == {"v"}
    assert [p.name for p in (tmp_path / "nodes").iterdir()] == ["x.safetensors"]  # no temp files left

    class Boom(Exception):
        pass

    bad = NodeState(model=torch.arange(4.0) + 100)
    import bhfl_core.store.node_store as ss

    original = ss.save_file
    ss.save_file = lambda *a, **k: (_ for _ in ()).throw(Boom())
    try:
        with pytest.raises(Boom):
            store.save("x", bad)
    finally:
        ss.save_file = original
    assert torch.equal(store.load_model("x"), st.model)  # the old checkpoint survives a failed write
    assert [p.name for p in (tmp_path / "nodes").iterdir()] == ["x.safetensors"]


def test_flat_parameters_roundtrip():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    flat = get_flat(model)
    assert flat.shape == (3 * 2 + 2 + 2 * 1 + 1,)
    set_flat(model, torch.arange(flat.numel(), dtype=torch.float32))
    assert model[0].bias.tolist() == [6.0, 7.0]
    with pytest.raises(ValueError, match="trainable parameters"):
        set_flat(model, torch.zeros(3))


def test_core_never_imports_prefect_or_mlflow():
    """Every module file under bhfl_core, imported in a fresh interpreter, leaves no prefect or mlflow module loaded.

    The modules come from a walk of the files (not of what the package imports), so a new
    module in a new sub-package is checked without anyone listing it.
    """
    core = Path(__file__).resolve().parents[2] / "bhfl_core"
    names = sorted(
        ".".join(path.relative_to(core.parent).with_suffix("").parts).removesuffix(".__init__")
        for path in core.rglob("*.py")
    )
    assert len(names) > 40 and "bhfl_core.algorithm.engine" in names and "bhfl_core.config.loader" in names
    code = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    importlib.import_module(name)\n"
        "    bad = sorted({m.split('.')[0] for m in sys.modules} & {'prefect', 'mlflow'})\n"
        "    if bad: sys.exit(f'{name} imports {bad}')\n"
        "print(sum(name in sys.modules for name in sys.argv[1:]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *names], cwd=core.parent, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout) == len(names)  # every module was really imported


def test_node_opt_params_frozen():
    with pytest.raises(FrozenInstanceError):
        NodeOptParams().eta = 2.0  # type: ignore[misc]


def test_grouped_confusions_equal_split_by_split_scoring():
    from bhfl_core.config.schema import ModelConfig
    from bhfl_core.learning.local_train import grouped_confusions
    from bhfl_core.learning.models import build_model

    labels = ["a", "b", "c"]
    model = build_model(
        ModelConfig(
            tiny={
                "vocab_size": 100,
                "hidden_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "intermediate_size": 32,
            }
        ),
        "classification",
        labels,
        100,
        0,
        3,
    )
    g = torch.Generator().manual_seed(0)
    n, width = 23, 12
    lengths = torch.randint(2, width + 1, (n,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    data = {
        "input_ids": torch.randint(5, 100, (n, width), generator=g) * mask,
        "attention_mask": mask,
        "token_type_ids": torch.zeros(n, width, dtype=torch.long),
        "labels": torch.randint(0, 3, (n,), generator=g),
    }
    groups = torch.randint(0, 4, (n,), generator=g)
    together = grouped_confusions(model, data, groups, 4, 3, batch_size=5, device=torch.device("cpu"))
    model.eval()
    with torch.no_grad():
        preds = model(**{k: v for k, v in data.items() if k != "labels"}).logits.argmax(-1)
    for k in range(4):
        rows = groups == k
        want = torch.zeros(3, 3, dtype=torch.int64)
        for t, p in zip(data["labels"][rows].tolist(), preds[rows].tolist()):
            want[t, p] += 1
        assert torch.equal(together[k], want)
    assert int(together.sum()) == n


def test_damaged_checkpoints_are_reported_with_the_file_named(tmp_path):
    from bhfl_core.store.node_store import CheckpointError

    store = StateStore(tmp_path)
    store.save("edge-x", NodeState(torch.arange(64.0), {"m": torch.ones(64)}, rounds_done=3))
    path = store.node_path("edge-x")
    good = path.read_bytes()

    flipped = bytearray(good)
    flipped[-5] ^= 0x01  # one bit of the optimiser state or model, after the header
    path.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=r"edge-x.safetensors is damaged \(checksum mismatch in tensor"):
        store.load("edge-x")

    path.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(CheckpointError, match=r"edge-x.safetensors is damaged \(unreadable"):
        store.load_model("edge-x")

    path.write_bytes(good)
    assert store.load("edge-x").rounds_done == 3 and torch.equal(store.load_model("edge-x"), torch.arange(64.0))


def test_checkpoints_of_earlier_versions_are_checked_against_their_crc32s(tmp_path):
    """Files now carry XXH3-64 checksums; a file written before (CRC-32s) still loads, and damage in it is found."""
    import json
    import zlib

    from safetensors import safe_open
    from safetensors.torch import save_file

    from bhfl_core.store.node_store import CheckpointError
    from bhfl_core.store.state_header import INFO

    store = StateStore(tmp_path)
    store.save("edge-x", NodeState(torch.arange(64.0), {"m": torch.ones(64)}, rounds_done=3))
    path = store.node_path("edge-x")
    with safe_open(str(path), framework="pt") as fh:
        info = json.loads(fh.metadata()[INFO])
        names = list(fh.keys())
        tensors = {k: fh.get_tensor(k) for k in names}
    assert set(info["xxh3"]) == set(tensors) and "crc32" not in info
    info["crc32"] = {k: zlib.crc32(t.contiguous().view(torch.uint8).numpy().data) for k, t in tensors.items()}
    del info["xxh3"]
    save_file(tensors, str(path), metadata={INFO: json.dumps(info, sort_keys=True)})
    assert store.load("edge-x").rounds_done == 3 and torch.equal(store.load_model("edge-x"), torch.arange(64.0))

    flipped = bytearray(path.read_bytes())
    flipped[-5] ^= 0x01
    path.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=r"edge-x.safetensors is damaged \(checksum mismatch in tensor"):
        store.load("edge-x")


def test_the_suite_collects_without_xdist():
    """`pytest -p no:xdist` (one process, the plugin off) must work: tests/conftest.py's xdist hook is optional."""
    repo = Path(__file__).resolve().parents[2]
    command = ["-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "--collect-only", "-q"]
    out = subprocess.run(
        [sys.executable, *command, "tests/core/test_tables.py"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-2000:]
    assert "test_tables.py::" in out.stdout
