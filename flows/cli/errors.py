"""One paragraph per failure a user can act on: what went wrong, what to do, how to go on; and its exit code.

Config and data mistakes, damaged checkpoints, out-of-memory and disk-full errors
reach the user as a message naming the cause and the fix, not as a stack trace. An
error not listed here is a bug: the CLI shows its traceback. Exit codes: 2 for what
is wrong before any work (config, data that cannot be loaded or partitioned as
configured, a cluster that cannot serve the run), ``EXIT_DISK_FULL`` for a full disk,
1 for the rest (docs/cli.md, "Exit codes").
"""

from __future__ import annotations

import sys
from pathlib import Path

from bhfl_core.config.base import ConfigError, SettingError
from bhfl_core.store.state_header import CheckpointError
from data_prep.partition import PartitionError
from flows.cli.full_disk import full_filesystem
from flows.records.run_state import RunStateError

EXIT_DISK_FULL = 74  # EX_IOERR (sysexits.h): free space, then `bhfl resume` (docs/runtime.md, "Faults")


def resume_hint(run_path: Path | None) -> str:
    if run_path is not None and (run_path / "pipeline.json").exists():
        return (
            f"Finished stages and everything finished in the interrupted stage are kept; once it is fixed, "
            f"continue with `bhfl resume {run_path}` (finished stages, nodes and rounds are not run again)."
        )
    if run_path is None or not (run_path / "config.yaml").exists():
        return "Nothing was trained yet; run the command again once it is fixed."
    return (
        f"Everything finished so far is kept; once it is fixed, continue with "
        f"`bhfl resume {run_path}` (finished nodes and rounds are not run again)."
    )


def explain(exc: BaseException, run_path: Path | None) -> str | None:
    """The user-facing paragraph for ``exc``, or None if it is not a known kind of failure."""
    if isinstance(exc, RunStateError):
        return str(exc)
    if isinstance(exc, SettingError):  # the run's own config is at fault: a resume would meet it again
        return (
            f"{exc}. A run keeps its config (a resume changes only runtime.* and eval.batch_size): start a new run "
            "with the key fixed."
        )
    if isinstance(exc, ConfigError):  # found while running: a dataset or model that cannot be loaded
        return f"{exc} {resume_hint(run_path)}"
    if isinstance(exc, PartitionError):
        return f"The data cannot be partitioned as configured: {exc}. {resume_hint(run_path)}"
    if isinstance(exc, CheckpointError):
        return str(exc)
    # looked up, not imported: a command that never loaded torch (~1.5 s) or the executor cannot have failed in it
    executor = sys.modules.get("tasks.executor")
    if executor is not None and isinstance(exc, executor.WorkersLostError):  # a worker gone, or killed by a call
        return f"{exc} {resume_hint(run_path)}"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, torch.OutOfMemoryError):
        return (
            f"Out of GPU memory ({str(exc).splitlines()[0]}). Fewer workers per GPU or a smaller evaluation "
            f"batch keep the results unchanged: resume with `--set runtime.workers=1` or `--set eval.batch_size=64`. "
            f"A smaller `train.batch_size` or `model.max_length` changes the experiment: start a new run with it. "
            f"{resume_hint(run_path)}"
        )
    cluster = sys.modules.get("tasks.cluster_access")
    if cluster is not None and isinstance(exc, cluster.SharedFolderError):  # workers that do not see the run
        return f"{exc} {resume_hint(run_path)}"
    return _disk_full(exc, run_path)


def _disk_full(exc: BaseException, run_path: Path | None) -> str | None:
    """The paragraph for a full disk anywhere the command writes (flows/cli/full_disk.py), else None."""
    full = full_filesystem(exc, run_path)
    if full is None:
        return None
    named = next((e.filename for e in (exc, exc.__cause__) if isinstance(e, OSError) and e.filename), None)
    where = f" while writing {named}" if named else ""
    holds = [h for h in full.holds if h != "the file it was writing"]
    held = f"; it holds {_listed(holds)}" if holds else ""
    return (
        f"The disk is full{where}: {full.describe()}{held}. Files a resume reads (checkpoints, run records, the data "
        f"cache) are written under temporary names and renamed when complete, and Prefect's and MLflow's databases "
        f"undo a write that fails, so the last complete checkpoint of every node is intact and no half-written "
        f"data is ever reused. Free some space there (`df -h {full.mount}`; the data cache (<run-dir>/cache, or "
        f"$BHFL_DATA_CACHE) and old runs can be deleted). {resume_hint(run_path)}"
    )


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def exit_code(exc: BaseException, run_path: Path | None) -> int:
    """The exit code of a command that ended with ``exc`` (explained: the module docstring)."""
    cluster = sys.modules.get("tasks.cluster_access")
    if isinstance(exc, (ConfigError, PartitionError)) or (
        cluster is not None and isinstance(exc, cluster.SharedFolderError)
    ):
        return 2
    if full_filesystem(exc, run_path) is not None:
        return EXIT_DISK_FULL
    return 1
