"""New SQLite stores (Prefect's database, MLflow's) copied from a migrated template.

A brand-new Prefect database spends ~5-6 s in schema migrations here (2 cores), a new
MLflow store ~1.3 s; the result depends only on the package's version. So the first
store of a version made on this machine is kept as a template (``~/.cache/bhfl/stores/``,
or ``$BHFL_STORE_TEMPLATES``; ``BHFL_STORE_TEMPLATES=off`` disables templates), and every
later new store (a new run folder, a fresh test folder) starts as a copy of it and finds
nothing to migrate. Templates are made lazily, from the first store that migrated itself,
not at install time: a ``pip install -U prefect`` gets its template on its first run, and
no install step has to start a server.

Safe by construction:

- a store that exists is never touched: the copy goes to a temporary name and is
  hard-linked into place, which fails if the store appeared meanwhile (no overwrite,
  even in a race); leftover ``-wal``/``-journal`` files of a deleted store also stop it;
- a template is written with SQLite's online backup (consistent while the store is
  open) to a temporary name, checked (integrity, schema present, no user data; see
  ``_KINDS``) and renamed into place, so concurrent first runs each write a whole
  template and a reader sees a whole template or none;
- a template of another version is never used: the version is in its name
  (``prefect-3.8.8-t2.db``), with the layout of this module (``FORMAT``).

Nothing here fails a run: a cache that cannot be read or written means the store
migrates itself as it would without templates.
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path

from bhfl_core.store.atomic import atomic_path

ENV = "BHFL_STORE_TEMPLATES"
FORMAT = 2  # in the file name: templates of an older layout of this module are not used
_SQLITE_MAGIC = b"SQLite format 3\x00"


class NotATemplate(Exception):
    """The store holds something a new store must not start with (or lacks its schema)."""


def _count(conn: sqlite3.Connection, table: str) -> int:
    try:
        return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
    except sqlite3.OperationalError as exc:  # no such table: not a migrated store of this kind
        raise NotATemplate(str(exc)) from exc


def _prefect(conn: sqlite3.Connection) -> None:
    """Migrated (``alembic_version``), block types registered (the server may skip that on a
    copy), and not one flow run, deployment or other object a user made."""
    if _count(conn, "alembic_version") != 1 or _count(conn, "block_type") == 0:
        raise NotATemplate("not migrated, or block types not registered yet")
    for table in ("flow", "flow_run", "task_run", "deployment", "automation", "variable", "artifact", "log", "events"):
        if _count(conn, table):
            raise NotATemplate(f"{table} is not empty")


def _mlflow(conn: sqlite3.Connection) -> None:
    """Migrated and without runs. The Default experiment goes: its artefact location is the
    creating process's working folder, so MLflow makes it anew (for its own folder) when it
    first opens the copy."""
    if _count(conn, "alembic_version") != 1:
        raise NotATemplate("not migrated")
    for table in ("runs", "registered_models", "logged_models"):
        if _count(conn, table):
            raise NotATemplate(f"{table} is not empty")
    conn.execute("DELETE FROM experiment_tags")
    conn.execute("DELETE FROM experiments")
    conn.commit()


_KINDS: dict[str, Callable[[sqlite3.Connection], None]] = {"prefect": _prefect, "mlflow": _mlflow}


def template_dir() -> Path | None:
    """Where templates live; None when they are switched off (``BHFL_STORE_TEMPLATES=off``)."""
    folder = os.environ.get(ENV)
    if folder and folder.lower() in ("0", "off", "false", "no"):
        return None
    if folder:
        return Path(folder).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bhfl" / "stores"


def template_path(kind: str, version: str) -> Path | None:
    if kind not in _KINDS:
        raise ValueError(f"unknown store kind {kind!r}")
    folder = template_dir()
    return None if folder is None else folder / f"{kind}-{re.sub(r'[^A-Za-z0-9._+-]', '_', version)}-t{FORMAT}.db"


def _leftovers(db: Path) -> list[Path]:
    """A journal or WAL of an earlier store at this path would be replayed into the copy."""
    return [p for p in (db.with_name(db.name + s) for s in ("-wal", "-journal", "-shm")) if p.exists()]


def _looks_whole(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            header = fh.read(100)
        page = int.from_bytes(header[16:18], "big")
        page = 65536 if page == 1 else page
        return header[:16] == _SQLITE_MAGIC and page >= 512 and path.stat().st_size % page == 0
    except OSError:
        return False


def seed(db: Path, kind: str, version: str) -> bool:
    """Start the new store ``db`` as a copy of the template; False (nothing done) when ``db``
    exists, or there is no usable template of this version."""
    template = template_path(kind, version)
    if template is None or db.exists() or _leftovers(db) or not _looks_whole(template):
        return False
    try:
        with atomic_path(db, overwrite=False) as tmp:  # FileExistsError when db was created meanwhile
            shutil.copyfile(template, tmp)
        return True
    except OSError:  # db appeared, unreadable template, full disk: the store migrates itself
        return False


def save_template(db: Path, kind: str, version: str) -> bool:
    """Keep the store ``db``, which just migrated itself, as the template of its version
    (unless there is one already, or ``db`` holds data a new store must not start with)."""
    template = template_path(kind, version)
    if template is None or template.exists() or not db.exists():
        return False
    try:
        with (
            atomic_path(template) as tmp,
            closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as source,
            closing(sqlite3.connect(tmp)) as target,
        ):
            source.backup(target)
            target.execute("PRAGMA journal_mode=DELETE")  # one self-contained file; stores set their own mode
            _KINDS[kind](target)
            if target.execute("PRAGMA integrity_check").fetchone()[0] != "ok":
                raise NotATemplate("integrity check failed")
        return True
    except (OSError, sqlite3.Error, NotATemplate):  # a cache we cannot write is not an error of the run
        return False


@contextmanager
def sqlite_from_template(db: Path, kind: str, version: str) -> Iterator[bool]:
    """Around the first use of the store ``db``: start it from the template when it is new
    (yields True then), else let the block create and migrate it and keep the result as
    the template."""
    new = not db.exists()
    seeded = new and seed(db, kind, version)
    yield seeded
    if new and not seeded:
        save_template(db, kind, version)
