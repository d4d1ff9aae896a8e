"""The configured sources looked at without loading them: can they be reached, and which files are they.

- Reachability, before any work (``check_hubs``, ``check_sources``): a hub that cannot be
  reached, a local folder without the split files, a proxy file pattern that matches
  nothing fail in seconds with the ``DataSourceError`` a real load would raise, so the
  CLI stops before it starts Prefect.
- Identity, for the data cache's key (``source_signature``): what identifies the source
  data beyond the config, i.e. local files' names, sizes and parquet footers.

Only ``check_sources`` imports ``datasets`` (inside it; it runs on a cache miss): the cache key and a cache
hit need none of it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from bhfl_core.config.data import XglueSource
from bhfl_core.config.schema import ExperimentConfig
from bhfl_core.learning.hub import require_hub
from data_prep.sources import DataSourceError, load_or_explain, load_xglue_split, local_split_files, xglue_split


def check_hubs(config: ExperimentConfig) -> None:
    """Fail in seconds when a hub dataset of ``config`` is on a hub that cannot be reached (``hub.require_hub``)."""
    source = config.data.source
    if isinstance(source, XglueSource) and source.local_dir is None:
        require_hub(
            "data.source.repo",
            source.repo,
            "data.source.local_dir: <folder of XGLUE parquet files> (docs/data.md shows the layout and how to "
            "export it).",
        )
    proxy = config.data.proxy.source
    if proxy is not None and proxy.repo is not None:
        require_hub("data.proxy.source.repo", proxy.repo, "data.proxy.source.data_files: <local parquet files>.")


def check_sources(config: ExperimentConfig) -> None:
    """Cheap checks that the configured datasets can be found: local files exist, hub repos answer.

    Hub datasets are probed with ``load_dataset_builder`` (metadata only; with
    ``HF_HUB_OFFLINE=1`` it fails at once). The same ``DataSourceError`` as a real
    load, so the CLI can stop before starting Prefect.
    """
    from datasets import load_dataset_builder

    source = config.data.source
    if isinstance(source, XglueSource):
        if source.local_dir is not None:
            for lang in source.languages:  # raises the layout error when a split has no files
                split = xglue_split(source, lang)
                if not local_split_files(Path(source.local_dir).expanduser(), source.config, split):
                    load_xglue_split(source, split)
        else:
            load_or_explain(
                lambda: load_dataset_builder(
                    source.repo, source.repo_config or source.config, revision=source.revision
                ),
                f"{source.repo!r} (config {source.repo_config or source.config!r}, "
                f"revision {source.revision or 'default'})",
                "data.source",
            )
    proxy = config.data.proxy.source
    if proxy is None:
        return
    lang = config.data.source.languages[0]
    fill = (lambda v: v.format(lang=lang)) if proxy.per_language else (lambda v: v)
    if proxy.data_files is not None:
        patterns = [proxy.data_files] if isinstance(proxy.data_files, str) else proxy.data_files
        missing = [fill(p) for p in patterns if not glob_files(fill(p))]
        if missing:
            raise DataSourceError(
                f"data.proxy.source.data_files: no files match {missing} (paths are relative to the "
                "working directory; {lang} is replaced by each language)"
            )
    else:
        load_or_explain(
            lambda: load_dataset_builder(proxy.repo, fill(proxy.name) if proxy.name else None, revision=proxy.revision),
            f"proxy dataset {proxy.repo!r}",
            "data.proxy.source",
        )


# ---------------------------------------------------------------- identity (for the cache key)


def source_signature(config: ExperimentConfig) -> dict:
    """What identifies the source data beyond the config: local files' names, sizes and parquet footers.

    Replacing a local parquet file changes the fingerprint, so the cache never serves
    shards of old data. Hub sources are identified by repo, config and revision
    (in the config); pin ``revision`` for a fixed dataset version.
    """
    out: dict = {}
    source = config.data.source
    if isinstance(source, XglueSource) and source.local_dir is not None:
        folder = Path(source.local_dir).expanduser()
        splits = {xglue_split(source, lang) for lang in source.languages}
        out["source_files"] = {
            s: [_file_signature(f) for f in local_split_files(folder, source.config, s)] for s in sorted(splits)
        }
    proxy = config.data.proxy.source
    if proxy is not None and proxy.data_files is not None:
        patterns = [proxy.data_files] if isinstance(proxy.data_files, str) else proxy.data_files
        langs = config.data.source.languages if proxy.per_language else [None]
        files = sorted(
            {str(p) for pat in patterns for lg in langs for p in glob_files(pat.format(lang=lg) if lg else pat)}
        )
        out["proxy_files"] = [_file_signature(Path(f)) for f in files]
    return out


def glob_files(pattern: str) -> list[Path]:
    """The files ``pattern`` matches, absolute or relative to the working directory (as ``load_dataset`` reads it)."""
    path = Path(pattern).expanduser()
    if path.is_absolute():
        return sorted(Path(path.anchor).glob(str(path.relative_to(path.anchor))))
    return sorted(Path().glob(pattern))


def _file_signature(path: Path) -> list:
    """Name, size and a hash of the last 64 KiB: a parquet file's footer, so a replaced file changes it."""
    size = path.stat().st_size
    with path.open("rb") as f:
        f.seek(max(0, size - 65536))
        tail = hashlib.sha256(f.read()).hexdigest()[:16]  # a parquet footer holds the schema and row-group statistics
    return [path.name, size, tail]
