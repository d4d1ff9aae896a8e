"""Experiment configuration: YAML validated into typed, frozen pydantic objects.

Every model forbids unknown keys, so a typo is an error that names the key. Level
settings (``tree.root``, ``tree.server``, ``tree.edge``, ``tree.client``) give the
defaults of each level; ``tree.nodes`` overrides them for single nodes by id. See
docs/config.md for every key with an example.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from bhfl_core.node_opt import available_node_opts


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------- data

class SizeDistribution(Strict):
    """Long-tailed client sizes: lognormal(log(median), sigma), clipped to [min, max]."""

    median: Annotated[int, Field(gt=0)] = 120
    sigma: Annotated[float, Field(ge=0)] = 0.8
    min: Annotated[int, Field(ge=2)] = 20  # >= 2: every client needs a train and a test example
    max: Annotated[int, Field(gt=0)] = 1000

    @model_validator(mode="after")
    def _bounds(self) -> SizeDistribution:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


class EmbeddedSource(Strict):
    """The offline generated multilingual news corpus (XGLUE NC schema)."""

    kind: Literal["embedded"] = "embedded"
    languages: list[str] = ["en", "de", "es", "fr", "ru"]
    shared_cue_strength: Annotated[float, Field(ge=0, le=1)] = 0.6
    topic_strength: Annotated[float, Field(ge=0, le=1)] = 0.25

    @field_validator("languages")
    @classmethod
    def _langs(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("at least one language is required")
        if len(set(v)) != len(v):
            raise ValueError(f"languages must be unique, got {v}")
        return v


class ProxySpec(Strict):
    """Language-balanced public proxy data, carved out before the clients.

    ``servers`` lists who holds a proxy split (node ids or the levels ``root``,
    ``server``, ``edge``): the root holds all of it; any other server holds the
    language-group share of the languages under it. Only holders may ``proxy_train``.
    """

    train_per_language: Annotated[int, Field(ge=0)] = 200
    test_per_language: Annotated[int, Field(ge=0)] = 100
    servers: list[str] = ["root"]


class DataConfig(Strict):
    source: EmbeddedSource = EmbeddedSource()
    clients_per_language: Annotated[int, Field(gt=0)] = 6
    dirichlet_alpha: Annotated[float, Field(gt=0)] = 0.5
    sizes: SizeDistribution = SizeDistribution()
    test_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.2
    proxy: ProxySpec = ProxySpec()


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
    """``name: tiny-bert`` builds ``tiny``; any other name is loaded with AutoModel*.from_pretrained."""

    name: str = "tiny-bert"
    tiny: TinyBert = TinyBert()
    max_length: Annotated[int, Field(ge=8)] = 64
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
    workers: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    torch_threads: Annotated[int, Field(ge=1)] | None = None


class EvalConfig(Strict):
    every: Annotated[int, Field(ge=0)] = 0  # evaluate every N root rounds (0: only at the end)
    batch_size: Annotated[int, Field(ge=1)] = 256
    client_models: bool = True  # also evaluate persistent client models


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
        languages = self.data.source.languages
        if self.tree.flat and self.tree.groups:
            raise ValueError("tree.flat: a flat tree (root -> clients) cannot also have tree.groups")
        seen: dict[str, str] = {}
        for group, langs in self.tree.groups.items():
            if group in languages or group == "root":
                raise ValueError(f"tree.groups.{group}: a group name must differ from 'root' and from language names")
            if not langs:
                raise ValueError(f"tree.groups.{group}: an intermediate server needs at least one language")
            for lang in langs:
                if lang not in languages:
                    raise ValueError(f"tree.groups.{group}: language {lang!r} is not in data.source.languages {languages}")
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
