"""The allocator settings that let a worker's heap shrink again (tasks/heap.py): applied, unless the user chose."""

import ctypes.util
import platform

import pytest

from tasks.heap import USER_SETTINGS, give_back_freed_memory, release_garbage


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
    import weakref

    node = _Node()
    node.me = node  # a cycle, as a kept traceback's frames are
    alive = weakref.ref(node)
    del node
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert release_garbage() is glibc
    assert alive() is None
