"""The partition report stays the same size at any number of clients; only clients.csv grows (a line each)."""

import csv
import json

import numpy as np

from data_prep.manifest import ClientEntry, Manifest, Shard
from data_prep.report import CLIENTS_CSV, MAX_ROWS, heatmap_rows, write_report

LANGUAGES = ("en", "de", "es", "fr", "ru")
LABELS = [f"label{k}" for k in range(10)]


def _manifest(clients_per_language: int) -> Manifest:
    rng = np.random.default_rng(clients_per_language)
    clients = []
    for lang in LANGUAGES:
        for i in range(clients_per_language):
            train = rng.multinomial(int(rng.integers(10, 200)), rng.dirichlet(np.full(10, 0.5)))
            test = rng.multinomial(max(1, int(train.sum()) // 4), train / train.sum())
            clients.append(
                ClientEntry(
                    id=f"{lang}-{i:05d}",
                    language=lang,
                    edge=f"edge-{lang}",
                    cluster=lang,
                    train=Shard(path="clients/train.arrow[0:0]", size=int(train.sum()), label_hist=train.tolist()),
                    test=Shard(path="clients/test.arrow[0:0]", size=int(test.sum()), label_hist=test.tolist()),
                )
            )
    empty = Shard(path="proxy/train.arrow", size=0, label_hist=[0] * 10)
    return Manifest(
        fingerprint="f",
        source="synthetic",
        task="classification",
        labels=LABELS,
        tokenizer="tokenizer",
        vocab_size=100,
        pad_token_id=0,
        clients=clients,
        proxy_train=empty,
        proxy_test=empty,
        unused_pool_rows=0,
    )


def test_report_size_does_not_grow_with_clients(tmp_path):
    sizes = {}
    for per_language in (100, 2000):  # 500 clients (already above the figures' bounds) and 10,000
        manifest = _manifest(per_language)
        folder = tmp_path / str(per_language)
        written = write_report(manifest, folder)
        sizes[per_language] = {p.name: p.stat().st_size for p in written}
        lines = list(csv.reader((folder / CLIENTS_CSV).open()))
        assert len(lines) == 1 + len(manifest.clients)
        assert lines[1][:6] == ["en-00000", "en", "edge-en", "en", str(manifest.clients[0].train.size),
                                str(manifest.clients[0].test.size)]  # fmt: skip
        hist = np.add(manifest.clients[-1].train.label_hist, manifest.clients[-1].test.label_hist)
        assert [int(v) for v in lines[-1][6:]] == hist.tolist()
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["clients"] == len(manifest.clients) and set(summary["per_language"]) == set(LANGUAGES)
    small, large = sizes[100], sizes[2000]
    assert large[CLIENTS_CSV] > 15 * small[CLIENTS_CSV]
    for name in small:
        if name != CLIENTS_CSV:  # markdown, summary and figures (PNG and SVG): bounded
            assert large[name] < 1.25 * small[name] + 2000, (name, small[name], large[name])
    assert max(large[name] for name in large if name != CLIENTS_CSV) < 400_000
    assert (tmp_path / "2000" / "partition.md").read_text().count("\n") < 20


def test_the_heatmap_shows_every_client_or_an_even_spread():
    assert heatmap_rows(30).tolist() == list(range(30))  # the default experiment: each client a row
    rows = heatmap_rows(10_000)
    assert len(rows) == MAX_ROWS and rows[0] == 0 and rows[-1] == 9_999
    assert np.ptp(np.diff(rows)) <= 1  # evenly spaced: each language keeps its share of rows
