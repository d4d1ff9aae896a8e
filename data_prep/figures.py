"""Writing matplotlib figures from several threads of one process.

matplotlib is not thread-safe where it lays out text: it keeps one math-text parser per
process (``MathTextParser._parser``, used for the ``$10^{1}$`` tick labels of log axes)
whose state two concurrent parses corrupt (``ParseException``: seen when a sweep ran
two experiments side by side and both wrote their reports at once). Building a figure
does no layout; drawing it (``tight_layout``, ``savefig``) does. So every figure this
project writes is drawn under one lock: drawing is a few hundred milliseconds per
report, never on a training path.

The SVG copy names its clip paths and markers by hashing their content with a salt
that matplotlib draws at random unless ``svg.hashsalt`` is set; a fixed salt makes the
file a function of the figure (the partition report is part of the data cache, whose
bytes must be the same on every machine: docs/data.md).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from bhfl_core.store.atomic import atomic_path

SVG_SALT = "bhfl"  # any fixed string: ids then depend on the drawing only

DRAW_LOCK = threading.Lock()


PNG_DPI = 200  # sharp in a paper or on a high-density screen; the vector copy scales anyway
MIN_FONT_PT = 8  # the smallest text any figure sets (tick labels), readable at the saved size


def save_png(fig: Any, path: Path, dpi: int = PNG_DPI, tight: bool = True, tight_layout: bool = False) -> None:
    """Draw ``fig`` (a matplotlib ``Figure``) and write it as ``path`` (PNG) and beside it as SVG.

    The PNG is what the reports show; the SVG (same stem) is for papers: vector, text
    kept as text. Each is written to a temporary name, then renamed.
    """
    import matplotlib  # only where a figure is drawn: data_prep.prepare imports this module on a cache hit too

    bbox = "tight" if tight else None
    with DRAW_LOCK:
        if tight_layout:
            fig.tight_layout()
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=dpi, bbox_inches=bbox, format="png")
        # no date, fixed id salt: same bytes each run (rcParams are process-wide: set only under the lock)
        with atomic_path(path.with_suffix(".svg")) as tmp, matplotlib.rc_context({"svg.hashsalt": SVG_SALT}):
            fig.savefig(tmp, bbox_inches=bbox, format="svg", metadata={"Date": None})
