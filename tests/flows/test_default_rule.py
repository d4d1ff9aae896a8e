"""The parent-child contract and the new data path changed no result: models bit-identical to the code before;
the streaming evaluation (issue 43) wrote the same evaluation tables.

The default aggregation rule (``mean``), the typed child results, folding on the worker,
the background checkpoints and the shared-memory transfer replaced the code of d24387f
(workers' ``WeightedSum`` returned by pickling, messages as checksummed files, Tempo's
schedule file, fsync per client). The hashes below are of every tensor of every node
file after the small embedded default and after the example with every stateful piece
(FedAdam both ways, residuals both ways, proxy TRAIN), measured with that code (and
today's data preparation) on the same machine.

CPU kernels of different widths sum in different orders (docs/runtime.md, "Reproducibility"),
so the run uses torch's AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``), which every x86-64
machine of the last decade has; the AVX-512 hashes are there for a machine that runs
the check with its own kernels.
"""

import os
import subprocess
import sys

import pytest
import torch

from tests.small import REPO

pytestmark = pytest.mark.integration

BEFORE = {  # config -> hash of its final node tensors, as the code before the change left them
    "AVX2": {"embedded.yaml": "7685f87ab62decd2", "bhfl-full.yaml": "0f911050b7008155"},
    "AVX512": {"embedded.yaml": "470a11516fbf16ed", "bhfl-full.yaml": "7dcac74d803572ca"},
}

# the evaluation tables of the same runs, as the evaluation before it streamed (every model on every client,
# views of one [clients, labels, labels] tensor pickled whole) wrote them: the streaming one must write the same bytes
EVAL_TABLES = ("matrix", "clients", "proximity", "proximity_clients")
EVAL_BEFORE = {
    config: {
        "matrix": "f7a2a5cc089ab6a2",
        "clients": "c40261848bca4674",
        "proximity": "9090725e6d88864e",
        "proximity_clients": "17e644bc63c6e637",
    }
    for config in ("embedded.yaml", "bhfl-full.yaml")
}

SCRIPT = """
import hashlib, sys
EVAL_TABLES = "@TABLES@"
from pathlib import Path
import torch
from bhfl_core.store.node_store import load_tensors
from flows.experiment import PLAIN_CALLS, run_experiment
from tests.small import small_config

def main():
    out = Path(sys.argv[1])
    print("capability", torch.backends.cpu.get_cpu_capability())
    for config in sys.argv[2:]:
        cfg = small_config("runtime.executor=inprocess", "eval.every=0", f"name={config[:-5]}", config=config)
        run = Path(run_experiment(cfg, out, orchestration=PLAIN_CALLS)["run_path"])
        digest = hashlib.sha256()
        for path in sorted((run / "state" / "nodes").glob("*.safetensors")):
            tensors, _ = load_tensors(path)
            for name in sorted(tensors):
                digest.update(f"{path.name}/{name}".encode() + tensors[name].contiguous().numpy().tobytes())
        print(config, digest.hexdigest()[:16])
        for table in EVAL_TABLES:
            text = (run / "report" / "eval" / f"{table}.csv").read_bytes()
            print(f"{config}:{table}", hashlib.sha256(text).hexdigest()[:16])

if __name__ == "__main__":
    main()
""".replace('"@TABLES@"', repr(EVAL_TABLES))


def test_default_rule_and_data_path_leave_every_model_bit_identical(tmp_path):
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        pytest.skip("the reference hashes were measured with x86 AVX kernels")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), *BEFORE["AVX2"]],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    capability = lines.pop("capability")
    tables = {key: lines.pop(key) for key in list(lines) if ":" in key}
    assert lines == BEFORE[capability]
    if capability == "AVX2":  # (measured with AVX2 kernels only)
        assert tables == {f"{c}:{t}": h for c, hashes in EVAL_BEFORE.items() for t, h in hashes.items()}
