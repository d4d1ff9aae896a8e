"""The allocator settings that let a worker's heap shrink again (tasks/heap.py): applied, unless the user chose."""

import ctypes.util
import platform

import pytest

from tasks.heap import USER_SETTINGS, give_back_freed_memory, release_garbage


@pytest.fixture
def unset(monkeypatch):
    """The malloc variables unset, and whatever a test sets in os.environ (limit_malloc_arenas) undone after it."""
    for setting in USER_SETTINGS:
        monkeypatch.setenv(setting, "")  # recorded, so that the deletion is undone, or a later set removed
        monkeypatch.delenv(setting)
    return monkeypatch


def _glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc" and bool(ctypes.util.find_library("c"))


@pytest.mark.parametrize("setting", USER_SETTINGS)
def test_a_users_own_malloc_setting_is_left_alone_and_the_other_applied(unset, setting):
    unset.setenv(setting, "4")
    if not _glibc():
        pytest.skip("mallopt is glibc's")
    assert give_back_freed_memory() == tuple(s for s in USER_SETTINGS if s != setting)


def test_glibc_takes_the_settings(unset):
    if not _glibc():
        pytest.skip("mallopt is glibc's")
    assert give_back_freed_memory() == USER_SETTINGS


def test_a_worker_of_the_command_still_trims_its_heap(unset):
    """The command's MALLOC_ARENA_MAX, inherited by its workers, is not a user's setting of the trim threshold
    (it was taken for one: the workers kept glibc's threshold and their heaps grew)."""
    from flows.cli.shell import limit_malloc_arenas

    if not _glibc():
        pytest.skip("mallopt is glibc's")
    limit_malloc_arenas()  # the command, before it starts its workers
    assert "MALLOC_TRIM_THRESHOLD_" in give_back_freed_memory()  # a worker's warm-up


class _Node:
    """An object in a reference cycle: only a full collection frees it."""


def test_release_garbage_frees_cycles_and_trims_the_heap():
    import weakref

    node = _Node()
    node.me = node  # a cycle, as a kept traceback's frames are
    alive = weakref.ref(node)
    del node
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert release_garbage() is glibc
    assert alive() is None
