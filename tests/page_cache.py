"""Which pages of a file are in the page cache (Linux's mincore(2)), for the tests of client states at scale."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from pathlib import Path

PAGE = mmap.PAGESIZE


def resident(path: Path) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages of the file): mincore(2) on a fresh shared mapping of it.

    For a file mapping, mincore reports the file's pages in the page cache, whoever read
    them: the mapping itself touches none.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = (size + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed", str(path))
        try:
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed", str(path))
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec), pages


def why_pages_stay(folder: Path) -> str | None:
    """Why a test cannot see pages dropped in ``folder`` (not Linux; tmpfs-like: files live in the cache); else None.

    Probed, not guessed from the mount table: a file written, fsync'ed and dropped with
    POSIX_FADV_DONTNEED directly, without the code under test.
    """
    if not sys.platform.startswith("linux"):
        return "page residency is read with Linux's mincore(2) and dropped with posix_fadvise"
    probe = folder / ".page-cache-probe"
    with open(probe, "wb") as fh:
        fh.write(os.urandom(64 * PAGE))
        fh.flush()
        os.fsync(fh.fileno())
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    kept, pages = resident(probe)
    probe.unlink()
    if kept == pages:
        return (
            f"the filesystem of {folder} keeps a file's pages after POSIX_FADV_DONTNEED (tmpfs and ramfs: their "
            "files live in the page cache), so there is nothing to drop"
        )
    return None


def read_all(path: Path) -> None:
    """Bring every page of ``path`` into the page cache (a plain read)."""
    with open(path, "rb") as fh:
        while fh.read(1 << 20):
            pass
