"""Same config and seed -> bit-identical node models, whether run through Prefect or inline."""

from pathlib import Path

from flows.experiment import run_experiment
from tests.small import small_config


def _node_files(run_path: str) -> dict[str, bytes]:
    nodes = Path(run_path) / "state" / "nodes"
    return {p.name: p.read_bytes() for p in sorted(nodes.glob("*.safetensors"))}


def test_prefect_and_inline_runs_are_bit_identical(tmp_path):
    cfg = small_config("tree.root.rounds=2", "eval.every=0")
    via_prefect = run_experiment(cfg, tmp_path / "a")
    inline = run_experiment(cfg, tmp_path / "b", inline=True)
    a, b = _node_files(via_prefect["run_path"]), _node_files(inline["run_path"])
    assert "root.safetensors" in a and len(a) >= 6
    assert a.keys() == b.keys()
    assert all(a[name] == b[name] for name in a), [n for n in a if a[n] != b[n]]
    assert via_prefect["headline"] == inline["headline"]
    # and a different seed changes the result
    other = run_experiment(small_config("tree.root.rounds=2", "eval.every=0", "seed=1"), tmp_path / "c", inline=True)
    assert _node_files(other["run_path"])["root.safetensors"] != a["root.safetensors"]
