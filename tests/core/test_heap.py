"""The allocator settings that let a worker's heap shrink again (tasks/heap.py): applied, unless the user chose."""

import ctypes.util
import gc
import platform
import weakref

import pytest

from tasks.heap import USER_SETTINGS, frozen_heap, give_back_freed_memory, release_garbage


@pytest.mark.parametrize("setting", USER_SETTINGS)
def test_a_users_own_malloc_settings_are_left_alone(monkeypatch, setting):
    monkeypatch.setenv(setting, "4")
    assert give_back_freed_memory() is False


def test_glibc_takes_the_settings(monkeypatch):
    for setting in USER_SETTINGS:
        monkeypatch.delenv(setting, raising=False)
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or not ctypes.util.find_library("c"):
        pytest.skip("mallopt is glibc's")
    assert give_back_freed_memory() is True


class _Node:
    """An object in a reference cycle: only a full collection frees it."""


def test_release_garbage_frees_cycles_and_trims_the_heap():
    node = _Node()
    node.me = node  # a cycle, as a kept traceback's frames are
    alive = weakref.ref(node)
    del node
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert release_garbage() is glibc
    assert alive() is None


def _cycle() -> weakref.ref:
    node = _Node()
    node.me = node
    return weakref.ref(node)


def test_a_frozen_heap_keeps_what_lives_out_of_collections_until_its_last_block_ends():
    assert gc.get_freeze_count() == 0
    garbage = _cycle()  # unreachable before the block: collected first, not frozen for the run's length
    kept = _Node()
    kept.me = kept
    alive = weakref.ref(kept)
    outer = frozen_heap()
    outer.__enter__()
    assert garbage() is None
    frozen = gc.get_freeze_count()
    assert frozen > 1000  # this process's modules, functions, ... : out of every later collection
    del kept  # unreachable now, but frozen: a full collection does not walk it
    gc.collect()
    assert alive() is not None
    with frozen_heap():  # a second attempt in the same process (a sweep's), overlapping the first
        assert gc.get_freeze_count() >= frozen
    assert gc.get_freeze_count() >= frozen  # the first is still running: still frozen
    later = _cycle()  # made after the freeze: collected as ever
    gc.collect()
    assert later() is None
    outer.__exit__(None, None, None)
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None  # unfrozen with the last block: freed by the next full collection
