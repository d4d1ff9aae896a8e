"""Files written so that a crash never leaves half of one: temporary name, fsync, then rename.

``atomic_path`` is the one primitive: every file of a run that a reader (or a resumed
run after a kill) may open while it is being rewritten goes through it: checkpoints
(``node_store.atomic_save``), run records and configs (``write_text_atomic``), report
files and figures, SQLite store templates. Its temporary files are hidden siblings
named ``.<name>.<random>.tmp``, so ``StateStore.remove_partial_writes`` (``**/.*.tmp``)
finds what a killed process left behind.

A file that nobody will read soon (a client's state: read once per participation,
written once) can leave the page cache once it is durable (``drop_cache``): after the
fsync its pages are clean, and ``drop_cached`` asks the kernel to let them go.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

BeforeReplace = Callable[[Path], None]
"""Called with the temporary file after it is written and fsync'ed, before the rename."""


def _reserve_temp(path: Path) -> Path:
    """Create an empty hidden sibling ``.<name>.<random>.tmp`` (exclusive, so never someone else's)."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return tmp
        except FileExistsError:
            continue


def _fsync(path: Path, drop_cache: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if drop_cache:
            _drop(fd)  # clean now: the kernel can let its pages go at once
    finally:
        os.close(fd)


def _drop(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):  # (not on macOS: the pages stay until the kernel needs them)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def drop_cached(path: str | Path) -> None:
    """Ask the kernel to drop ``path``'s pages from the page cache (a file read or written, not needed soon).

    Only clean pages that no process maps are dropped: call it once the file is
    durable (``atomic_path`` does, after its fsync) and after what was read from it is
    no longer mapped; pages still mapped stay, and dropping a page that is read again
    later only costs reading it from disk. A filesystem that holds its files in memory
    (tmpfs) keeps them. A file that is gone is left alone.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        _drop(fd)
    finally:
        os.close(fd)


def _link_into_place(tmp: Path, path: Path) -> None:
    """Put ``tmp`` at ``path`` unless ``path`` exists; FileExistsError if it does."""
    try:
        os.link(tmp, path)  # atomic and never replaces: fails when path was created meanwhile
    except FileExistsError:
        raise
    except OSError:  # a filesystem without hard links: the narrow race of check-then-rename
        if path.exists():
            raise FileExistsError(errno.EEXIST, "file exists", str(path)) from None
        os.replace(tmp, path)


@contextmanager
def atomic_path(
    path: str | Path,
    *,
    before_replace: BeforeReplace | None = None,
    overwrite: bool = True,
    drop_cache: bool = False,
) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write; on success it becomes ``path`` in one step.

    The block writes the yielded (already created, empty) file by name. When it ends
    normally, the file is fsync'ed, ``before_replace(tmp)`` runs (if given), and the file
    is renamed onto ``path``: readers see the old file or the new one, never a mix. Any
    exception (``BaseException``, so also KeyboardInterrupt), in the block, the hook or
    the rename, removes the temporary file and propagates. ``path``'s folder is created.

    ``overwrite=False`` never replaces a file: the new one is hard-linked into place, and
    FileExistsError is raised (temporary file removed) when ``path`` exists, even if it
    appeared while the block ran.

    ``drop_cache``: once fsync'ed, the file's pages are dropped from the page cache
    (``drop_cached``), for a file that will not be read soon.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _reserve_temp(path)
    try:
        yield tmp
        _fsync(tmp, drop_cache)
        if before_replace is not None:
            before_replace(tmp)
        if overwrite:
            os.replace(tmp, path)
        else:
            _link_into_place(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if not overwrite:
        tmp.unlink(missing_ok=True)  # path is the other name of the same file now


def write_text_atomic(path: Path, text: str) -> None:
    """Readers (and a resumed run after a kill) see the old content or the new one, never a mix."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
