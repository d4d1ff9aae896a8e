"""The ``data`` section of an experiment config: sources, partition, proxy, clustering.

Data preparation (``data_prep``) reads these; the experiment schema (``schema.py``)
holds a ``DataConfig``. See docs/config.md and docs/data.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from bhfl_core.config.base import Strict
from bhfl_core.learning.task_kinds import available_task_kinds, get_task_kind


class SizeDistribution(Strict):
    """Long-tailed client sizes (train + test), rounded and clipped to [min, max].

    ``lognormal``: lognormal(log(median), sigma). ``powerlaw``: a Pareto law with
    minimum ``min`` and tail exponent ``exponent`` (P(size > s) = (min / s)^exponent),
    i.e. most clients near ``min`` and a few very large ones.
    """

    distribution: Literal["lognormal", "powerlaw"] = "lognormal"
    median: Annotated[int, Field(gt=0)] = 120
    sigma: Annotated[float, Field(ge=0)] = 0.8
    exponent: Annotated[float, Field(gt=0)] = 1.5
    min: Annotated[int, Field(ge=2)] = 20  # >= 2: every client needs a train and a test example
    max: Annotated[int, Field(gt=0)] = 1000

    @model_validator(mode="after")
    def _bounds(self) -> SizeDistribution:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


def _unique_languages(v: list[str]) -> list[str]:
    if not v:
        raise ValueError("at least one language is required")
    if len(set(v)) != len(v):
        raise ValueError(f"languages must be unique, got {v}")
    return v


# The languages the embedded generator has a vocabulary for (data_prep/embedded.py, ``_SYLLABLES``).
EMBEDDED_LANGUAGES = ("de", "en", "es", "fr", "ru")


class EmbeddedSource(Strict):
    """The offline generated multilingual news corpus (XGLUE NC schema)."""

    kind: Literal["embedded"] = "embedded"
    languages: list[str] = ["en", "de", "es", "fr", "ru"]
    shared_cue_strength: Annotated[float, Field(ge=0, le=1)] = 0.6
    topic_strength: Annotated[float, Field(ge=0, le=1)] = 0.25

    _langs = field_validator("languages")(_unique_languages)

    @field_validator("languages")
    @classmethod
    def _known_languages(cls, v: list[str]) -> list[str]:
        """Checked with the config, not when the corpus is generated (mid-preparation, as a traceback)."""
        unknown = [lang for lang in v if lang not in EMBEDDED_LANGUAGES]
        if unknown:
            raise ValueError(f"the embedded corpus has no language {unknown} (it has {list(EMBEDDED_LANGUAGES)})")
        return v


# XGLUE configs usable as federated classification data: text columns, label column, languages.
XGLUE_TASKS: dict[str, tuple[tuple[str, ...], str, tuple[str, ...]]] = {
    "nc": (("news_title", "news_body"), "news_category", ("de", "en", "es", "fr", "ru")),
    "xnli": (
        ("premise", "hypothesis"),
        "label",
        ("ar", "bg", "de", "el", "en", "es", "fr", "hi", "ru", "sw", "th", "tr", "ur", "vi", "zh"),
    ),
    "paws-x": (("sentence1", "sentence2"), "label", ("de", "en", "es", "fr")),
}


class XglueSource(Strict):
    """An XGLUE config through HF ``datasets``: from the hub, or from local parquet files.

    XGLUE has training text only in English (split ``train``); every language has
    ``validation.<lang>`` and ``test.<lang>``. The pool a language's clients and
    proxy share are drawn from is ``train_split`` for ``train_languages`` and
    ``pool_split`` (``{lang}`` replaced) for the others; ``test.<lang>`` is never read
    (held out). ``local_dir`` (a folder with ``<config>/<split>.parquet``, see
    docs/data.md) replaces the hub. ``text_columns`` / ``label_column`` override the
    config's columns (for mirrors that renamed them).
    """

    kind: Literal["xglue"] = "xglue"
    config: Literal["nc", "xnli", "paws-x"] = "nc"
    languages: list[str] = ["en", "de", "es", "fr", "ru"]
    repo: str = "microsoft/xglue"
    repo_config: str | None = None  # the hub repo's config name, when it differs from ``config``
    revision: str | None = None
    local_dir: str | None = None
    train_languages: list[str] = ["en"]
    train_split: str = "train"
    pool_split: str = "validation.{lang}"
    text_columns: Annotated[list[str], Field(min_length=1, max_length=2)] | None = None
    label_column: str | None = None

    _langs = field_validator("languages")(_unique_languages)

    @model_validator(mode="after")
    def _known_languages(self) -> XglueSource:
        known = XGLUE_TASKS[self.config][2]
        unknown = [lang for lang in self.languages if lang not in known]
        if unknown:
            raise ValueError(f"languages {unknown} are not in XGLUE {self.config!r} (it has {list(known)})")
        return self

    @model_validator(mode="after")
    def _a_split_per_language(self) -> XglueSource:
        """Languages that draw from one split name without ``{lang}`` would all get the same rows under their names."""
        trained = [lang for lang in self.languages if lang in self.train_languages]
        pooled = [lang for lang in self.languages if lang not in self.train_languages]
        for key, split, langs in (("train_split", self.train_split, trained), ("pool_split", self.pool_split, pooled)):
            if len(langs) > 1 and "{lang}" not in split:
                raise ValueError(
                    f"{key}: {split!r} has no {{lang}}, so languages {langs} would all draw their pool from that one "
                    "split (the same rows under each name); put {lang} where the split names the language"
                )
        return self

    def columns(self) -> tuple[list[str], str]:
        """(text columns, label column) after overrides."""
        texts, label, _ = XGLUE_TASKS[self.config]
        return list(self.text_columns or texts), self.label_column or label


class ProxySource(Strict):
    """A separate proxy corpus (kept at the root): any HF dataset or local parquet with a text column.

    Exactly one of ``repo`` (a hub dataset id, with ``name`` / ``revision``) and
    ``data_files`` (local parquet paths or globs) is set. ``{lang}`` in ``name``,
    ``split`` or ``data_files`` loads one dataset per language; otherwise
    ``language_column`` names each row's language; with neither, the proxy is not
    language-balanced (and only the root can hold it). ``label_column`` is required
    for classification (proxy training needs labels). ``streaming`` reads only the
    rows needed (a seeded shuffle buffer of ``shuffle_buffer`` rows) from large
    hub corpora instead of downloading them whole.
    """

    repo: str | None = None
    name: str | None = None
    revision: str | None = None
    data_files: str | list[str] | None = None
    split: str = "train"
    text_columns: Annotated[list[str], Field(min_length=1, max_length=2)] = ["text"]
    label_column: str | None = None
    language_column: str | None = None
    streaming: bool = False
    shuffle_buffer: Annotated[int, Field(ge=1)] = 10_000

    @model_validator(mode="after")
    def _one_location(self) -> ProxySource:
        if (self.repo is None) == (self.data_files is None):
            raise ValueError("set exactly one of repo (a hub dataset) and data_files (local parquet files)")
        return self

    @property
    def per_language(self) -> bool:
        """Whether one dataset is loaded per language (``{lang}`` in name, split or data_files)."""
        files = self.data_files if isinstance(self.data_files, list) else [self.data_files or ""]
        return any("{lang}" in (v or "") for v in (self.name, self.split, *files))


class ProxySpec(Strict):
    """Language-balanced public proxy data, carved out before the clients.

    ``servers`` lists who holds a proxy split (node ids or the levels ``root``,
    ``server``, ``edge``): the root holds all of it; any other server holds the
    language-group share of the languages under it. Only holders may ``proxy_train``.
    """

    train_per_language: Annotated[int, Field(ge=0)] = 200
    test_per_language: Annotated[int, Field(ge=0)] = 100
    servers: list[str] = ["root"]
    source: ProxySource | None = None  # None: carved from the client pool (language-balanced)


class LanguageClustering(Strict):
    """Edge servers by language: ``edges_per_language`` edge servers per language.

    With one, the edge of language ``xx`` is ``edge-xx``; with several, the
    language's clients (in id order) are cut into that many contiguous, near-equal
    blocks: ``edge-xx-0``, ``edge-xx-1``, ...
    """

    kind: Literal["language"] = "language"
    edges_per_language: Annotated[int, Field(ge=1)] = 1


class KMeansClustering(Strict):
    """Edge servers by k-means over a cheap client embedding (for data without natural clusters).

    ``features``: ``label_hist`` (the client's normalised training label histogram)
    or ``tokens`` (its mean token-frequency vector, token ids hashed into
    ``token_buckets`` buckets). Edge servers are ``edge-c0`` ... ``edge-c<K-1>``;
    ``tree.groups`` then maps intermediate servers to cluster names ``c0``, ``c1``...
    """

    kind: Literal["kmeans"] = "kmeans"
    clusters: Annotated[int, Field(ge=1)] = 4
    features: Literal["label_hist", "tokens"] = "label_hist"
    token_buckets: Annotated[int, Field(ge=8)] = 4096


def _kind(default: str) -> Callable[[Any], str]:
    """Discriminator of a ``kind``-tagged union; a mapping without ``kind`` is the default kind."""

    def get(value: Any) -> str:
        return value.get("kind", default) if isinstance(value, dict) else getattr(value, "kind", default)

    return get


class PreparedSource(Strict):
    """A federated dataset already in bhfl's prepared form: ``path`` holds a ``manifest.json``
    (clients with their language, edge and shard paths; proxy shards; task, labels and
    tokenizer facts) and the pre-tokenised Arrow shards it names (``datasets``'
    ``save_to_disk``). Nothing is partitioned or tokenised; ``languages`` must be the
    manifest's client languages (checked when the data is loaded). docs/data.md shows
    the layout; benchmarks/workload.py writes one."""

    kind: Literal["prepared"] = "prepared"
    path: Annotated[str, Field(min_length=1)]
    languages: list[str]

    _langs = field_validator("languages")(_unique_languages)


SourceConfig = Annotated[
    Annotated[EmbeddedSource, Tag("embedded")]
    | Annotated[XglueSource, Tag("xglue")]
    | Annotated[PreparedSource, Tag("prepared")],
    Discriminator(
        _kind("embedded"),
        custom_error_type="kind",
        custom_error_message="kind must be one of: embedded, xglue, prepared",
    ),
]
ClusteringConfig = Annotated[
    Annotated[LanguageClustering, Tag("language")] | Annotated[KMeansClustering, Tag("kmeans")],
    Discriminator(
        _kind("language"), custom_error_type="kind", custom_error_message="kind must be one of: language, kmeans"
    ),
]


class DataConfig(Strict):
    source: SourceConfig = EmbeddedSource()
    task: str = "classification"  # a kind of bhfl_core.learning.task_kinds
    clients_per_language: Annotated[int, Field(gt=0)] = 6
    dirichlet_alpha: Annotated[float, Field(gt=0)] = 0.5
    sizes: SizeDistribution = SizeDistribution()
    test_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.2
    proxy: ProxySpec = ProxySpec()
    clustering: ClusteringConfig = LanguageClustering()

    @field_validator("task")
    @classmethod
    def _known_task(cls, v: str) -> str:
        get_task_kind(v)  # unknown: a ValueError naming it and the available tasks
        return v

    @model_validator(mode="after")
    def _consistent(self) -> DataConfig:
        c = self.clustering
        if isinstance(c, LanguageClustering) and c.edges_per_language > self.clients_per_language:
            raise ValueError(
                f"clustering.edges_per_language ({c.edges_per_language}) exceeds "
                f"clients_per_language ({self.clients_per_language}): an edge server needs clients"
            )
        total = self.clients_per_language * len(self.source.languages)
        if isinstance(c, KMeansClustering) and c.clusters > total:
            raise ValueError(f"clustering.clusters ({c.clusters}) exceeds the number of clients ({total})")
        ps = self.proxy.source
        if ps is not None and get_task_kind(self.task).needs_labels and ps.label_column is None:
            unlabelled = " or ".join(t for t in available_task_kinds() if not get_task_kind(t).needs_labels)
            raise ValueError(
                f"proxy.source.label_column: a {self.task} task trains on proxy labels; name the "
                f"label column (or use task: {unlabelled}, or drop proxy.source to carve the proxy "
                "from the pool)"
            )
        if (
            ps is not None
            and not ps.per_language
            and ps.language_column is None
            and any(s != "root" for s in self.proxy.servers)
        ):
            raise ValueError(
                "proxy.servers: only the root can hold a proxy corpus without languages "
                "(set proxy.source.language_column or put {lang} in its name/split/data_files)"
            )
        return self

    def cluster_names(self) -> list[str]:
        """What ``tree.groups`` maps to intermediate servers: languages, or k-means clusters c0..cK-1."""
        if isinstance(self.clustering, KMeansClustering):
            return [f"c{k}" for k in range(self.clustering.clusters)]
        return list(self.source.languages)
