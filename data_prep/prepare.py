"""Prepare an experiment's data: pool -> partition -> proxy -> tokenizer -> shards -> edges -> manifest -> report.

The result is cached under ``<cache>/<fingerprint>/`` where the fingerprint hashes
everything the data depends on (seed, data config, local source files, tokenizer
identity, format version). Every file in it is a function of those alone (the
tokenizer too: data_prep/wordpiece.py), so two machines hold the same bytes under
the same fingerprint. The folder is built under a temporary name and renamed when
complete, one preparation of a fingerprint at a time (data_prep/cache_entry.py), so
a crash or a full disk never leaves a half-written entry; a second run with the
same config finds the manifest and does no loading or tokenisation (and says so).

The steps and the fingerprint are in data_prep/steps.py: only the rows the
partition uses are tokenised, once, into four Arrow files; each client's train/test
shard is a row range of them (data_prep/shards.py: memory-mapped when read back,
``load_shard``, only the rows asked for).

``prepare_data`` runs its steps through ``step(name, fn, *args)``: plain calls by
default; the Prefect flow (flows/data.py) passes a runner that makes each step a
task, so data_prep stays free of Prefect. ``datasets`` (~0.7 s to import) is imported
where a step or a shard load uses it: a cache hit (``bhfl prepare``, a run's data
check) reads the manifest only.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from bhfl_core.config.base import ConfigError
from bhfl_core.config.data import PreparedSource
from bhfl_core.config.schema import ExperimentConfig
from bhfl_core.learning.models import check_available as check_model
from bhfl_core.learning.models import check_hub as check_model_hub
from data_prep.cache_entry import building, disk_full_named, locked
from data_prep.cache_folder import check_data_cache_folder
from data_prep.manifest import MANIFEST_NAME, Manifest
from data_prep.report import write_report
from data_prep.shards import file_rows, load_shard, parse_path
from data_prep.source_checks import check_hubs, check_sources
from data_prep.sources import load_pool
from data_prep.steps import (
    edges_step,
    fingerprint,
    manifest_step,
    partition_step,
    proxy_step,
    shards_step,
    tokenizer_step,
)

REPORT_DIR = "report"
SCRATCH = ".scratch"
Step = Callable[..., Any]
__all__ = ["PreparedData", "cached_data", "load_shard", "preflight", "prepare_data", "prepared_folder"]


def inline_step(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Run a preparation step as a plain call."""
    return fn(*args)


@dataclass(frozen=True)
class PreparedData:
    root: Path
    manifest: Manifest
    cached: bool
    seconds: float = 0.0

    def path(self, relative: str) -> Path:
        return self.root / relative

    @property
    def report_dir(self) -> Path:
        return self.root / REPORT_DIR


# ---------------------------------------------------------------- the pipeline


def _problems(exc: ValueError) -> str:
    """The first few problems of a failed manifest read, on one line (``loc: message``)."""
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'top level'}: {e['msg']}" for e in exc.errors()[:3])
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def prepared_folder(source: PreparedSource, task: str) -> PreparedData:
    """A dataset already in bhfl's prepared form (``data.source.kind: prepared``), checked, used in place."""
    started = time.time()
    root = Path(source.path).expanduser().resolve()
    key = "data.source.path"
    if not (root / MANIFEST_NAME).is_file():
        what = f"has no {MANIFEST_NAME}" if root.is_dir() else "is a file" if root.exists() else "does not exist"
        raise ConfigError(f"{key}: {root} {what}; it must be a prepared-data folder (docs/data.md)")
    try:
        manifest = Manifest.read(root)
    except ValueError as exc:  # pydantic's ValidationError (bad JSON, missing or wrong keys), undecodable bytes
        raise ConfigError(f"{key}: {root / MANIFEST_NAME} is not a valid manifest ({_problems(exc)})") from None
    if bad := _unreadable_shards(root, manifest):
        raise ConfigError(
            f"{key}: shard(s) named in {root / MANIFEST_NAME} are missing, not datasets save_to_disk folders "
            f"(no state.json), or not the rows of their Arrow file: {', '.join(bad[:5])}"
            + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        )
    if manifest.task != task:
        raise ConfigError(f"data.task: {task!r} but the data in {root} is for task {manifest.task!r}")
    found = sorted({c.language for c in manifest.clients})
    if found != sorted(source.languages):
        raise ConfigError(
            f"data.source.languages: {sorted(source.languages)} but the clients of {root} have languages {found}"
        )
    return PreparedData(root, manifest, cached=True, seconds=time.time() - started)


def _unreadable_shards(root: Path, manifest: Manifest) -> list[str]:
    """The shard paths that would fail mid-run: a folder without ``state.json``, rows outside their Arrow file.

    Read from the client table's columns, not as a ``ClientEntry`` per client: at 100,000
    clients building those took ~3 s, on every cache hit.
    """
    bad: list[str] = []
    rows_of: dict[str, int | None] = {}  # each Arrow file opened once (memory-mapped: its row count only)
    clients, proxies = manifest.clients, (manifest.proxy_train, manifest.proxy_test)
    paths = [*clients.train_path.tolist(), *clients.test_path.tolist(), *(s.path for s in proxies)]
    sizes = [*clients.train_size.tolist(), *clients.test_size.tolist(), *(s.size for s in proxies)]
    for path, size in zip(paths, sizes, strict=True):
        file, rows = parse_path(path)
        if not file.endswith(".arrow"):
            if not (root / file / "state.json").is_file():
                bad.append(path)
            continue
        if file not in rows_of:
            try:
                rows_of[file] = file_rows(root / file)
            except (OSError, ValueError):  # missing, or not an Arrow stream (pyarrow's errors are ValueErrors)
                rows_of[file] = None
        count = rows_of[file]
        start, stop = rows or (0, count or 0)
        if count is None or stop > count or stop - start != size:
            bad.append(path)
    return bad


