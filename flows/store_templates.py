"""New SQLite stores (Prefect's database, MLflow's) copied from a migrated template.

A brand-new Prefect database spends ~10 s in schema migrations here, a new MLflow store
~2.3 s; the result depends only on the package's version. So the first store of a
version made on this machine is saved as a template (``~/.cache/bhfl/stores/``, or
``$BHFL_STORE_TEMPLATES``), and every later new store — a new run folder, a fresh CI
checkout on the same machine — starts as a copy of it and finds nothing to migrate.

Safe by construction: an existing database is never touched; templates are written to
a temporary name with SQLite's online backup (consistent even while the store is open)
and renamed into place, so a reader sees a whole template or none; a template of
another version is never used (the version is in its name).
"""

from __future__ import annotations

import os
import shutil
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bhfl_core.files import temp_sibling

ENV = "BHFL_STORE_TEMPLATES"


def template_dir() -> Path:
    if folder := os.environ.get(ENV):
        return Path(folder)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bhfl" / "stores"


def template_path(kind: str, version: str) -> Path:
    return template_dir() / f"{kind}-{version}.db"


def _copy_sqlite(src: Path, dst: Path) -> None:
    """``src`` into ``dst`` through a temporary file and a rename (SQLite backup: consistent while open)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(dst)
    try:
        with sqlite3.connect(f"file:{src}?mode=ro", uri=True) as source, sqlite3.connect(tmp) as target:
            source.backup(target)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def seed(db: Path, kind: str, version: str) -> bool:
    """Start the new store ``db`` as a copy of the template; False when ``db`` exists or there is none."""
    template = template_path(kind, version)
    if db.exists() or not template.exists():
        return False
    db.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(db)
    try:
        shutil.copyfile(template, tmp)
        if db.exists():  # created meanwhile: never replace a store in use
            return False
        os.replace(tmp, db)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def save_template(db: Path, kind: str, version: str) -> None:
    """Keep the migrated store ``db`` as the template of its version, unless there is one already."""
    template = template_path(kind, version)
    if template.exists() or not db.exists():
        return
    try:
        _copy_sqlite(db, template)
    except (OSError, sqlite3.Error):  # a cache we cannot write is not an error of the run
        pass


@contextmanager
def sqlite_from_template(db: Path, kind: str, version: str) -> Iterator[None]:
    """Around the first use of the store ``db``: start it from the template when it is new, else
    let the block create and migrate it and keep the result as the template."""
    new = not db.exists()
    seeded = seed(db, kind, version)
    yield
    if new and not seeded:
        save_template(db, kind, version)
