"""Size caps, checked here rather than by effort: a module at most 450 lines, a function or method at most 80.

A file that keeps growing ends up holding several jobs, and a long function is where
feature branches land (issue 44); the caps make splitting one a step of the change that
crosses them, not a clean-up for later. The numbers are the ones docs/design.md states ("Guard-rails").

What counts:

- every Python file git tracks (``git ls-files``; without git, every ``.py`` under the
  repository's top-level folders but hidden ones), **test modules included**: a test
  file is read as often as the code it tests, and checking it too costs nothing here;
- a module's lines are its physical lines (``wc -l``);
- a function's lines run from its first decorator to its last line, methods and nested
  functions alike (a nested function counts within its parent, and on its own).

An offender is named with its line count. ``ALLOWED`` holds the exceptions, each with
its reason; an entry that no longer exceeds its cap fails the last test, so the list
only shrinks.
"""

from __future__ import annotations

import ast
import functools
import subprocess
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE_LINES = 450
FUNCTION_LINES = 80

ALLOWED: dict[str, str] = {
    # "path" (a module) or "path::qualified.name" (a function) -> why it may exceed its cap for now
}


def python_files(root: Path = ROOT) -> list[str]:
    """The tracked Python files, as paths relative to ``root`` (``/``-separated)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--", "*.py"], cwd=root, capture_output=True, text=True, check=True
        ).stdout
        return sorted(p for p in listed.split("\0") if p and (root / p).is_file())
    except (OSError, subprocess.CalledProcessError):  # no git, or not a checkout (an unpacked source archive)
        tops = [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")]
        return sorted(p.relative_to(root).as_posix() for top in tops for p in top.rglob("*.py"))


def function_lengths(source: str) -> Iterator[tuple[str, int]]:
    """Every function and method of ``source``: its qualified name and its lines (decorators included)."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                assert child.end_lineno is not None
                yield f"{prefix}{child.name}", child.end_lineno - first + 1
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(ast.parse(source), "")


@functools.cache  # two tests read it: parsing every file once is enough
def measured(root: Path = ROOT) -> dict[str, int]:
    """``path`` -> its lines and ``path::name`` -> a function's lines, for everything over its cap."""
    over: dict[str, int] = {}
    for path in python_files(root):
        source = (root / path).read_text()
        lines = len(source.splitlines())
        if lines > MODULE_LINES:
            over[path] = lines
        over |= {f"{path}::{name}": n for name, n in function_lengths(source) if n > FUNCTION_LINES}
    return over


def test_modules_and_functions_stay_under_their_caps():
    offenders = [
        f"{where}: {lines} lines (cap {FUNCTION_LINES if '::' in where else MODULE_LINES})"
        for where, lines in measured().items()
        if where not in ALLOWED
    ]
    assert offenders == [], 'split these (docs/design.md, "Guard-rails"):\n' + "\n".join(offenders)


def test_every_allowed_exception_is_still_needed():
    """An entry whose module or function is back under its cap (or gone) is removed, so the list only shrinks."""
    over = measured()
    assert [where for where in ALLOWED if where not in over] == []


def test_the_measure_counts_decorators_methods_and_nested_functions(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES - 2))
    source = (
        "import functools\n"
        "@functools.cache\n"  # the decorator's line counts: 1 + def + body = FUNCTION_LINES
        f"def at_cap():\n{body}\n"
        "class Holder:\n"
        "    def method(self):\n"
        "        def inner():\n"
        "            return 1\n"
        "        return inner\n"
    )
    assert dict(function_lengths(source)) == {
        "at_cap": FUNCTION_LINES,
        "Holder.method": 4,
        "Holder.method.inner": 2,
    }
    long = source.replace("def at_cap():\n", "def at_cap():\n    y = 0\n")
    (tmp_path / "long.py").write_text(long + "\n" * MODULE_LINES)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "long.py"], cwd=tmp_path, check=True)
    (tmp_path / "untracked.py").write_text("\n" * (MODULE_LINES + 1))  # not tracked: not checked
    lines = len(long.splitlines()) + MODULE_LINES
    assert measured(tmp_path) == {"long.py": lines, "long.py::at_cap": FUNCTION_LINES + 1}
