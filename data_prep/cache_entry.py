"""A data-cache entry appears complete or not at all, even when the disk fills up or the process dies.

``<cache>/<fingerprint>/`` is the entry; a later preparation reuses it when its
``manifest.json`` exists (data_prep/prepare.py). Why that is never a half-written
entry:

- **Built elsewhere, committed by one rename.** The entry is built in
  ``.<fingerprint>.partial`` next to it; only when every step has finished are its
  files and folders fsync'ed and the folder renamed to ``<fingerprint>`` (rename(2)
  is atomic), then the cache folder is fsync'ed so the new name survives a power
  cut. Before the rename nothing exists under the final name, so a reader finds
  the complete entry or no entry.
- **A failure removes the partial folder.** Any exception (ENOSPC from Python, from
  pyarrow or from the tokenizers library in Rust; Ctrl-C) deletes
  ``.<fingerprint>.partial``, which also gives the space back. A process killed
  outright (SIGKILL, power cut) leaves it behind; the next preparation of the same
  fingerprint deletes it before it starts.
- **One preparation of an entry at a time.** The build holds an exclusive lock on
  ``.<fingerprint>.lock`` (``flock``: released by the kernel when the holder dies;
  the file is deleted when the lock is released), so two experiments of a sweep
  that share their data, or two processes sharing the run folder, never write into
  the same partial folder (or delete it as a leftover); the second waits, then finds
  the entry the first made.

A disk-full failure reaches the user as one ``OSError(ENOSPC)`` naming the entry
(flows/cli/errors.py words it): the libraries' own errors name a temporary file, or
nothing (the tokenizers library raises a bare ``Exception``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says the disk or a quota is full."""
    texts = tuple(os.strerror(code) for code in DISK_FULL)  # how Rust's io::Error and pyarrow word it
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_FULL:
            return True
        if any(text in str(current) for text in texts):
            return True
        current = current.__cause__ or current.__context__
    return False


@contextmanager
def disk_full_named(entry: Path) -> Iterator[None]:
    """Re-raise a disk-full failure inside the block as ``OSError(ENOSPC)`` naming ``entry``."""
    try:
        yield
    except Exception as exc:
        if is_disk_full(exc):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(entry)) from exc
        raise


@contextmanager
def locked(entry: Path, on_wait: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Hold ``entry``'s lock, ``.<name>.lock`` beside it; ``on_wait`` is called once if someone else holds it.

    The holder deletes the lock file before it unlocks, so none is left behind; a
    waiter that then gets the lock of a deleted file opens the new one and waits again.
    """
    path = entry.with_name(f".{entry.name}.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    waited = False
    while True:
        handle = open(path, "a+b")  # noqa: SIM115 (held open for the lock's lifetime)
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not waited:
                    on_wait()
                    waited = True
                fcntl.flock(handle, fcntl.LOCK_EX)
            if _same_file(path, handle.fileno()):
                break
        except BaseException:
            handle.close()
            raise
        handle.close()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        handle.close()  # closing the last descriptor releases the lock


def _same_file(path: Path, fd: int) -> bool:
    try:
        here = path.stat()
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """Every file and folder under ``folder`` on disk (the rename that follows commits them)."""
    for parent, _, files in os.walk(folder):
        for name in files:
            _fsync(Path(parent, name))
        _fsync(Path(parent))


@contextmanager
def building(entry: Path) -> Iterator[Path]:
    """Yield an empty folder to build ``entry`` in; when the block ends normally it becomes ``entry``.

    Call it holding ``locked(entry)``. On any exception the folder is removed and the
    exception propagates; ``entry`` is never touched then.
    """
    work = entry.with_name(f".{entry.name}.partial")
    shutil.rmtree(work, ignore_errors=True)  # left by a preparation that was killed
    try:
        work.mkdir(parents=True)
        yield work
        _fsync_tree(work)
        shutil.rmtree(entry, ignore_errors=True)  # a folder without a manifest is not an entry (cached_data)
        work.rename(entry)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    _fsync(entry.parent)
