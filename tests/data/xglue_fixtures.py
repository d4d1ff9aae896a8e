"""Small local parquet folders in XGLUE's exact layout: ``<dir>/<config>/<split>.parquet``.

NC comes from the embedded generator in XGLUE NC's schema (``news_title``,
``news_body``, ``news_category`` as a ClassLabel); every ``test.<lang>`` row carries
the marker word ``heldout`` so tests can prove those splits are never read. XNLI is
written with plain pyarrow (int labels, no HF metadata) to exercise the other
label path.
"""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from data_prep.export import embedded_xglue_splits, write_splits

HELDOUT = "heldout"


def write_xglue_nc(folder: Path, languages=("en", "de", "fr"), train=260, eval_size=200, seed=0) -> Path:
    splits = embedded_xglue_splits(seed, list(languages), train, eval_size)
    for name in [s for s in splits if s.startswith("test.")]:
        splits[name] = splits[name].map(lambda row: {"news_title": f"{HELDOUT} {row['news_title']}"})
    write_splits(folder, "nc", splits)
    return folder


def write_xglue_xnli(folder: Path, languages=("en", "de"), train=120, eval_size=80) -> Path:
    (folder / "xnli").mkdir(parents=True, exist_ok=True)

    def table(lang: str, n: int, offset: int) -> pa.Table:
        premise = [f"{lang} premise {i} words w{i % 7} w{i % 5}" for i in range(offset, offset + n)]
        hypothesis = [f"{lang} hypothesis {i} w{i % 3}" for i in range(offset, offset + n)]
        return pa.table({"premise": premise, "hypothesis": hypothesis, "label": [i % 3 for i in range(n)]})

    pq.write_table(table("en", train, 0), folder / "xnli" / "train.parquet")
    for lang in languages:
        pq.write_table(table(lang, eval_size, 10_000), folder / "xnli" / f"validation.{lang}.parquet")
        pq.write_table(table(lang, eval_size, 20_000), folder / "xnli" / f"test.{lang}.parquet")
    return folder
