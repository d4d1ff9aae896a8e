"""CSV text of a table: one writer for every CSV file a run or a command produces.

Fields are written by the ``csv`` module (minimal quoting, ``\\n`` line ends), so a node
id, test-set or experiment name holding a comma, a quote or a line break is quoted and
reads back intact; every other field is written as is, so ordinary tables are plain
``a,b,c`` lines. Numbers are formatted by the caller: each table has its own precision.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence


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
