"""`bhfl run` on disks that fill up mid-training (tests/flows/test_disk_full_run.py runs this on small tmpfs).

``python -m tests.flows.full_disk_run OUTSIDE DISK...``: each ``DISK`` is the mount
point of an empty tmpfs of its own; ``OUTSIDE`` a folder on an ordinary disk. For each
case, a ``bhfl run`` of the small experiment (tests/small.py) is held after a server
round (``BHFL_FAULTS``'s pause: a SIGSTOP of the command), its disk filled to the last
byte, and let go; then the filler is deleted and ``bhfl resume`` finishes the run. The
cases put on the full disk:

- ``everything``: the run directory (run folder, data cache, MLflow store, Prefect's
  database), as a user's one disk;
- ``prefect``: Prefect's database alone (``PREFECT_HOME``);
- ``run folder``: the run folder and data cache alone, models in transfer in it too
  (``runtime.transfer: run_folder``), MLflow's and Prefect's stores elsewhere.

Prints one JSON object: for each case the command's exit code and output, the run
folder, the resume's exit code, the sha256 of every node file after it, and the
temporary files left in the run folder's state.
"""

import errno
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import psutil

from tests.flows.commands import own_servers_env, sets, start, wait_for

PAUSE = "round@2:pause"  # the second server round committed (root round 1): held there while its disk fills


def _fill(disk: Path) -> Path:
    """Write zeros to ``disk`` until the kernel says it is full; a disk the held run already filled (it happened on
    a 40 MB tmpfs: the disks are 96 MB now) cannot even make the file, which is full too."""
    filler = disk / "filler"
    try:
        with open(filler, "wb") as fh:
            while True:
                fh.write(b"\0" * (1 << 16))
                fh.flush()
    except OSError as error:
        if error.errno != errno.ENOSPC:
            raise
    return filler


def _ended(args: list[str], env: dict[str, str], log: Path) -> int:
    proc = start(args, env, log)
    try:
        return proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _case(disk: Path, outside: Path, where: str) -> dict:
    """One case (module docstring): run, held, filled, let go; freed; resumed."""
    run_dir, extra, env = disk / "runs", [], {}
    if where == "prefect":
        run_dir, env = outside / "prefect-case", {"PREFECT_HOME": str(disk / "prefect")}
    elif where == "run folder":
        env = {"PREFECT_HOME": str(outside / "run-folder-case" / "prefect")}
        extra = ["--tracking-uri", f"sqlite:///{outside / 'run-folder-case' / 'mlflow.db'}"]
        extra += ["--set", "runtime.transfer=run_folder"]
    log = outside / f"{where.replace(' ', '-')}.log"
    proc = start(["run", *sets(), *extra, "--run-dir", str(run_dir)], own_servers_env(BHFL_FAULTS=PAUSE, **env), log)
    try:
        wait_for("the pause", lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED, proc, log, 400)
        filler = _fill(disk)
        proc.send_signal(signal.SIGCONT)
        code = proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    (run_path,) = (run_dir / "itest").iterdir()
    filler.unlink(missing_ok=True)
    resumed = _ended(["resume", str(run_path), "--run-dir", str(run_dir)], own_servers_env(**env), outside / "r.log")
    nodes = sorted((run_path / "state" / "nodes").glob("*.safetensors"))
    return {
        "code": code,
        "output": log.read_text(),
        "run_path": str(run_path),
        "resumed": resumed,
        "resume_output": (outside / "r.log").read_text()[-3000:],
        "nodes": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in nodes},
        "temporary": [str(p) for p in (run_path / "state").glob("**/.*.tmp")],
    }


def main(outside: Path, disks: list[Path]) -> dict:
    cases = ("everything", "prefect", "run folder")
    return {where: _case(disk, outside, where) for where, disk in zip(cases, disks, strict=True)}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), [Path(a) for a in sys.argv[2:]])))
