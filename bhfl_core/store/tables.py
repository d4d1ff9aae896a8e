"""Text of a table: one CSV writer for every CSV file, one markdown writer for every markdown table.

CSV fields are written by the ``csv`` module (minimal quoting, ``\\n`` line ends), so a
node id, test-set or experiment name holding a comma, a quote or a line break is quoted
and reads back intact; every other field is written as is, so ordinary tables are plain
``a,b,c`` lines. A markdown cell holding ``|`` or a line break would split its row, so
those are escaped there. Numbers are formatted by the caller: each table has its own
precision.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence
from pathlib import Path

from bhfl_core.store.atomic import atomic_path


def table_csv(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """The header and ``rows`` as CSV text, one ``\\n``-ended line each.

    Cells: ``str`` as is (quoted only where needed), ``None`` empty, anything else
    ``str(value)`` (floats at full precision: format them first for a fixed one).
    """
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n", quoting=csv.QUOTE_MINIMAL)
    writer.writerow(header)
    writer.writerows(rows)
    return out.getvalue()


def write_csv_atomic(path: Path, header: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    """``table_csv`` written as ``rows`` come (a table of millions of rows never held as one string), to a
    temporary file that becomes ``path`` once complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh, lineterminator="\n", quoting=csv.QUOTE_MINIMAL)
        writer.writerow(header)
        writer.writerows(rows)


def _markdown_cell(value: object) -> str:
    text = "" if value is None else str(value)
    return " ".join(text.replace("|", "\\|").splitlines())


def table_markdown(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """The header and ``rows`` as a GitHub-flavoured markdown table, lines joined by ``\\n`` (none at the end).

    Cells as in ``table_csv`` (``str`` as is, ``None`` empty, anything else ``str(value)``),
    with ``|`` escaped and line breaks made spaces, so every row keeps its columns.
    """
    lines = ["| " + " | ".join(_markdown_cell(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_markdown_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
