"""Small files written so that a crash never leaves half of one: temporary name, then rename."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def temp_sibling(path: Path) -> Path:
    """A temporary name beside ``path``, unique to this process and thread (hidden, ``.tmp``)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def write_text_atomic(path: Path, text: str) -> None:
    """Readers (and a resumed run after a kill) see the old content or the new one, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
