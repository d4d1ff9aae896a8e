"""Data preparation on a disk that fills up (tests/data/test_disk_full.py runs this on a small tmpfs).

``python -m tests.data.full_disk DISK``: ``DISK`` is the mount point of an empty tmpfs
of its own (a real filesystem: its writes fail with ENOSPC when it is full). Prints
one JSON object:

- ``failures``: for each amount of free space, what preparing tests/small.py's config
  into ``DISK/cache`` raised (type, errno, file named, the exception it came from,
  the CLI's paragraph for it) and what the cache folder held afterwards;
- ``after``: whether a preparation with space then succeeded, was not a cache hit,
  gave the same bytes as one on an empty disk, and was a hit the next time.
"""

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from data_prep.prepare import prepare_data
from flows.cli.errors import explain
from tests.small import small_config

PAGE = 4096  # tmpfs charges whole pages


def _pages(path: Path) -> int:
    return -(-path.stat().st_size // PAGE)


def _hashes(root: Path) -> dict[str, str]:
    files = (p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _leave_free(disk: Path, pages: int) -> Path:
    """Fill ``disk`` until ``pages`` pages are free."""
    st = os.statvfs(disk)
    filler = disk / "filler"
    with open(filler, "wb") as fh:
        fh.write(b"\0" * ((st.f_bavail * st.f_frsize // PAGE - pages) * PAGE))
    return filler


def main(disk: Path) -> dict:
    cfg = small_config()
    log = lambda _: None  # noqa: E731
    probe = prepare_data(cfg, disk / "probe", log=log)
    expected = _hashes(probe.root)
    files = {p.relative_to(probe.root): _pages(p) for p in probe.root.rglob("*") if p.is_file()}
    tokenizer = sum(n for p, n in files.items() if p.parts[0] == "tokenizer")
    total = sum(files.values())
    shutil.rmtree(disk / "probe")
    free = {
        "tokenizer.json half written": tokenizer - files[Path("tokenizer/tokenizer.json")] // 2,
        "half of the entry written": total // 2,
        "all but one page written": total - 1,
    }
    failures = {}
    for what, pages in free.items():
        filler = _leave_free(disk, pages)
        try:
            prepare_data(cfg, disk / "cache", log=log)
            failures[what] = None
        except Exception as exc:
            cause = exc.__cause__
            failures[what] = {
                "type": type(exc).__name__,
                "errno": getattr(exc, "errno", None),
                "filename": getattr(exc, "filename", None),
                "cause": f"{type(cause).__module__}.{type(cause).__name__}: {cause}" if cause else None,
                "message": explain(exc, None),
                "left": sorted(os.listdir(disk / "cache")) if (disk / "cache").exists() else [],
            }
        filler.unlink()
    again = prepare_data(cfg, disk / "cache", log=log)
    return {
        "entry": str(disk / "cache" / probe.root.name),
        "failures": failures,
        "after": {
            "cached": again.cached,
            "same_bytes": _hashes(again.root) == expected,
            "hit_next": prepare_data(cfg, disk / "cache", log=log).cached,
        },
    }


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
