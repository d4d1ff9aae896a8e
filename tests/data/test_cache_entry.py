"""The data-cache entry's commit (data_prep/cache_entry.py): all or nothing, one builder at a time.

A real full disk is tests/data/test_disk_full.py; two real preparations racing for one
entry are in tests/data/test_prepare.py.
"""

import errno
import threading

import pytest

from data_prep.cache_entry import building, disk_full_named, is_disk_full, locked


def test_an_entry_appears_only_when_its_build_finishes(tmp_path):
    entry = tmp_path / "cache" / "abc"
    (tmp_path / "cache" / ".abc.partial").mkdir(parents=True)  # what a killed build left
    (tmp_path / "cache" / ".abc.partial" / "stale").write_text("old")
    with building(entry) as work:
        assert work.name == ".abc.partial" and list(work.iterdir()) == []  # the leftover is gone
        (work / "manifest.json").write_text("{}")
        assert not entry.exists()
    assert (entry / "manifest.json").read_text() == "{}"
    assert sorted(p.name for p in entry.parent.iterdir()) == ["abc"]


def test_a_failed_build_leaves_nothing(tmp_path):
    entry = tmp_path / "abc"
    with pytest.raises(KeyboardInterrupt), building(entry) as work:
        (work / "shard").write_bytes(b"half")
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_a_folder_without_manifest_under_the_entry_name_is_replaced(tmp_path):
    entry = tmp_path / "abc"
    entry.mkdir()
    (entry / "half-written").write_text("x")
    with building(entry) as work:
        (work / "manifest.json").write_text("{}")
    assert sorted(p.name for p in entry.iterdir()) == ["manifest.json"]


def test_disk_full_is_recognised_however_the_library_says_it():
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_disk_full(Exception("No space left on device (os error 28)"))  # tokenizers (Rust io::Error)
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("writing the shard failed") from inner
    except RuntimeError as outer:
        assert is_disk_full(outer)
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(ValueError("no space"))


def test_disk_full_names_the_entry_and_other_errors_pass_unchanged(tmp_path):
    with pytest.raises(OSError) as caught, disk_full_named(tmp_path / "abc"):
        raise Exception("No space left on device (os error 28)")
    assert (caught.value.errno, caught.value.filename) == (errno.ENOSPC, str(tmp_path / "abc"))
    assert isinstance(caught.value.__cause__, Exception)
    with pytest.raises(ValueError, match="bad label"), disk_full_named(tmp_path / "abc"):
        raise ValueError("bad label")


def test_a_second_builder_waits_for_the_first(tmp_path):
    entry = tmp_path / "abc"
    events: list[str] = []
    first_has_it, second_waits = threading.Event(), threading.Event()

    def second():
        first_has_it.wait()
        with locked(entry, on_wait=second_waits.set):
            events.append("second")

    thread = threading.Thread(target=second)
    thread.start()
    with locked(entry):
        first_has_it.set()
        assert second_waits.wait(10)  # the second found the lock taken
        assert events == []
        events.append("first done")
    thread.join(10)
    assert events == ["first done", "second"]
    assert list(tmp_path.iterdir()) == []  # the lock file goes with the last holder
