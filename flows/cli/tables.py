"""Printing a command's result tables (the run, sweep and pipeline summaries) on stdout, whole.

rich lays a table out to the console's width, and a stdout that is a file or a pipe has
no width of its own: rich assumes 80 columns and wraps the cells of a wider table
(``0.433 /`` on one line, ``0.103`` on the next), in the file a user keeps or greps. There
the table gets the width it needs; a terminal (or ``COLUMNS``, when set) keeps its own.
"""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table

from flows.cli.shell import out

UNBOUNDED = 1000  # wider than any table a command prints: each then takes its natural width


def results_width() -> int:
    """The width stdout's tables are laid out in (module docstring)."""
    return out.width if out.is_terminal or os.environ.get("COLUMNS") else UNBOUNDED


def print_table(table: Table) -> None:
    """``table`` on stdout at ``results_width``, never folded by rich (``print(width=...)`` is capped at the
    console's own width: a wider one is a console of that width on the same stdout)."""
    width = results_width()
    (out if width == out.width else Console(soft_wrap=True, width=width)).print(table, soft_wrap=False)
