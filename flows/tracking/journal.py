"""Every metric point and tag a run folder sends to a remote MLflow server, kept in the run folder.

Why: the report and the run's time figures read metric histories back (communication
per round, time-to-accuracy, evaluation cost). With the tracking server down for good
they must still be written, and written the same whether the server answered or not; so
a run whose tracking goes through a spool (spool.py) appends here everything it sends,
when it sends it (with the time each value was produced), and reads it back from here,
never from the server.

One JSON object per line, appended under a file lock (a run's node executions log from
several threads). A line a kill cut short is skipped, and the next append starts on a
new line. The journal is complete when it begins with the header its run wrote before
creating its MLflow runs; a run begun without one (by an older bhfl) reads from the server.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock
from mlflow.entities import Metric

JOURNAL_FILE = "journal.jsonl"
HEADER = {"bhfl_tracking_journal": 1}


@dataclass
class _Contents:
    points: dict[tuple[str, str], list[Metric]] = field(default_factory=dict)
    tags: dict[str, dict[str, str]] = field(default_factory=dict)


class Journal:
    """The journal in ``folder`` (the run folder's ``tracking/``)."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / JOURNAL_FILE
        self._lock = self.path.with_name(".journal.lock")
        self._cache: tuple[tuple[int, int], _Contents] | None = None

    def begin(self) -> None:
        """Start the journal of a new run (before its MLflow runs exist): from here on it is complete."""
        if not self.path.exists():
            self._append(HEADER)

    @property
    def complete(self) -> bool:
        """Whether it holds everything the run sent (it was begun with the run)."""
        if not self.path.exists():
            return False
        with open(self.path, "rb") as fh:
            first = fh.readline()
        try:
            return bool(json.loads(first) == HEADER)
        except ValueError:
            return False

    def metrics(self, run_id: str, metrics: Iterable[Metric]) -> None:
        rows = [[m.key, m.value, m.timestamp, m.step] for m in metrics]
        if rows:
            self._append({"run": run_id, "m": rows})

    def tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        if tags:
            self._append({"run": run_id, "t": dict(tags)})

    def points(self, run_id: str, key: str) -> list[Metric]:
        """Every value of ``key`` the run sent to ``run_id``, in the order it sent them."""
        return list(self._read().points.get((run_id, key), []))

    def has(self, run_id: str, point: Metric) -> bool:
        """Whether ``point``'s metric has a value at its step for ``run_id`` (the store's test: ``delivery.logged``)."""
        return any(m.step == point.step for m in self._read().points.get((run_id, point.key), []))

    def run_tags(self, run_id: str) -> dict[str, str]:
        """The tags sent to ``run_id`` (at its creation and since), the last value of each."""
        return dict(self._read().tags.get(run_id, {}))

    def latest(self, run_id: str) -> dict[str, float]:
        """Each metric's latest value as MLflow keeps it: the highest step, then the latest timestamp."""
        out: dict[str, float] = {}
        for (run, key), points in self._read().points.items():
            if run == run_id and points:
                out[key] = max(points, key=lambda m: (m.step, m.timestamp)).value
        return out

    def _append(self, record: Mapping[str, object]) -> None:
        """Append ``record``; a read cache that was current takes it too (a resumed attempt asks ``has`` before
        each batch it appends: re-reading the whole journal each time would grow as batches x journal)."""
        line = (json.dumps(record) + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(self._lock), open(self.path, "a+b") as fh:
            size = fh.tell()
            if size and os.pread(fh.fileno(), 1, size - 1) != b"\n":  # a line cut short by a kill
                line = b"\n" + line
            current = self._cache is not None and self._cache[0] == (size, os.fstat(fh.fileno()).st_mtime_ns)
            fh.write(line)
            fh.flush()
            if self._cache is not None and current:
                _add(self._cache[1], record)
                stat = os.fstat(fh.fileno())
                self._cache = ((stat.st_size, stat.st_mtime_ns), self._cache[1])

    def _read(self) -> _Contents:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return _Contents()
        version = (stat.st_size, stat.st_mtime_ns)
        if self._cache is not None and self._cache[0] == version:
            return self._cache[1]
        contents = _Contents()
        with open(self.path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # cut short by a kill
                _add(contents, record)
        self._cache = (version, contents)
        return contents


def _add(contents: _Contents, record: Mapping[str, Any]) -> None:
    """One journal line's points and tags into ``contents`` (the header line has none)."""
    run = record.get("run")
    if run is None:
        return
    for key, value, timestamp, step in record.get("m", []):
        contents.points.setdefault((run, key), []).append(Metric(key, value, timestamp, step))
    contents.tags.setdefault(run, {}).update(record.get("t", {}))
