"""Write XGLUE-layout parquet folders: ``<dir>/<config>/<split>.parquet`` with XGLUE's split names.

Two uses:

- ``write_splits``: save any ``{split: Dataset}`` (e.g. XGLUE loaded on a machine
  whose ``datasets`` still runs the canonical loading script) into the layout
  ``data.source.local_dir`` reads (docs/data.md shows the recipe);
- ``export_embedded``: the embedded generated corpus in XGLUE NC's exact schema
  and split naming (``train`` in English only, ``validation.<lang>``,
  ``test.<lang>``), so the local-parquet path runs end to end offline
  (``configs/xglue-nc-parquet.yaml``; the tests build their fixtures with it).

Files are written to a temporary name and renamed.

    python -m data_prep.export runs/xglue-embedded            # embedded corpus as XGLUE NC parquet
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

from datasets import Dataset

from bhfl_core.store.atomic import atomic_path
from data_prep.embedded import generate_pool


def write_splits(folder: Path, config: str, splits: Mapping[str, Dataset]) -> list[Path]:
    """``<folder>/<config>/<split>.parquet`` for every split (features, e.g. ClassLabel names, kept)."""
    target = folder / config
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for split, data in splits.items():
        path = target / f"{split}.parquet"
        with atomic_path(path) as tmp:  # hidden temp sibling, removed if the write fails
            data.to_parquet(str(tmp))
        written.append(path)
    return written


def embedded_xglue_splits(
    seed: int,
    languages: list[str],
    train_size: int,
    eval_size: int,
    cue_strength: float = 0.6,
    topic_strength: float = 0.25,
) -> dict[str, Dataset]:
    """The embedded corpus split like XGLUE NC: English ``train`` plus per-language validation/test."""
    splits: dict[str, Dataset] = {}
    for lang in languages:
        extra = train_size if lang == "en" else 0
        pool = generate_pool(seed, lang, extra + 2 * eval_size, cue_strength, topic_strength).remove_columns("language")
        if extra:
            splits["train"] = pool.select(range(extra))
        splits[f"validation.{lang}"] = pool.select(range(extra, extra + eval_size))
        splits[f"test.{lang}"] = pool.select(range(extra + eval_size, extra + 2 * eval_size))
    return {name: splits[name] for name in sorted(splits, key=lambda s: (s != "train", s))}


def export_embedded(
    folder: Path, seed: int = 0, languages: list[str] | None = None, train_size: int = 4000, eval_size: int = 1500
) -> list[Path]:
    langs = languages or ["en", "de", "es", "fr", "ru"]
    return write_splits(folder, "nc", embedded_xglue_splits(seed, langs, train_size, eval_size))


def main(
    folder: Annotated[Path, "target folder"],
    seed: int = 0,
    train_size: int = 4000,
    eval_size: int = 1500,
) -> None:
    """Write the embedded corpus as XGLUE NC parquet files under FOLDER/nc/."""
    import datasets

    datasets.disable_progress_bars()
    for path in export_embedded(folder, seed, None, train_size, eval_size):
        print(path)


if __name__ == "__main__":
    import typer

    typer.run(main)
