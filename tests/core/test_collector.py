"""The cyclic collector off while a process imports, then on with what it imported frozen (tasks/collector.py)."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from tasks import collector


@pytest.fixture(autouse=True)
def _collector_as_found():
    """Each test leaves the collector on and nothing frozen, as pytest had it."""
    yield
    gc.unfreeze()
    gc.enable()


def test_imports_frozen_turns_the_collector_off_inside_and_freezes_what_the_block_made():
    before = gc.get_freeze_count()
    with collector.imports_frozen():
        assert not gc.isenabled()
        made = [[i] for i in range(5_000)]  # tracked objects, as an import makes
    assert gc.isenabled()
    assert gc.get_freeze_count() >= before + len(made)
    assert not any(item is made[0] for item in gc.get_objects())  # frozen: out of every generation's walk


def test_resume_freezes_once_after_a_pause_and_is_a_no_op_while_the_collector_is_on():
    assert collector.pause() is True and not gc.isenabled()
    collector.resume()
    frozen = gc.get_freeze_count()
    assert gc.isenabled() and frozen > 0
    made = [[] for _ in range(1000)]  # tracked objects a second freeze would take
    collector.resume()  # on already: nothing is frozen again (a sweep's later points collect as usual)
    # (frozen objects other threads free meanwhile lower the count: compare with what a freeze would add)
    assert gc.get_freeze_count() < frozen + len(made)
    gc.disable()
    assert collector.pause() is False
    collector.restore(False)  # off before: left off
    assert not gc.isenabled()


def test_a_command_runs_with_the_collector_off_and_leaves_it_as_it_found_it():
    """In a process of its own: the command's entry installs its signal handlers for good."""
    script = (
        "import gc\n"
        "from flows.cli.stopping import run_command\n"
        "seen = []\n"
        "def app():\n"
        "    seen.append(gc.isenabled())\n"
        "    raise SystemExit(2)  # a command that ends early (a config error) never reached its work\n"
        "try:\n"
        "    run_command(lambda: app)\n"
        "except SystemExit:\n"
        "    print(seen, gc.isenabled(), gc.get_freeze_count())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["[False]", "True", "0"]
