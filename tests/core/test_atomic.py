"""The one atomic writer: old content or new, never half, and no temporary file left behind."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bhfl_core.store.atomic import atomic_path, write_text_atomic
from bhfl_core.store.node_store import StateStore


class Boom(Exception):
    pass


def test_a_failing_write_leaves_the_old_content_and_no_temp_file(tmp_path):
    target = tmp_path / "record.json"
    write_text_atomic(target, "old")
    with pytest.raises(Boom), atomic_path(target) as tmp:
        tmp.write_text("half of the n")
        raise Boom
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]

    with pytest.raises(KeyboardInterrupt), atomic_path(target):  # BaseException too
        raise KeyboardInterrupt
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]


def test_a_hook_sees_the_written_temp_file_before_the_rename(tmp_path):
    target = tmp_path / "sub" / "state.bin"  # the folder is created
    seen: list[tuple[Path, bytes, bool]] = []
    with atomic_path(target, before_replace=lambda t: seen.append((t, t.read_bytes(), target.exists()))) as tmp:
        tmp.write_bytes(b"new")
    ((t, content, existed),) = seen
    assert t.parent == target.parent and t.name.startswith(".state.bin.") and t.name.endswith(".tmp")
    assert content == b"new" and not existed and not t.exists()
    assert target.read_bytes() == b"new" and [p.name for p in target.parent.iterdir()] == ["state.bin"]


def test_a_failing_hook_keeps_the_old_file_and_a_kill_leaves_a_temp_the_store_cleans(tmp_path):
    target = tmp_path / "nodes" / "x.safetensors"
    write_text_atomic(target, "old")

    def fail(tmp: Path) -> None:
        raise Boom

    with pytest.raises(Boom), atomic_path(target, before_replace=fail) as tmp:
        tmp.write_text("new")
    assert target.read_text() == "old" and [p.name for p in target.parent.iterdir()] == ["x.safetensors"]

    # a process killed between write and rename leaves its temporary file, which the store's cleanup finds
    code = (
        "import os, signal, sys\n"
        "from bhfl_core.store.atomic import atomic_path\n"
        "with atomic_path(sys.argv[1], before_replace=lambda t: os.kill(os.getpid(), signal.SIGKILL)) as tmp:\n"
        "    tmp.write_text('new')\n"
    )
    killed = subprocess.run([sys.executable, "-c", code, str(target)], cwd=Path(__file__).parents[2], check=False)
    assert killed.returncode < 0
    assert target.read_text() == "old" and len(list(target.parent.iterdir())) == 2
    assert StateStore(tmp_path).remove_partial_writes() == 1
    assert [p.name for p in target.parent.iterdir()] == ["x.safetensors"]


def test_no_overwrite_never_replaces_a_file_that_appeared(tmp_path):
    target = tmp_path / "store.db"
    with atomic_path(target, overwrite=False) as tmp:
        tmp.write_text("first")
    assert target.read_text() == "first"
    with pytest.raises(FileExistsError), atomic_path(target, overwrite=False) as tmp:
        tmp.write_text("second")
    assert target.read_text() == "first" and [p.name for p in tmp_path.iterdir()] == ["store.db"]

    raced = tmp_path / "raced.db"
    with pytest.raises(FileExistsError), atomic_path(raced, overwrite=False) as tmp:
        tmp.write_text("mine")
        raced.write_text("theirs")  # another process made it meanwhile: it wins
    assert raced.read_text() == "theirs" and sorted(p.name for p in tmp_path.iterdir()) == ["raced.db", "store.db"]


def test_files_are_written_in_utf8_whatever_the_locale(tmp_path):
    # Under a non-UTF-8 locale (here ASCII: the C locale with Python's UTF-8 mode off) a run's report, whose text
    # has "·", "≥" and "–", failed the whole run at its end with a UnicodeEncodeError: files took the locale's
    # encoding. They are UTF-8 now, whatever the locale, and read back as such.
    text = "mean ± std · root ≥ parent – café"
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from bhfl_core.store.atomic import write_text_atomic\n"
        "from bhfl_core.store.tables import write_csv_atomic\n"
        "folder, text = Path(sys.argv[1]), sys.argv[2].encode('ascii').decode('unicode_escape')\n"
        "write_text_atomic(folder / 'report.md', text)\n"
        "write_csv_atomic(folder / 'table.csv', ['label'], [[text]])\n"
    )
    ascii_locale = {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    escaped = text.encode("unicode_escape").decode("ascii")  # the argument itself must pass the ASCII locale
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), escaped],
        cwd=Path(__file__).parents[2],
        env={**os.environ, **ascii_locale},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "report.md").read_bytes() == text.encode("utf-8")
    assert (tmp_path / "table.csv").read_bytes() == f"label\n{text}\n".encode()
