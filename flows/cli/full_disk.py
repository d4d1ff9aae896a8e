"""Which filesystem filled up under a command, from the error it ended with and the places a run writes.

A disk fills under a run wherever the run writes: a checkpoint (ENOSPC from Python or
from safetensors' Rust code, which words it "No space left on device (os error 28)"),
the MLflow store ("database or disk is full" from SQLite), Prefect's database, or a
worker's file. The first two say so somewhere in the chain of exceptions. Prefect's
server does not: its client only gets "500 Internal Server Error", so a server error
counts as a full disk when the filesystem of Prefect's database (the command's own
server's) has less than ``NEARLY_FULL_BYTES`` left. In every case the user is told
which filesystem it is (its mount point, what it is, what of the run it holds, how
much is free), because "the disk" is ambiguous on a machine where the run folder,
``/dev/shm`` and Prefect's home may be three different ones.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from bhfl_core.store.run_layout import DATA_POINTER
from flows.records.run_record import RECORD_FILE

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# how libraries word it without an errno: Python's and Rust's strerror, Rust's io::Error, SQLite
DISK_FULL_TEXTS = (
    os.strerror(errno.ENOSPC),
    os.strerror(errno.EDQUOT),
    f"os error {errno.ENOSPC}",
    f"os error {errno.EDQUOT}",
    "database or disk is full",
)
NEARLY_FULL_BYTES = 8 << 20  # a server error with less than this left where Prefect's database lives: full


@dataclass(frozen=True)
class Filesystem:
    """A mounted filesystem as ``df`` shows it, and which of the run's places are on it."""

    mount: str
    source: str
    fstype: str
    size: int
    free: int  # bytes an unprivileged writer may still use (``df``'s Avail)
    holds: tuple[str, ...]

    def describe(self) -> str:
        """``the filesystem mounted at /data (ext4 /dev/sdb1): 12.0 KiB free of 40.0 GiB``."""
        return (
            f"the filesystem mounted at {self.mount} ({self.fstype} {self.source}): "
            f"{_size(self.free)} free of {_size(self.size)}"
        )


def chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception it was raised from or during, the members of exception groups included."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo.extend(e for e in (current.__cause__, current.__context__) if e is not None)
        if isinstance(current, BaseExceptionGroup):
            todo.extend(current.exceptions)


def says_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or one in its chain) says a disk or a quota is full."""
    for e in chain(exc):
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return True
        if any(text in str(e) for text in DISK_FULL_TEXTS):
            return True
    return False


def _server_error(exc: BaseException) -> bool:
    """Whether an HTTP answer 5xx is in the chain (httpx's and Prefect's status errors carry the response)."""
    return any(getattr(getattr(e, "response", None), "status_code", 0) >= 500 for e in chain(exc))


def _named_file(exc: BaseException) -> str | None:
    """The file the first disk-full ``OSError`` in the chain names, if any."""
    for e in chain(exc):
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS and e.filename:
            return str(e.filename)
    return None


def run_places(run_path: Path | None, environ: Mapping[str, str]) -> dict[str, Path]:
    """Where a command writes, by what it is: the run folder, its data cache and MLflow store (from the run's
    files), Prefect's database (the command's own server's), models in transfer (``/dev/shm``), temporary files."""
    from flows.services.prefect_server import OWN_DATABASE_ENV

    places: dict[str, Path] = {}
    if run_path is not None:
        places["the run folder"] = run_path
        pointer = _json(run_path / DATA_POINTER)
        if pointer.get("data_root"):
            places["the data cache"] = Path(str(pointer["data_root"]))
        uri = str(_json(run_path / RECORD_FILE).get("tracking_uri", ""))
        if uri.startswith("sqlite:///"):
            places["the MLflow store"] = Path(uri.removeprefix("sqlite:///"))
    if environ.get(OWN_DATABASE_ENV):  # the command's own Prefect server's
        places["Prefect's database"] = Path(environ[OWN_DATABASE_ENV])
    if Path("/dev/shm").is_dir():
        places["models in transfer (/dev/shm)"] = Path("/dev/shm")
    places["temporary files"] = Path(tempfile.gettempdir())
    return places


def full_filesystem(exc: BaseException, run_path: Path | None) -> Filesystem | None:
    """The filesystem that filled up if ``exc`` comes from a full disk (module docstring), else None."""
    places = run_places(run_path, os.environ)
    if says_disk_full(exc):
        named = _named_file(exc)
        filesystems = _filesystems({**({"the file it was writing": Path(named)} if named else {}), **places})
        writing = [fs for fs in filesystems if "the file it was writing" in fs.holds]
        return writing[0] if writing else min(filesystems, key=lambda fs: fs.free, default=None)
    database = places.get("Prefect's database")
    if database is None or not _server_error(exc):
        return None
    prefect = [fs for fs in _filesystems(places) if "Prefect's database" in fs.holds]
    return prefect[0] if prefect and prefect[0].free < NEARLY_FULL_BYTES else None


def _filesystems(places: Mapping[str, Path]) -> list[Filesystem]:
    """The filesystems under ``places`` (a place that does not exist yet: its nearest existing folder's)."""
    found: dict[int, tuple[str, os.statvfs_result, list[str]]] = {}
    for what, path in places.items():
        existing = _existing(path)
        if existing is None:
            continue
        device = os.stat(existing).st_dev
        if device not in found:
            found[device] = (_mount_point(existing), os.statvfs(existing), [])
        found[device][2].append(what)
    mounts = _mounts()
    return [
        Filesystem(
            mount,
            *mounts.get(mount, ("?", "?")),
            size=st.f_blocks * st.f_frsize,
            free=st.f_bavail * st.f_frsize,
            holds=tuple(holds),
        )
        for mount, st, holds in found.values()
    ]


def _existing(path: Path) -> Path | None:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return None


def _mount_point(path: Path) -> str:
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return str(path)


def _mounts() -> dict[str, tuple[str, str]]:
    """Mount point -> (source, type), from ``/proc/self/mounts`` (the last mount on a point is the one seen)."""
    try:
        lines = Path("/proc/self/mounts").read_text(encoding="utf-8").splitlines()
    except OSError:
        return {}
    mounts = {}
    for line in lines:
        fields = line.split()
        if len(fields) >= 3:
            unescape = fields[1].encode().decode("unicode_escape")  # "\040" for a space
            mounts[unescape] = (fields[0], fields[2])
    return mounts


def _json(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _size(n: int) -> str:
    """Bytes as ``df -h`` counts them (powers of 1024)."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} bytes"
