"""What ``bhfl`` prints reaches a terminal whatever its encoding.

Python writes to a terminal in the locale's encoding, strictly: under a non-UTF-8
locale (ASCII, Latin-1) a character bhfl prints that it lacks (``±`` in ``bhfl
compare --help``, ``→``, ``≥``) ended the command in a UnicodeEncodeError traceback.
"""

from __future__ import annotations

import codecs
import contextlib
import sys


def printable_output() -> None:
    """stdout and stderr show ``?`` for a character their encoding lacks; streams in UTF-8 are left as they are."""
    for stream in (sys.stdout, sys.stderr):
        encoding = getattr(stream, "encoding", None) or "utf-8"
        if codecs.lookup(encoding).name != "utf-8":
            with contextlib.suppress(AttributeError, ValueError):  # not one of io's text streams (a test's capture)
                stream.reconfigure(errors="replace")  # type: ignore[union-attr]
