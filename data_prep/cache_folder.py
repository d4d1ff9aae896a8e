"""Where the data cache is: ``<run-dir>/cache``, or one folder for every run folder (``$BHFL_DATA_CACHE``).

An entry of the cache is a function of its fingerprint alone (data_prep/prepare.py: the same
bytes whoever prepared it), so nothing ties it to one run folder. With ``BHFL_DATA_CACHE`` set,
runs under any ``--run-dir`` share its entries, as Hugging Face's ``HF_DATASETS_CACHE`` serves
every project: a config prepared once is a cache hit from then on. Entries are committed whole and
one preparation of a fingerprint runs at a time (data_prep/cache_entry.py), so commands in
several shells may share one folder.

A job reads the variable once, when it starts (``flows/launch.py``): a resume reads it again,
and finds the same data wherever it looks (a miss prepares the same bytes anew).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from bhfl_core.config.base import ConfigError

DATA_CACHE_ENV = "BHFL_DATA_CACHE"


def data_cache_folder(run_root: Path, environ: Mapping[str, str] | None = None) -> Path:
    """The data cache of runs under ``run_root``: ``$BHFL_DATA_CACHE`` if set (not empty), else ``<run_root>/cache``;
    absolute."""
    chosen = (os.environ if environ is None else environ).get(DATA_CACHE_ENV, "").strip()
    return (Path(chosen).expanduser() if chosen else run_root / "cache").resolve()


def check_data_cache_folder(folder: Path) -> None:
    """A data cache that cannot be one (a file is there) is named before anything runs."""
    if folder.exists() and not folder.is_dir():
        named = f"{DATA_CACHE_ENV}={os.environ[DATA_CACHE_ENV]}" if os.environ.get(DATA_CACHE_ENV) else "the data cache"
        raise ConfigError(f"{named}: {folder} is a file, not a folder. Name a folder for the data cache.")
