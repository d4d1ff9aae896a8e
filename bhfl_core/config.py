"""Experiment configuration: YAML validated into typed, frozen pydantic objects.

Every model forbids unknown keys, so a typo is an error that names the key. Level
settings (``tree.root``, ``tree.server``, ``tree.edge``, ``tree.client``) give the
defaults of each level; ``tree.nodes`` overrides them for single nodes by id. See
docs/config.md for every key with an example.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from bhfl_core.node_opt import available_node_opts


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------- data

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


class EmbeddedSource(Strict):
    """The offline generated multilingual news corpus (XGLUE NC schema)."""

    kind: Literal["embedded"] = "embedded"
    languages: list[str] = ["en", "de", "es", "fr", "ru"]
    shared_cue_strength: Annotated[float, Field(ge=0, le=1)] = 0.6
    topic_strength: Annotated[float, Field(ge=0, le=1)] = 0.25

    _langs = field_validator("languages")(_unique_languages)


# XGLUE configs usable as federated classification data: text columns, label column, languages.
XGLUE_TASKS: dict[str, tuple[tuple[str, ...], str, tuple[str, ...]]] = {
    "nc": (("news_title", "news_body"), "news_category", ("de", "en", "es", "fr", "ru")),
    "xnli": (("premise", "hypothesis"), "label",
             ("ar", "bg", "de", "el", "en", "es", "fr", "hi", "ru", "sw", "th", "tr", "ur", "vi", "zh")),
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
    Annotated[EmbeddedSource, Tag("embedded")] | Annotated[XglueSource, Tag("xglue")]
    | Annotated[PreparedSource, Tag("prepared")],
    Discriminator(_kind("embedded"), custom_error_type="kind",
                  custom_error_message="kind must be one of: embedded, xglue, prepared"),
]
ClusteringConfig = Annotated[
    Annotated[LanguageClustering, Tag("language")] | Annotated[KMeansClustering, Tag("kmeans")],
    Discriminator(_kind("language"), custom_error_type="kind",
                  custom_error_message="kind must be one of: language, kmeans"),
]


class DataConfig(Strict):
    source: SourceConfig = EmbeddedSource()
    task: Literal["classification", "mlm"] = "classification"
    clients_per_language: Annotated[int, Field(gt=0)] = 6
    dirichlet_alpha: Annotated[float, Field(gt=0)] = 0.5
    sizes: SizeDistribution = SizeDistribution()
    test_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.2
    proxy: ProxySpec = ProxySpec()
    clustering: ClusteringConfig = LanguageClustering()

    @model_validator(mode="after")
    def _consistent(self) -> DataConfig:
        c = self.clustering
        if isinstance(c, LanguageClustering) and c.edges_per_language > self.clients_per_language:
            raise ValueError(f"clustering.edges_per_language ({c.edges_per_language}) exceeds "
                             f"clients_per_language ({self.clients_per_language}): an edge server needs clients")
        total = self.clients_per_language * len(self.source.languages)
        if isinstance(c, KMeansClustering) and c.clusters > total:
            raise ValueError(f"clustering.clusters ({c.clusters}) exceeds the number of clients ({total})")
        ps = self.proxy.source
        if ps is not None and self.task == "classification" and ps.label_column is None:
            raise ValueError("proxy.source.label_column: a classification task trains on proxy labels; "
                             "name the label column (or use task: mlm, or drop proxy.source to carve the proxy from the pool)")
        if ps is not None and not ps.per_language and ps.language_column is None:
            if any(s != "root" for s in self.proxy.servers):
                raise ValueError("proxy.servers: only the root can hold a proxy corpus without languages "
                                 "(set proxy.source.language_column or put {lang} in its name/split/data_files)")
        return self

    def cluster_names(self) -> list[str]:
        """What ``tree.groups`` maps to intermediate servers: languages, or k-means clusters c0..cK-1."""
        if isinstance(self.clustering, KMeansClustering):
            return [f"c{k}" for k in range(self.clustering.clusters)]
        return list(self.source.languages)


# ---------------------------------------------------------------- model

class TinyBert(Strict):
    """A small BERT built from a config (no download); the tokenizer is trained on proxy data."""

    vocab_size: Annotated[int, Field(ge=100)] = 3000
    hidden_size: Annotated[int, Field(gt=0)] = 64
    num_hidden_layers: Annotated[int, Field(gt=0)] = 2
    num_attention_heads: Annotated[int, Field(gt=0)] = 2
    intermediate_size: Annotated[int, Field(gt=0)] = 128
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0

    @model_validator(mode="after")
    def _heads(self) -> TinyBert:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        return self


class ModelConfig(Strict):
    """``name: tiny-bert`` builds ``tiny``; any other name (hub id or local folder) goes through
    ``AutoModelForSequenceClassification`` / ``AutoModelForMaskedLM.from_pretrained`` (by ``data.task``)."""

    name: str = "tiny-bert"
    revision: str | None = None  # hub revision (branch, tag or commit) of model and tokenizer
    tiny: TinyBert = TinyBert()
    max_length: Annotated[int, Field(ge=8)] = 64
    truncation: Literal["longest_first", "only_first", "only_second"] = "longest_first"
    mlm_probability: Annotated[float, Field(gt=0, lt=1)] = 0.15  # masked-LM: share of tokens masked
    init_seed_offset: int = 0


# ---------------------------------------------------------------- tree

OptKind = str


class OptSettings(Strict):
    kind: OptKind = "fedavg"
    beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Field(ge=0, lt=1)] = 0.99
    tau: Annotated[float, Field(gt=0)] = 1e-3

    @field_validator("kind")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in available_node_opts():
            raise ValueError(f"unknown NODEOPT {v!r}; choose one of {available_node_opts()}")
        return v


class TrainSettings(Strict):
    lr: Annotated[float, Field(gt=0)] = 1e-3
    epochs: Annotated[int, Field(ge=1)] = 1
    max_steps: Annotated[int, Field(ge=1)] | None = None
    batch_size: Annotated[int, Field(ge=1)] = 32
    optimizer: Literal["adamw", "sgd"] = "adamw"
    weight_decay: Annotated[float, Field(ge=0)] = 0.0


class LevelSettings(Strict):
    """Settings of one level of the tree (all optional in YAML: defaults below)."""

    rounds: Annotated[int, Field(ge=1)] = 1
    cohort: Annotated[int, Field(ge=1)] | Annotated[float, Field(gt=0, le=1)] | None = None
    eta_up: Annotated[float, Field(gt=0)] = 1.0
    eta_down: Annotated[float, Field(gt=0)] = 1.0
    opt_up: OptSettings = OptSettings()
    opt_down: OptSettings = OptSettings()
    persistent: bool = True
    train: TrainSettings = TrainSettings()
    proxy_train: bool = False  # servers: TRAIN on the proxy split after aggregating


class NodeOverride(Strict):
    """Per-node override: any subset of LevelSettings keys."""

    rounds: Annotated[int, Field(ge=1)] | None = None
    cohort: Annotated[int, Field(ge=1)] | Annotated[float, Field(gt=0, le=1)] | None = None
    eta_up: Annotated[float, Field(gt=0)] | None = None
    eta_down: Annotated[float, Field(gt=0)] | None = None
    opt_up: OptSettings | None = None
    opt_down: OptSettings | None = None
    persistent: bool | None = None
    train: TrainSettings | None = None
    proxy_train: bool | None = None


class UpResidual(Strict):
    """Up-residual rule: each ``from`` server sends K of its children's models to ``to``.

    ``from`` / ``to`` name a level (``root``, ``server``, ``edge``) or a node id; ``to``
    must be an ancestor of ``from`` (the selected child models skip ``from``'s aggregation).
    ``combine: each`` sends the K models with their example weights; ``mean`` sends
    their plain mean as one model of weight 1 (one vote per sending server).
    ``opt`` / ``eta`` configure the receiving node's optimiser for this input kind;
    unset, they copy the receiver's ``opt_up`` / ``eta_up`` (with a state of their own).
    """

    source: str = Field(alias="from")
    to: str
    k: Annotated[int, Field(ge=1)] = 1
    select: Literal["l2", "loss", "cosine"] = "l2"
    combine: Literal["each", "mean"] = "each"
    eta: Annotated[float, Field(gt=0)] | None = None
    opt: OptSettings | None = None


class DownResidual(Strict):
    """Down-residual rule: each ``from`` server sends its round-start model to ``to``.

    ``to`` (a level or node id) must be a descendant of ``from``. The receiver
    folds it into its next down-aggregation with ``opt`` / ``eta`` (default: its
    ``opt_down`` / ``eta_down``, with a state of their own).
    """

    source: str = Field(alias="from")
    to: str
    eta: Annotated[float, Field(gt=0)] | None = None
    opt: OptSettings | None = None


class ResidualsConfig(Strict):
    up: list[UpResidual] = []
    down: list[DownResidual] = []


class TreeConfig(Strict):
    """root -> intermediate servers (``groups``) -> one edge server per language -> clients.

    ``groups`` maps each intermediate server to the languages (edge servers) under it;
    leave it empty for root -> edges directly. ``flat: true`` puts every client
    directly under the root (classic one-server FL: FedAvg / FedOPT baselines).
    """

    flat: bool = False
    groups: dict[str, list[str]] = {}
    root: LevelSettings = LevelSettings(rounds=4, proxy_train=True)
    server: LevelSettings = LevelSettings()
    edge: LevelSettings = LevelSettings(rounds=2)
    client: LevelSettings = LevelSettings()
    nodes: dict[str, NodeOverride] = {}
    residuals: ResidualsConfig = ResidualsConfig()


# ---------------------------------------------------------------- runtime / eval

class RuntimeConfig(Strict):
    """Where and how the work runs; none of these keys changes the results of a run.

    ``executor``: where client training, proxy training and evaluation run.
    ``local`` (default) starts a Dask cluster of worker processes on 127.0.0.1 for the
    run; ``cluster`` uses the Dask scheduler at ``cluster`` (``tcp://host:8786``), whose
    workers must see the run folder and the data cache at the same paths; ``inprocess``
    trains in the orchestrating process, one client at a time (debugging). ``workers``:
    worker processes of the local cluster (``auto``: one per GPU times
    ``workers_per_device``, or two sharing the CPU cores), or how many of the cluster's
    workers to use (``auto``: all). ``placement``: how a round's clients are spread over
    the workers (``lpt``: by optimizer steps, largest first; ``round_robin``;
    ``learned``: by time predicted from what each device kind measured).
    ``parallel_subtrees``: sibling servers of one round execute at the same time.
    ``subflow_depth``: internal nodes down to this depth (root = 0) execute as Prefect
    subflows, deeper ones inside their parent's subflow (their worker batches still are
    tasks); ``null``: every internal node is a subflow (the Prefect UI shows the tree).
    ``retries``: Prefect retries of a failed task (a worker's batch of clients, proxy
    training, an evaluation); finished clients of a retried batch are not trained again.
    ``on_client_failure``: a client that still fails after the retries either fails its
    node (``fail``: the run stops and can be resumed) or is left out of that round's
    aggregate (``drop``: logged and counted as ``train/dropped_clients``). Resource
    errors (out of memory, disk full) always fail.
    """

    executor: Literal["local", "cluster", "inprocess"] = "local"
    cluster: str | None = None
    workers: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    workers_per_device: Annotated[int, Field(ge=1)] = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    placement: Literal["lpt", "round_robin", "learned"] = "lpt"
    parallel_subtrees: bool = True
    subflow_depth: Annotated[int, Field(ge=0)] | None = None
    torch_threads: Annotated[int, Field(ge=1)] | None = None
    retries: Annotated[int, Field(ge=0)] = 1
    retry_delay_s: Annotated[float, Field(ge=0)] = 1.0
    on_client_failure: Literal["fail", "drop"] = "fail"

    @field_validator("cluster")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("tcp://", "tls://", "ucx://", "inproc://")):
            hint = " (Ray clusters are not supported: start a Dask scheduler instead)" if v.startswith("ray://") else ""
            raise ValueError(f"{v!r} is not a Dask scheduler address such as tcp://127.0.0.1:8786{hint}")
        return v

    @model_validator(mode="after")
    def _cluster_for_executor(self) -> RuntimeConfig:
        if self.executor == "cluster" and self.cluster is None:
            raise ValueError("executor: cluster needs runtime.cluster, the Dask scheduler's address (tcp://host:8786)")
        if self.executor != "cluster" and self.cluster is not None:
            raise ValueError(f"cluster is set but executor is {self.executor!r}; set runtime.executor: cluster to use it")
        return self


class LocalOnlyBaseline(Strict):
    """Each client trained from the initial model on its own train split only (no federation).

    ``rounds``: TRAIN calls with the client level's ``train`` settings; ``matched`` gives
    each client as many as it made in the federation (its round counter; at least 1).
    """

    rounds: Annotated[int, Field(ge=1)] | Literal["matched"] = "matched"


class LocalAdaptation(Strict):
    """Each client fine-tunes a final model (its parent server's, or the root's) on its own data."""

    source: Literal["parent", "root"] = Field("parent", alias="from")
    rounds: Annotated[int, Field(ge=1)] = 1  # TRAIN calls with the client level's train settings


class EvalConfig(Strict):
    every: Annotated[int, Field(ge=0)] = 0  # evaluate every N root rounds (0: only at the end)
    batch_size: Annotated[int, Field(ge=1)] = 256
    client_models: bool = True  # also evaluate persistent client models
    local_only: LocalOnlyBaseline | None = None  # final evaluation: the local-only baseline (off: null)
    local_adaptation: LocalAdaptation | None = None  # final evaluation: locally fine-tuned models (off: null)


class ExperimentConfig(Strict):
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")] = "bhfl"
    seed: int = 0
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    tree: TreeConfig = TreeConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    eval: EvalConfig = EvalConfig()

    @model_validator(mode="after")
    def _groups(self) -> ExperimentConfig:
        languages = self.data.cluster_names()  # languages, or k-means clusters c0..cK-1
        where = ("data.clustering (k-means clusters)" if isinstance(self.data.clustering, KMeansClustering)
                 else "data.source.languages")
        if self.tree.flat and self.tree.groups:
            raise ValueError("tree.flat: a flat tree (root -> clients) cannot also have tree.groups")
        seen: dict[str, str] = {}
        for group, langs in self.tree.groups.items():
            if group in languages or group == "root":
                raise ValueError(f"tree.groups.{group}: a group name must differ from 'root' and from language/cluster names")
            if not langs:
                raise ValueError(f"tree.groups.{group}: an intermediate server needs at least one language")
            for lang in langs:
                if lang not in languages:
                    noun = "cluster" if where.startswith("data.clustering") else "language"
                    raise ValueError(f"tree.groups.{group}: {noun} {lang!r} is not in {where} {languages}")
                if lang in seen:
                    raise ValueError(f"tree.groups.{group}: language {lang!r} is already under group {seen[lang]!r}")
                seen[lang] = group
        if self.tree.groups:
            missing = [lang for lang in languages if lang not in seen]
            if missing:
                raise ValueError(f"tree.groups: languages {missing} are not under any intermediate server")
        return self


def dump(config: ExperimentConfig) -> dict[str, Any]:
    """The resolved config as plain data (JSON/YAML-safe)."""
    return config.model_dump(mode="json", by_alias=True)


class ConfigError(ValueError):
    """A user mistake in the config; the message names the offending key."""
