"""What a run folder takes on disk, and that per client: a run-level figure (``runtime/run_folder_bytes*``).

A persistent population keeps one state file per client (docs/runtime.md, "Client
states at scale"), so a run folder grows with its population: 10,000 clients of the
tiny model keep ~9 GB, of BERT-base ~4.4 TB. The figure is the folder's allocated size
as ``du -s -B1`` counts it (blocks of every file and folder under it, a file with
several names once, links not followed), found by one walk: one stat per entry.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

RUN_FOLDER_BYTES = "runtime/run_folder_bytes"
RUN_FOLDER_BYTES_PER_CLIENT = "runtime/run_folder_bytes_per_client"


def disk_bytes(path: Path) -> int:
    """Bytes allocated on disk to ``path`` and everything under it (``du -s -B1``'s figure); 0 if it is gone.

    Entries removed during the walk (a temporary file renamed or deleted meanwhile) are
    left out.
    """
    seen: set[tuple[int, int]] = set()

    def size(st: os.stat_result) -> int:
        if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):  # counted once, as du does
            if (st.st_dev, st.st_ino) in seen:
                return 0
            seen.add((st.st_dev, st.st_ino))
        return st.st_blocks * 512

    try:
        total = size(os.lstat(path))
    except FileNotFoundError:
        return 0
    folders = [path]
    while folders:
        try:
            entries = os.scandir(folders.pop())
        except (FileNotFoundError, NotADirectoryError):
            continue
        with entries:
            for entry in entries:
                try:
                    total += size(entry.stat(follow_symlinks=False))
                    if entry.is_dir(follow_symlinks=False):
                        folders.append(Path(entry.path))
                except FileNotFoundError:
                    continue
    return total


def run_folder_figures(run_path: Path, clients: int) -> dict[str, float]:
    """The run folder's bytes on disk, and those per client of the population (``clients``)."""
    total = disk_bytes(run_path)
    return {RUN_FOLDER_BYTES: float(total), RUN_FOLDER_BYTES_PER_CLIENT: total / max(clients, 1)}