class DamagedCacheError(ConfigError):
    """A data-cache entry whose manifest or shard files were damaged after it was committed (docs/data.md, Cache)."""


def _damaged(root: Path, what: str) -> DamagedCacheError:
    return DamagedCacheError(
        f"the data cache entry {root} is damaged: {what}. It was complete when it was written (entries are "
        f"committed whole), so something changed it since (a disk error, a copy cut short, an edit). The cache "
        f"holds derived data only: delete the entry (`rm -r {root}`) and run the command again, which prepares it "
        f"afresh (the same bytes)."
    )


def cached_entry(root: Path) -> PreparedData:
    """The committed cache entry ``root``, checked as a ``kind: prepared`` folder is (docs/data.md, Cache).

    Its manifest must be valid and every Arrow file must hold the rows its shards name:
    a truncated, missing or unreadable file is a ``DamagedCacheError`` naming it, before
    any work, never a traceback mid-run (or training on what is left).
    """
    started = time.time()
    try:
        manifest = Manifest.read(root)
    except ValueError as exc:  # pydantic's ValidationError (bad JSON, missing or wrong keys), undecodable bytes
        raise _damaged(root, f"{root / MANIFEST_NAME} is not a valid manifest ({_problems(exc)})") from None
    if bad := _unreadable_shards(root, manifest):
        files = sorted({parse_path(path)[0] for path in bad})
        raise _damaged(
            root, f"{', '.join(str(root / f) for f in files)} missing, cut short or not the rows its manifest names"
        )
    return PreparedData(root, manifest, cached=True, seconds=time.time() - started)


def cached_data(config: ExperimentConfig, cache_root: Path) -> PreparedData | None:
    if isinstance(config.data.source, PreparedSource):
        return prepared_folder(config.data.source, config.data.task)
    final = cache_root / fingerprint(config)
    if (final / MANIFEST_NAME).exists():
        return cached_entry(final)
    return None


def check_hub(config: ExperimentConfig, cache_root: Path) -> None:
    """Seconds at most: fail when the cache folder is a file, or the model or, on a cache miss, the data comes
    from a hub that cannot be reached.

    Without ``HF_HUB_OFFLINE`` the hub client retries for ~30 s before it fails; this
    one quick probe (``bhfl_core/learning/hub.py``) lets the CLI stop before it starts
    Prefect and the workers, whose start-up it would otherwise wait for.
    """
    check_data_cache_folder(cache_root)
    check_model_hub(config.model)
    if cached_data(config, cache_root) is None:
        check_hubs(config)


def preflight(config: ExperimentConfig, cache_root: Path) -> None:
    """Fail before any work (and before Prefect starts) when the model or, on a cache miss, the data is unreachable."""
    check_hub(config, cache_root)
    check_model(config.model)
    if cached_data(config, cache_root) is None:
        check_sources(config)


def prepare_data(
    config: ExperimentConfig, cache_root: Path, log: Callable[[str], None] = print, step: Step = inline_step
) -> PreparedData:
    started = time.time()
    hit = cached_data(config, cache_root)
    if hit is not None:
        what = "prepared data" if isinstance(config.data.source, PreparedSource) else "data cache hit"
        log(f"{what} {hit.root}: reusing pre-tokenised shards, no tokenisation")
        return hit
    fp = fingerprint(config)
    final = cache_root / fp
    import datasets

    datasets.disable_progress_bars()
    with disk_full_named(final), locked(final, lambda: log(f"waiting for another preparation of {final}")):
        if (hit := cached_data(config, cache_root)) is not None:  # made while this one waited for the lock
            log(f"data cache hit {hit.root}: prepared meanwhile, no tokenisation")
            return replace(hit, seconds=time.time() - started)  # the wait included: what `bhfl prepare` says it took
        log(f"preparing data (fingerprint {fp}) in {final}")
        with building(final) as work:
            pool = step("load-pool", load_pool, config, work / SCRATCH)
            part = step("partition", partition_step, config, pool)
            proxy = step("proxy-split", proxy_step, config, pool, part)
            tokenizer, tokenizer_ref = step("tokenizer", tokenizer_step, config, proxy, work)
            shards = step("tokenise", shards_step, config, tokenizer, pool, part, proxy, work, log)
            edges = step("assign-edges", edges_step, config, part, shards)
            manifest = step(
                "write-manifest",
                manifest_step,
                *(config, pool, part, proxy, tokenizer, tokenizer_ref, shards, edges, work),
            )
            step("partition-report", write_report, manifest, work / REPORT_DIR)
            if (work / SCRATCH).exists():  # a large generated pool (data_prep/sources.py), not part of the entry
                shutil.rmtree(work / SCRATCH)
    seconds = time.time() - started
    log(
        f"prepared {len(manifest.clients)} clients on {len({c.edge for c in manifest.clients})} edge servers, "
        f"proxy {manifest.proxy_train.size}/{manifest.proxy_test.size} (train/test), in {seconds:.1f} s"
    )
    return PreparedData(final, manifest, cached=False, seconds=seconds)
