"""Every import a module's source holds, read by parsing (never importing): what the import-shape tests check.

Both tests/core/test_rooms.py (imports point down the rooms) and tests/test_import_cycles.py
(no module imports itself through others) read imports the same way: wherever they sit
(module level, inside functions, under ``if TYPE_CHECKING:`` or any other ``if``), each
resolved to the module it names.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    line: int
    target: str  # the imported module (``from pkg import sub`` names ``pkg.sub`` when ``sub`` is a module)


def module_name(path: Path, root: Path = ROOT) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def all_modules(packages: Sequence[str], root: Path = ROOT) -> dict[str, str]:
    """Every module of ``packages`` (folders under ``root``) -> its source."""
    return {module_name(p, root): p.read_text() for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}


def imports(module: str, source: str, known: Iterable[str]) -> list[Import]:
    """Every import statement of ``source`` in line order, wherever it sits (``ast.walk`` enters functions and ifs).

    A relative import keeps its dots (``.x``): it names no module of ``known``.
    """
    names = set(known)
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(module, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(module, node.lineno, sub if sub in names else base))
    return sorted(set(found), key=lambda imp: (imp.line, imp.target))  # one per module a statement names
