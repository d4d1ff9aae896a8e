"""Writing matplotlib figures from several threads of one process.

matplotlib is not thread-safe where it lays out text: it keeps one math-text parser per
process (``MathTextParser._parser``, used for the ``$10^{1}$`` tick labels of log axes)
whose state two concurrent parses corrupt (``ParseException``: seen when a sweep ran
two experiments side by side and both wrote their reports at once). Building a figure
does no layout; drawing it (``tight_layout``, ``savefig``) does. So every figure this
project writes is drawn under one lock: drawing is a few hundred milliseconds per
report, never on a training path.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from bhfl_core.store.atomic import atomic_path

DRAW_LOCK = threading.Lock()


def save_png(fig: Any, path: Path, dpi: int = 110, tight: bool = True, tight_layout: bool = False) -> None:
    """Draw ``fig`` (a matplotlib ``Figure``) and write it as PNG to a temporary name, then rename."""
    with DRAW_LOCK, atomic_path(path) as tmp:
        if tight_layout:
            fig.tight_layout()
        fig.savefig(tmp, dpi=dpi, bbox_inches="tight" if tight else None, format="png")
