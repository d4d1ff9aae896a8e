"""A disk that fills up during training, wherever it is: one paragraph naming it, exit 74, then a bit-identical resume.

The full disks are real: small tmpfs mounted in a private mount namespace
(tests/mount_namespace.py), so every write fails with ENOSPC from the kernel, whichever
process and library makes it: a worker's checkpoint or transfer file, SQLite under
MLflow, Prefect's server (whose client sees only "500 Internal Server Error").
tests/flows/full_disk_run.py runs in there: it holds each run after a server round,
fills its disk, lets it go, frees the disk and resumes it (its docstring lists the
three cases). The node files after each resume must be byte for byte those of a run
that never stopped. (The same fault during data preparation: tests/data/test_disk_full.py.)
"""

import hashlib
import json
import re
import subprocess
import sys

import pytest

from flows.cli.errors import EXIT_DISK_FULL
from tests.flows.kill_chain import uninterrupted
from tests.mount_namespace import NO_NAMESPACE, namespace_prefix, tmpfs_mount
from tests.small import REPO

# own_data_cache: the "run folder" disk holds the data cache too
pytestmark = [pytest.mark.integration, pytest.mark.own_data_cache]

CASES = {  # what the paragraph says the full filesystem holds
    "everything": "it holds the run folder, the data cache, the MLflow store and Prefect's database.",
    "prefect": "it holds Prefect's database.",
    "run folder": "it holds the run folder and the data cache.",
}


@pytest.mark.timeout(1500)  # 3 x (a run held, failed, resumed) + a reference run: ~3 min idle
def test_a_disk_full_mid_run_is_one_paragraph_and_resume_after_freeing_is_bit_identical(tmp_path):
    disks = [tmp_path / f"disk{i}" for i in range(len(CASES))]
    for disk in disks:
        disk.mkdir()
    prefix = namespace_prefix(disks[0])
    if prefix is None:
        pytest.skip(NO_NAMESPACE + "no real full disk to test on")
    mount = tmpfs_mount("96m").replace('"$1"', '"$d"')
    run = 'exec "$p" -m tests.flows.full_disk_run "$o" "$@"'
    script = f'o=$1; p=$2; shift 2; for d in "$@"; do {mount} || exit 9; done; {run}'
    outside = tmp_path / "outside"
    outside.mkdir()
    done = subprocess.run(
        [*prefix, "sh", "-c", script, "sh", str(outside), sys.executable, *map(str, disks)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1400,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    cases = json.loads(done.stdout)
    reference = {name: hashlib.sha256(data).hexdigest() for name, data in uninterrupted(tmp_path / "ref").items()}
    for (where, holds), disk in zip(CASES.items(), disks, strict=True):
        case = cases[where]
        output, run_path = case["output"], case["run_path"]
        assert case["code"] == EXIT_DISK_FULL, f"{where}: exit {case['code']}\n{output[-3000:]}"
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in output, f"{where}:\n{output[-3000:]}"
        (message,) = errors
        assert message.startswith("error: The disk is full"), message
        # (what the failed write had taken is free again: a reserved transfer file, a database's journal)
        named = f"the filesystem mounted at {disk} (tmpfs bhfl-full-disk): "
        assert re.search(re.escape(named) + r"[\d.]+ (bytes|KiB) free of 96.0 MiB", message), message
        assert holds in message and f"continue with `bhfl resume {run_path}`" in message, message
        assert case["resumed"] == 0, f"{where}: the resume failed\n{case['resume_output']}"
        assert case["nodes"] == reference, f"{where}: the resumed run differs from one that never stopped"
        assert case["temporary"] == [], f"{where}: half-written files left: {case['temporary']}"
