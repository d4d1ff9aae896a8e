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
    assert [row[1] for row in rows] == ["replace", "persistent"] and all(row[-1].endswith("x") for row in rows)


def test_the_secure_aggregation_benchmark_runs_at_a_tiny_size():
    out = _run("benchmarks/secagg.py", "--numel", "1000", "--cohorts", "4")
    assert "X25519+HKDF" in out.stdout and "AES-256-CTR" in out.stdout
    rows = [line.split() for line in out.stdout.splitlines() if line.strip().startswith("4 ")]
    assert [row[1] for row in rows] == ["complete", "sparse"]


def test_the_privacy_round_benchmark_runs_at_a_tiny_size():
    out = _run("benchmarks/privacy_round.py", "--clients", "4", "--values", "500", "--repeats", "1")
    names = [line.split(" s a round")[0].rsplit(None, 1)[0].strip() for line in out.stdout.splitlines()[1:]]
    assert names == ["mean", "dp rdp", "dp pld", "dp poisson pld", "secagg", "dp + secagg", "distributed dp"]
