"""The partition report: statistics and plots of a prepared manifest (written next to it, once).

- ``summary.json``: clients and edge servers per language, client sizes (train +
  test: min / median / max), label skew, proxy sizes, unused pool rows;
- ``partition.md``: the same as a small markdown table (a line per language);
- ``clients.csv``: every client: language, edge, cluster, train and test sizes, and
  its label counts (train + test);
- ``client_sizes.png`` (and ``.svg``): client size distribution per language (log
  scale; each client a dot up to ``MAX_POINTS`` clients, box plots only above);
- ``label_skew.png`` (and ``.svg``): heatmap clients x labels (each client's label
  shares; above ``MAX_ROWS`` clients, ``MAX_ROWS`` of them evenly spaced in
  manifest order, so every language keeps its share of rows).

Only ``clients.csv`` grows with the number of clients: the summary, the markdown
and the figures are bounded (tests/data/test_report.py). Label skew is summarised
as the mean total-variation distance between a client's label distribution and (a)
its language's (all its language's clients pooled), (b) the global one; 0 = no
skew, 1 = disjoint labels. Figures use matplotlib's object API with the Agg canvas
(no display, no global backend switch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from bhfl_core.store.tables import table_csv, table_markdown
from data_prep.figures import MIN_FONT_PT, save_png
from data_prep.manifest import ClientTable, Manifest

SUMMARY, MARKDOWN, SIZES_PNG, SKEW_PNG = "summary.json", "partition.md", "client_sizes.png", "label_skew.png"
CLIENTS_CSV = "clients.csv"
MAX_POINTS = 200  # clients drawn as dots in the size plot
MAX_ROWS = 400  # clients drawn as rows of the label-skew heatmap


def _histograms(clients: ClientTable, rows: np.ndarray | None = None) -> np.ndarray:
    """Label counts (train + test), a row per client (``rows``: those only); no columns when the shards are
    unlabelled."""
    train, test = clients.train_hist, clients.test_hist
    if rows is not None:
        train, test = train[rows], test[rows]
    if not train.shape[1] or not test.shape[1]:
        return np.zeros((len(train), 0))
    return (train + test).astype(float)


def _tv(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Total-variation distance between the rows of ``p`` and ``q`` (counts; an empty row counts as all zeros)."""
    shares = [m / np.maximum(m.sum(axis=-1, keepdims=True), 1) for m in (p, q)]
    return 0.5 * np.abs(shares[0] - shares[1]).sum(axis=-1)


def partition_summary(manifest: Manifest) -> dict[str, Any]:
    clients = manifest.clients
    sizes = clients.train_size + clients.test_size
    train = clients.train_size
    language = clients.language
    languages = list(dict.fromkeys(language.tolist()))
    hists = _histograms(clients)
    per_language: dict[str, Any] = {}
    tv_lang, tv_global = np.zeros(0), np.zeros(0)
    for lang in languages:
        idx = np.flatnonzero(language == lang)
        s = sizes[idx]
        per_language[lang] = {
            "clients": len(idx),
            "edges": sorted(set(clients.edge[idx].tolist())),
            "size_min": int(s.min()),
            "size_median": float(np.median(s)),
            "size_max": int(s.max()),
            "train": int(train[idx].sum()),
            "test": int(s.sum() - train[idx].sum()),
        }
        if hists.shape[1]:
            tv_lang = np.concatenate([tv_lang, _tv(hists[idx], hists[idx].sum(axis=0))])
    if hists.shape[1]:
        tv_global = _tv(hists, hists.sum(axis=0))
    return {
        "fingerprint": manifest.fingerprint,
        "task": manifest.task,
        "source": manifest.source,
        "clients": len(clients),
        "edges": len({c.edge for c in clients}),
        "clustering": manifest.clustering,
        "sizes": {
            "min": int(sizes.min()),
            "median": float(np.median(sizes)),
            "max": int(sizes.max()),
            "mean": float(sizes.mean()),
            "total": int(sizes.sum()),
        }
        if len(sizes)
        else {},
        "label_skew": {
            "tv_to_language_mean": float(np.mean(tv_lang)) if len(tv_lang) else None,
            "tv_to_global_mean": float(np.mean(tv_global)) if len(tv_global) else None,
            "labels_present_mean": float((hists > 0).sum(axis=1).mean()) if hists.shape[1] else None,
            "labels": len(manifest.labels),
        },
        "per_language": per_language,
        "proxy": {
            "source": manifest.proxy_source,
            "train": manifest.proxy_train.size,
            "test": manifest.proxy_test.size,
        },
        "unused_pool_rows": manifest.unused_pool_rows,
        "held_out": manifest.held_out,
    }


def _language_row(language: str, s: dict[str, Any]) -> list[object]:
    size = f"{s['size_median']:g}"
    return [language, s["clients"], len(s["edges"]), s["size_min"], size, s["size_max"], s["train"], s["test"]]


