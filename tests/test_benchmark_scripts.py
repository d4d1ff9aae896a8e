"""The benchmark scripts still run against today's code (a tiny size, not a measurement): an API change that
breaks one fails here, not in the next session that needs its figures."""

import subprocess
import sys

from tests.small import REPO


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    """A benchmark script run from the repository as a user runs it; it must exit 0."""
    out = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_the_data_path_benchmark_runs_both_scenarios_at_a_tiny_size():
    out = _run("benchmarks/datapath.py", "--sizes", "1", "--clients", "2", "--rounds", "2", "--train-s", "0")
    rows = [line.split() for line in out.stdout.splitlines() if line.strip().startswith("1M")]
    floor, *scenarios = rows
    assert floor[1:3] == ["write", "floor:"] and float(floor[3]) >= 0 and floor[4] == "ms"
    assert [row[1] for row in scenarios] == ["replace", "persistent"] and all(r[-1].endswith("x") for r in scenarios)


def test_the_secure_aggregation_benchmark_runs_at_a_tiny_size():
    out = _run("benchmarks/secagg.py", "--numel", "1000", "--cohorts", "4")
    assert "X25519+HKDF" in out.stdout and "AES-256-CTR" in out.stdout
    rows = [line.split() for line in out.stdout.splitlines() if line.strip().startswith("4 ")]
    assert [row[1] for row in rows] == ["complete", "sparse"]


def test_the_privacy_round_benchmark_runs_at_a_tiny_size():
    out = _run("benchmarks/privacy_round.py", "--clients", "4", "--values", "500", "--repeats", "1")
    names = [line.split(" s a round")[0].rsplit(None, 1)[0].strip() for line in out.stdout.splitlines()[1:]]
    assert names == ["mean", "dp rdp", "dp pld", "dp poisson pld", "secagg", "dp + secagg", "distributed dp"]


def test_the_lora_experiment_runs_at_a_tiny_size_and_sends_what_each_fold_federates(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:  # the script's own random folder, written here and given to it as a user's own (--model-dir)
        from _lora_folders import write_folder
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    write_folder("bert", "tiny", tmp_path / "mine")
    out = _run(
        "benchmarks/lora_experiment.py", "--model-dir", str(tmp_path / "mine"), "--seeds", "0",
        "--variants", "ab-mean", "ffa",
        "--jobs", "2", "--set", "data.source.languages=[en,de]", "--set", "tree.root.rounds=1",
        "--set", "runtime.workers=1",
    )  # fmt: skip
    lines = out.stdout.splitlines()
    folder = next(line for line in lines if line.startswith("model folder:"))  # "..., 21,728 backbone parameters, ..."
    backbone = int(folder.split(", ")[1].split()[0].replace(",", ""))
    assert folder.startswith(f"model folder: {(tmp_path / 'mine').resolve()}, ")  # the folder given, as it is
    header, _, *rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("|")]
    assert header == ["variant", "values/model", "MB/round", "root union", "edge own", "client own", "ab err",
                       "trunc err", "wall s", "peak PSS MB"]  # fmt: skip
    table = {cells[0]: dict(zip(header, cells, strict=True)) for cells in rows}
    assert list(table) == ["ab-mean", "ffa"]
    values = {v: int(row["values/model"].replace(",", "")) for v, row in table.items()}
    # The tiny folder: hidden 32, one layer; r 8 on query and value; the head Linear(32, 10 categories).
    # ab-mean sends A (8 x 32) and B (32 x 8) of both matrices and the head; ffa the same without A.
    head = 32 * 10 + 10
    assert values == {"ab-mean": 2 * (8 * 32 + 32 * 8) + head, "ffa": 2 * 32 * 8 + head}
    assert values["ab-mean"] < backbone / 10  # LoRA sends a small part of what full fine-tuning would
    assert float(table["ffa"]["MB/round"]) < float(table["ab-mean"]["MB/round"])
    assert float(table["ab-mean"]["ab err"]) > 0 and table["ffa"]["ab err"] == "–"  # ffa's mean is exact: none logged
