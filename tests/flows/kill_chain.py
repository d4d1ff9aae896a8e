"""Running `bhfl` the way a user does, killing it, and checking what a kill leaves (the kill-chain tests)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
from prefect.settings import PREFECT_API_URL

from tests.small import REPO

KILLED = -9  # returncode of a process killed by SIGKILL
# the B-HFL example (configs/bhfl-full.yaml) on top of tests/small.py: long enough to be killed at every kind of point
EXAMPLE = ["tree.root.rounds=3", "tree.edge.rounds=2", "eval.every=1"]


def cli(*args: str, faults: str | None, run_dir: Path) -> tuple[subprocess.CompletedProcess, int]:
    """Run the CLI in a session of its own; returns its result and its session id (its pid)."""
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "HF_HUB_OFFLINE": "1"}
    env.pop("BHFL_FAULTS", None)
    if faults:
        env["BHFL_FAULTS"] = faults
    cmd = [sys.executable, "-m", "flows.cli.app", *args, "--run-dir", str(run_dir)]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), proc.pid


def killed_and_resumed(overrides: list[str], run_dir: Path, point: str = "round@4:kill", name: str = "itest") -> Path:
    """`bhfl run` of the embedded config with ``overrides``, SIGKILLed at ``point``, then `bhfl resume`d; its folder."""
    sets = [a for s in overrides for a in ("--set", s)]
    killed, _ = cli("run", "configs/embedded.yaml", *sets, faults=point, run_dir=run_dir)
    assert killed.returncode == KILLED, killed.stderr[-3000:]
    (run_path,) = (run_dir / name).iterdir()
    finished, _ = cli("resume", str(run_path), faults=None, run_dir=run_dir)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return run_path


def leftovers(session: int, grace_s: float = 15.0) -> list[str]:
    """Processes of the killed CLI's session (its workers, forkserver, ...) still alive after it died."""
    deadline = time.time() + grace_s
    while True:
        alive = []
        for proc in psutil.process_iter(["pid", "name", "status"]):
            try:
                if os.getsid(proc.pid) == session and proc.info["status"] != psutil.STATUS_ZOMBIE:
                    alive.append(f"{proc.pid} {proc.info['name']}")
            except (ProcessLookupError, PermissionError):
                continue
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.5)


def uninterrupted(run_dir: Path) -> dict[str, bytes]:
    """The node files of a run of the small experiment (tests/small.py) that never stopped: in one process,
    without Prefect (what a stopped and resumed run must end with, byte for byte)."""
    from flows.experiment import PLAIN_CALLS, run_experiment
    from tests.small import small_config

    result = run_experiment(small_config("runtime.executor=inprocess"), run_dir, orchestration=PLAIN_CALLS)
    return node_files(Path(result["run_path"]))


def node_files(run_path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run_path / "state" / "nodes").glob("*.safetensors"))}