def summary_markdown(summary: dict[str, Any]) -> str:
    skew = summary["label_skew"]
    lines = [
        f"Partition `{summary['fingerprint']}` ({summary['task']}, {summary['source']}): {summary['clients']} clients, "
        f"{summary['edges']} edge servers ({summary['clustering']} clustering).",
        "",
        table_markdown(
            ["language", "clients", "edge servers", "size min", "size median", "size max", "train", "test"],
            (_language_row(lang, s) for lang, s in summary["per_language"].items()),
        ),
    ]
    if skew["tv_to_language_mean"] is not None:
        lines += [
            "",
            f"Label skew: mean total-variation distance of a client's labels to its language's "
            f"{skew['tv_to_language_mean']:.3f}, to the global {skew['tv_to_global_mean']:.3f}; "
            f"{skew['labels_present_mean']:.1f} of {skew['labels']} labels present per client on average.",
        ]
    p = summary["proxy"]
    lines += [
        "",
        f"Proxy ({p['source']}): {p['train']} train / {p['test']} test rows. "
        f"Unused pool rows: {summary['unused_pool_rows']}."
        + (f" Held out: {summary['held_out']}." if summary["held_out"] else ""),
    ]
    return "\n".join(lines) + "\n"


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110)


def clients_csv(manifest: Manifest) -> str:
    """Every client as a CSV line: id, language, edge, cluster, train, test, then its count of each label."""
    hists = _histograms(manifest.clients).astype(np.int64)
    labels = manifest.labels if hists.shape[1] else []
    return table_csv(
        ["client", "language", "edge", "cluster", "train", "test", *labels],
        (
            [c.id, c.language, c.edge, c.cluster, c.train.size, c.test.size, *h.tolist()]
            for c, h in zip(manifest.clients, hists)
        ),
    )


def plot_sizes(manifest: Manifest, path: Path) -> None:
    language = manifest.clients.language
    languages = list(dict.fromkeys(language.tolist()))
    sizes = manifest.clients.train_size + manifest.clients.test_size
    data = [sizes[language == lang] for lang in languages]
    fig = _figure(1.2 + 0.9 * len(languages), 3.6)
    ax = fig.add_subplot()
    ax.boxplot(data, showfliers=False)
    ax.set_xticks(range(1, len(languages) + 1), languages)
    if len(sizes) <= MAX_POINTS:
        rng = np.random.default_rng(0)  # jitter only: the plot, not the data
        for i, values in enumerate(data, start=1):
            ax.scatter(i + rng.uniform(-0.15, 0.15, len(values)), values, s=12, alpha=0.7)
    ax.set_yscale("log")
    ax.set_xlabel("language")
    ax.set_ylabel("client size (train + test)")
    ax.set_title("Client sizes per language" + (f" ({len(sizes)} clients)" if len(sizes) > MAX_POINTS else ""))
    save_png(fig, path, tight=False, tight_layout=True)


def heatmap_rows(count: int) -> np.ndarray:
    """The clients (indices in manifest order) the label-skew heatmap shows: all, or ``MAX_ROWS`` evenly spaced."""
    return np.unique(np.linspace(0, count - 1, min(count, MAX_ROWS)).round().astype(np.int64))


def plot_label_skew(manifest: Manifest, path: Path) -> None:
    clients = manifest.clients
    shown = heatmap_rows(len(clients))
    hists = _histograms(clients, shown)
    shares = hists / np.maximum(hists.sum(axis=1, keepdims=True), 1)
    fig = _figure(2.5 + 0.35 * len(manifest.labels), 1.5 + min(0.16 * len(shown), 14))
    ax = fig.add_subplot()
    image = ax.imshow(shares, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    ax.set_xticks(range(len(manifest.labels)), manifest.labels, rotation=60, ha="right", fontsize=MIN_FONT_PT)
    if len(clients) <= 80:
        ax.set_yticks(range(len(clients)), [c.id for c in clients], fontsize=MIN_FONT_PT)
    else:
        ax.set_yticks([])
        every = len(shown) == len(clients)
        ax.set_ylabel(f"{len(clients)} clients" if every else f"{len(shown)} of {len(clients)} clients, evenly spaced")
    fig.colorbar(image, ax=ax, label="share of the client's examples")
    ax.set_title("Label skew: clients x labels")
    save_png(fig, path, tight=False, tight_layout=True)


def write_report(manifest: Manifest, folder: Path) -> list[Path]:
    """Write the summary, the clients' table and the plots into ``folder``; returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    summary = partition_summary(manifest)
    (folder / SUMMARY).write_text(json.dumps(summary, indent=2), encoding="utf-8")
    (folder / MARKDOWN).write_text(summary_markdown(summary), encoding="utf-8")
    (folder / CLIENTS_CSV).write_text(clients_csv(manifest), encoding="utf-8")
    written = [folder / SUMMARY, folder / MARKDOWN, folder / CLIENTS_CSV]
    if manifest.clients:
        plot_sizes(manifest, folder / SIZES_PNG)
        written += [folder / SIZES_PNG, (folder / SIZES_PNG).with_suffix(".svg")]
        if _histograms(manifest.clients, np.arange(1)).shape[1]:
            plot_label_skew(manifest, folder / SKEW_PNG)
            written += [folder / SKEW_PNG, (folder / SKEW_PNG).with_suffix(".svg")]
    return written
