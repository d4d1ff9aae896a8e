"""A run folder's tracking calls on their way to a remote MLflow server: one file per call, in order.

Why: a tracking server may be down for a minute or for good while a run trains, and the
process may be killed meanwhile. Every call the Tracker makes to a remote server is
written here first (``<run>/tracking/pending/<seq>.json``, atomically: a temporary file
renamed into place, after the files it uploads are in their folder) and delivered from
here in sequence order (flows/tracking/delivery.py), so a call outlives both the server's
absence and the process, and `bhfl sync` / `bhfl resume` deliver what is left.

A call the server refuses for good (a 4xx answer: not a network fault) moves to
``rejected/`` with the server's answer beside it, so one bad call cannot block the rest.
Before a call is sent a ``.tried`` marker is created: a call found with its marker was
sent once already and may have reached the server (the connection died before the
answer, or the process before the file was removed), so delivery checks first (delivery.py).
Several Tracker instances of one run (a node execution builds its own) share the folder:
a file lock orders the sequence numbers and serialises delivery.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from bhfl_core.store.atomic import write_text_atomic

TRACKING_DIR = "tracking"  # in the run folder: the spool (pending/, rejected/) and the journal (journal.py)
PENDING_DIR, REJECTED_DIR = "pending", "rejected"
Call = dict[str, Any]  # {"op": ..., its arguments}: JSON, see delivery.send
Stage = Callable[[Path], object]  # writes a call's files (artefacts to upload) into the folder it is given


@dataclass(frozen=True)
class Entry:
    """One pending call: its file, its place in the sequence and what it says."""

    path: Path
    seq: int
    call: Call

    @property
    def files(self) -> Path:
        """The folder of files the call uploads (artefacts), kept until it is delivered."""
        return self.path.with_suffix(".files")

    @property
    def marker(self) -> Path:
        return self.path.with_suffix(".tried")

    @property
    def tried(self) -> bool:
        """Whether it was sent before (and may have reached the server)."""
        return self.marker.exists()


class Spool:
    """The pending calls of one run folder (``<run>/tracking/``)."""

    def __init__(self, run_path: Path) -> None:
        self.folder = Path(run_path) / TRACKING_DIR
        self.pending = self.folder / PENDING_DIR
        self.rejected = self.folder / REJECTED_DIR
        self._lock_file = self.folder / ".spool.lock"
        self._delivery_file = self.folder / ".delivery.lock"
        self._last_seq = self.folder / ".last-seq"  # numbers are never reused, even once the folder is empty

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive use of the folder's sequence (and the journal): any thread or process of the run."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with FileLock(self._lock_file):
            yield

    @contextlib.contextmanager
    def delivering(self) -> Iterator[bool]:
        """The right to deliver (True), or False at once when another thread or process holds it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        lock = FileLock(self._delivery_file, timeout=0)
        try:
            lock.acquire()
        except Timeout:
            yield False
            return
        try:
            yield True
        finally:
            lock.release()

    def add(self, call: Call, stage: Stage | None = None) -> Entry:
        """Append ``call`` (its files first, written by ``stage``); durable when this returns."""
        with self.locked():
            last = int(self._last_seq.read_text(encoding="utf-8") or 0) if self._last_seq.exists() else 0
            seq = max([last, *(e.seq for e in self._listed())]) + 1
            self._last_seq.write_text(str(seq), encoding="utf-8")
            path = self.pending / f"{seq:09d}.json"
            entry = Entry(path, seq, call)
            if stage is not None:
                shutil.rmtree(entry.files, ignore_errors=True)  # a killed attempt's leftover under this number
                staging = entry.files.with_name(f".{entry.files.name}.tmp")
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)
                stage(staging)
                staging.rename(entry.files)
            write_text_atomic(path, json.dumps(call))
            return entry

    def _listed(self) -> list[Entry]:
        if not self.pending.is_dir():
            return []
        found = []
        for path in self.pending.glob("*.json"):
            if path.stem.isdigit():
                found.append(Entry(path, int(path.stem), {}))
        return sorted(found, key=lambda e: e.seq)

    def count(self) -> int:
        return len(self._listed())

    def entries(self) -> Iterator[Entry]:
        """The pending calls, oldest first (each read when reached: calls added meanwhile come too)."""
        done = 0
        while True:
            listed = [e for e in self._listed() if e.seq > done]
            if not listed:
                return
            for entry in listed:
                done = entry.seq
                with contextlib.suppress(FileNotFoundError):  # delivered meanwhile by `bhfl sync`
                    yield Entry(entry.path, entry.seq, json.loads(entry.path.read_text(encoding="utf-8")))

    def mark_tried(self, entry: Entry) -> None:
        """Note that ``entry`` is about to be sent (it may arrive even if no answer does)."""
        entry.marker.touch()

    def done(self, entry: Entry) -> None:
        """Remove a delivered call (the call first: its leftovers alone are never taken for a call)."""
        entry.path.unlink(missing_ok=True)
        entry.marker.unlink(missing_ok=True)
        shutil.rmtree(entry.files, ignore_errors=True)

    def reject(self, entry: Entry, reason: str) -> None:
        """Set aside a call the server refused (kept with its answer in ``rejected/``, not retried)."""
        self.rejected.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.rejected / f"{entry.seq:09d}.json", json.dumps({**entry.call, "refused": reason}))
        if entry.files.exists():
            shutil.move(entry.files, self.rejected / entry.files.name)
        self.done(entry)

    def rejected_count(self) -> int:
        return len(list(self.rejected.glob("*.json"))) if self.rejected.is_dir() else 0

    def remove_partial_writes(self) -> None:
        """Temporary files and staging folders a killed process left (never a complete call)."""
        if not self.pending.is_dir():
            return
        with self.locked():  # (an add in progress has its staging folder and temporary file there)
            self._remove_partial_writes()

    def _remove_partial_writes(self) -> None:
        for leftover in self.pending.glob(".*.tmp"):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
        for files in self.pending.glob("*.files"):
            if not files.with_suffix(".json").exists():
                shutil.rmtree(files, ignore_errors=True)
        for marker in self.pending.glob("*.tried"):
            if not marker.with_suffix(".json").exists():
                marker.unlink(missing_ok=True)


def pending_count(run_path: Path) -> int:
    """How many tracking calls of the run in ``run_path`` wait for delivery (0 when it has no spool)."""
    return Spool(run_path).count()
