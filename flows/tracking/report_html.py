"""``report.html``: a report's markdown as one self-contained HTML page, figures inline.

MLflow shows an HTML artefact in a sandboxed frame that cannot fetch the files beside it,
and shows a markdown artefact as text with its image links unresolved; so the HTML page
carries every figure it links as a ``data:`` URI and opens with the figures in the UI.
The markdown stays the source (readable in a terminal, diffable); this is its rendering.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

import markdown

from bhfl_core.store.atomic import write_text_atomic

_IMG = re.compile(r'<img alt="([^"]*)" src="([^"]+)"')
_TYPES = {".png": "image/png", ".svg": "image/svg+xml", ".jpg": "image/jpeg", ".jpeg": "image/jpeg"}
_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1200px; margin: 1.5em auto; padding: 0 1em; line-height: 1.45; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
th { background: #f3f3f3; }
img { max-width: 100%; }
code { background: #f3f3f3; padding: 0 0.2em; }
"""


def inline_figures(body: str, folder: Path) -> str:
    """Replace every ``<img src>`` relative to ``folder`` with the file's bytes as a data URI (others stay)."""

    def embed(match: re.Match[str]) -> str:
        alt, src = match.group(1), match.group(2)
        path = folder / src
        kind = _TYPES.get(path.suffix.lower())
        if "://" in src or src.startswith("data:") or kind is None or not path.is_file():
            return match.group(0)
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        return f'<img alt="{alt}" src="data:{kind};base64,{data}"'

    return _IMG.sub(embed, body)


def write_report_html(markdown_file: Path, title: str) -> Path:
    """Render ``markdown_file`` (a report.md) to ``report.html`` beside it, figures inline; returns its path."""
    body = markdown.markdown(markdown_file.read_text(encoding="utf-8"), extensions=["tables", "fenced_code"])
    page = (
        f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_STYLE}</style></head>\n<body>\n{inline_figures(body, markdown_file.parent)}\n</body></html>\n"
    )
    out = markdown_file.with_suffix(".html")
    write_text_atomic(out, page)
    return out
