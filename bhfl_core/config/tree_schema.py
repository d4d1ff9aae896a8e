"""The ``tree`` section of the experiment config: the tree's shape and each level's settings.

``LevelSettings`` gives the defaults of one level (``tree.root``, ``tree.server``,
``tree.edge``, ``tree.client``); ``NodeOverride`` overrides them for the intermediate
servers of one depth (``tree.levels``) or for single nodes by id (``tree.nodes``);
``topology.py`` resolves them per node. ``schema.py`` re-exports every class here
(callers import them from there). See docs/config.md for every key with an example.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, field_validator, model_serializer, model_validator

from bhfl_core.algorithm.node_opt import available_node_opts
from bhfl_core.algorithm.residuals import SELECTORS
from bhfl_core.algorithm.rules import available_rules, rule_traits
from bhfl_core.config.base import Strict
from bhfl_core.config.wrapper_schema import (
    CompressDownSettings,
    CompressSettings,
    PrivacySettings,
    SecureAggregationSettings,
    WrapSettings,
)

OptKind = str


class OptSettings(Strict):
    """A NODEOPT: ``kind`` (fedavg, fedavgm, fedadagrad, fedadam, fedyogi, interp) and its hyperparameters.

    ``alphas``: ``interp``'s grid; each step keeps ``alpha * own + (1 - alpha) * input``
    for the alpha with the lowest loss on the node's held-out rows (``holdout``).
    """

    kind: OptKind = "fedavg"
    beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Field(ge=0, lt=1)] = 0.99
    tau: Annotated[float, Field(gt=0)] = 1e-3
    alphas: Annotated[list[Annotated[float, Field(ge=0, le=1)]], Field(min_length=1)] = [0.0, 0.25, 0.5, 0.75, 1.0]

    @field_validator("kind")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in available_node_opts():
            raise ValueError(f"unknown NODEOPT {v!r}; choose one of {available_node_opts()}")
        return v

    @model_validator(mode="after")
    def _read_by_kind(self) -> OptSettings:
        """A hyperparameter the kind does not read (``beta2`` of ``fedavgm``, ``tau`` of ``fedavg``) would be
        silently ignored: an error, unless it holds its default (every saved config writes every key)."""
        for key in OPT_PARAMETERS:
            value = getattr(self, key)
            if key not in OPT_READS.get(self.kind, OPT_PARAMETERS) and value != type(self).model_fields[key].default:
                readers = [k for k, reads in OPT_READS.items() if key in reads]
                raise ValueError(f"{key}: {value} is read by kind {' or '.join(readers)}, not by {self.kind!r}")
        return self


OPT_PARAMETERS = ("beta1", "beta2", "tau", "alphas")
OPT_READS: dict[str, tuple[str, ...]] = {
    "fedavg": (),
    "fedavgm": ("beta1",),
    "fedadagrad": ("beta1", "tau"),
    "fedadam": ("beta1", "beta2", "tau"),
    "fedyogi": ("beta1", "beta2", "tau"),
    "interp": ("alphas",),
}
"""The hyperparameters each NODEOPT reads (``node_opt.py``); a kind registered elsewhere reads them all."""


RULE_PARAMETERS = ("trim", "byzantine", "keep")
"""``aggregate`` keys a rule may read besides ``kind`` (``RuleTraits.params``)."""


class AggregateSettings(Strict):
    """How a server folds its children's models into the input its NODEOPT_up steps towards.

    ``kind``: a registered aggregation rule (``bhfl_core/algorithm/aggregation_rule.py``);
    ``mean`` (default) is the exact example-weighted mean; ``median``, ``trimmed_mean`` and
    ``krum`` are Byzantine-robust (``robust_rules.py``), ``fednova`` normalises by local steps
    (``fednova_rule.py``). ``compress``: the children send compressed updates instead of their
    models (none: models as they are). ``trim`` (trimmed_mean [0.1]): the fraction cut from
    each end, in [0, 0.5); ``byzantine`` (krum [0]): the f children tolerated; ``keep``
    (krum [1]): Multi-Krum's m (1: Krum). A key the kind does not read is an error.

    ``wrap``: wrappers around the rule, outermost first, each ``{name: {its keys}}`` (or
    just ``name`` with its defaults): ``compress``, ``zeroing``, ``dp``, ``secagg``, in that
    order (docs/config.md, "Aggregation rules and wrappers"). ``privacy:`` and
    ``secure_aggregation:`` beside ``aggregate:``, and ``compress`` here, are shorthands for
    the ``dp``, ``secagg`` and ``compress`` wrappers.
    """

    kind: str = "mean"
    wrap: list[WrapSettings] = []
    compress: CompressSettings | None = None
    trim: float | None = None
    byzantine: int | None = None
    keep: int | None = None

    @field_validator("kind")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in available_rules():
            raise ValueError(f"unknown aggregation rule {v!r}; choose one of {available_rules()}")
        return v

    @field_validator("trim")
    @classmethod
    def _trim(cls, v: float | None) -> float | None:
        if v is not None and not 0 <= v < 0.5:
            raise ValueError(f"trim is the fraction cut from each end of every coordinate: in [0, 0.5), got {v}")
        return v

    @field_validator("byzantine")
    @classmethod
    def _byzantine(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError(f"byzantine counts the children Krum tolerates: 0 or more, got {v}")
        return v

    @field_validator("keep")
    @classmethod
    def _keep(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"keep is how many models Multi-Krum averages (1: Krum): 1 or more, got {v}")
        return v

    @model_serializer(mode="wrap")
    def _without_unset_parameters(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Rule parameters left unset are not written: a config that sets none dumps (and hashes, ``sweep.py``
        ``config_hash``) as before they existed, so sweeps started earlier still recognise their finished runs."""
        data: dict[str, Any] = handler(self)
        unset = {k for k in RULE_PARAMETERS if data.get(k) is None} | ({"wrap"} if not self.wrap else set())
        return {k: v for k, v in data.items() if k not in unset}

    @model_validator(mode="after")
    def _read_by_kind(self) -> AggregateSettings:
        """A rule parameter set for a kind that does not read it would be silently ignored: an error instead."""
        reads = rule_traits(self.kind).params
        for key in RULE_PARAMETERS:
            if getattr(self, key) is not None and key not in reads:
                readers = [r for r in available_rules() if key in rule_traits(r).params]
                raise ValueError(
                    f"{key}: {getattr(self, key)} is read by kind {' or '.join(readers)}, not by {self.kind!r}"
                )
        return self


class DpSgdSettings(Strict):
    """Sample-level DP-SGD in clients' TRAIN (Opacus; docs/privacy.md): per-example clipping and Gaussian noise."""

    noise_multiplier: Annotated[float, Field(ge=0)]
    max_grad_norm: Annotated[float, Field(gt=0)]
    delta: Annotated[float, Field(gt=0, lt=1)] = 1e-5
    accountant: Literal["pld", "rdp"] = "rdp"  # rdp: computed for every client every round (pld: ~0.3 s each)


class TrainSettings(Strict):
    lr: Annotated[float, Field(gt=0)] = 1e-3
    epochs: Annotated[int, Field(ge=1)] = 1
    max_steps: Annotated[int, Field(ge=1)] | None = None
    batch_size: Annotated[int, Field(ge=1)] = 32
    optimizer: Literal["adamw", "sgd"] = "adamw"
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    mu: Annotated[float, Field(ge=0)] = 0.0  # FedProx proximal coefficient (0: plain TRAIN)
    # the forward pass under torch autocast: bf16 / fp16 mixed precision (fp16 with gradient scaling)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    dp_sgd: DpSgdSettings | None = None  # clients: sample-level DP-SGD (per-example clipping, noise)


class StalenessSettings(Strict):
    """FedBuff's staleness weight ``w(s)`` (``bhfl_core/algorithm/asynchrony.py``)."""

    kind: Literal["constant", "poly", "hinge"] = "poly"
    a: Annotated[float, Field(gt=0)] = 0.5  # poly: exponent (0.5: 1/sqrt(1+s)); hinge: slope
    b: Annotated[float, Field(ge=0)] = 4.0  # hinge: staleness counted fully up to b


class LevelSettings(Strict):
    """Settings of one level of the tree (all optional in YAML: defaults below)."""

    rounds: Annotated[int, Field(ge=1)] = 1
    cohort: Annotated[int, Field(ge=1)] | Annotated[float, Field(gt=0, le=1)] | None = None
    sampling: Literal["fixed", "poisson"] = "fixed"  # poisson: each child called with chance `cohort`
    eta_up: Annotated[float, Field(ge=0)] = 1.0  # 0 with fedavg: keep the own model
    eta_down: Annotated[float, Field(ge=0)] = 1.0
    opt_up: OptSettings = OptSettings()
    opt_down: OptSettings = OptSettings()
    persistent: bool = True
    train: TrainSettings = TrainSettings()
    # servers: TRAIN on the proxy split after aggregating (true), or alongside the children
    # from the model they were sent, merged like one more child result ("async")
    proxy_train: bool | Literal["async"] = False
    holdout: Annotated[float, Field(ge=0, le=0.5)] = 0.0  # share of training rows kept out of TRAIN (interp tunes)
    personal: TrainSettings | None = None  # clients: Ditto's personal model (its mu is Ditto's lambda)
    mode: Literal["sync", "async"] = "sync"  # servers: async = FedBuff (rounds count buffer flushes)
    concurrency: Annotated[int, Field(ge=1)] = 4  # async: children in flight
    buffer: Annotated[int, Field(ge=1)] = 2  # async: results per NODEOPT_up step (FedBuff's K)
    staleness: StalenessSettings = StalenessSettings()
    aggregate: AggregateSettings = AggregateSettings()  # servers: how the children's models are folded
    compress_down: CompressDownSettings | None = None  # servers: compressed broadcasts to the children (downlink.py)
    privacy: PrivacySettings | None = None  # servers: DP-FedAvg on the children's updates (docs/privacy.md)
    secure_aggregation: SecureAggregationSettings | None = None  # servers: masked sums (docs/privacy.md)
    adapter_rank: Annotated[int, Field(ge=1)] | None = None  # LoRA: this node's rank, at most model.adapter.r


class NodeOverride(Strict):
    """Per-node override: any subset of LevelSettings keys.

    Only the keys written are dumped (``_only_written``): a key's absence means "the level's
    value", while ``cohort: null`` written means "all children", so a dump listing every key
    would read back with each inherited cohort replaced by all children (a resumed run, a
    sweep point, a pipeline stage or a served run trained other cohorts than the config said).
    """

    @model_validator(mode="before")
    @classmethod
    def _dumped_by_an_earlier_version(cls, data: Any) -> Any:
        """An entry listing every key is a run's ``config.yaml`` written before ``_only_written``: its
        ``cohort: null`` was not written by the user, so the level's cohort applies (as when the run started)."""
        if isinstance(data, dict) and set(cls.model_fields) <= set(data) and data.get("cohort") is None:
            return {k: v for k, v in data.items() if k != "cohort"}
        return data

    @model_serializer(mode="wrap")
    def _only_written(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if k in self.model_fields_set}

    rounds: Annotated[int, Field(ge=1)] | None = None
    cohort: Annotated[int, Field(ge=1)] | Annotated[float, Field(gt=0, le=1)] | None = None
    sampling: Literal["fixed", "poisson"] | None = None
    eta_up: Annotated[float, Field(ge=0)] | None = None
    eta_down: Annotated[float, Field(ge=0)] | None = None
    opt_up: OptSettings | None = None
    opt_down: OptSettings | None = None
    persistent: bool | None = None
    train: TrainSettings | None = None
    proxy_train: bool | Literal["async"] | None = None
    holdout: Annotated[float, Field(ge=0, le=0.5)] | None = None
    personal: TrainSettings | None = None
    mode: Literal["sync", "async"] | None = None
    concurrency: Annotated[int, Field(ge=1)] | None = None
    buffer: Annotated[int, Field(ge=1)] | None = None
    staleness: StalenessSettings | None = None
    aggregate: AggregateSettings | None = None
    compress_down: CompressDownSettings | None = None
    privacy: PrivacySettings | None = None
    secure_aggregation: SecureAggregationSettings | None = None
    adapter_rank: Annotated[int, Field(ge=1)] | None = None


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
    select: str = "l2"
    combine: Literal["each", "mean"] = "each"
    eta: Annotated[float, Field(gt=0)] | None = None
    opt: OptSettings | None = None

    @field_validator("select")
    @classmethod
    def _known_selector(cls, v: str) -> str:
        if v not in SELECTORS:
            raise ValueError(f"unknown residual selection {v!r}; choose one of {list(SELECTORS)}")
        return v


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


@dataclass(frozen=True)
class GroupSpec:
    """One intermediate server of ``tree.groups``, flattened out of the nesting.

    ``key``: where it is written (``tree.groups.europe.west``); ``depth``: its depth in
    the tree (root = 0, so a top-level group is 1); ``parent``: ``root`` or the
    enclosing group; ``members``: the languages / clusters whose edge servers it holds
    (``leaf``), or its sub-groups' names.
    """

    name: str
    key: str
    depth: int
    parent: str
    members: tuple[str, ...]
    leaf: bool


def _walk_groups(groups: dict[str, Any], key: str, depth: int, parent: str, out: list[GroupSpec]) -> None:
    for name, value in groups.items():
        here = f"{key}.{name}"
        if isinstance(value, dict):
            out.append(GroupSpec(name, here, depth, parent, tuple(value), leaf=False))
            _walk_groups(value, here, depth + 1, name, out)
        else:
            out.append(GroupSpec(name, here, depth, parent, tuple(value), leaf=True))


class ClockSettings(Strict):
    """The virtual clock of asynchronous nodes (``bhfl_core/algorithm/virtual_clock.py``).

    Client speeds (optimizer steps per virtual second) are log-normal with median 1 and
    spread ``sigma``, one per client or per ``group`` (language / cluster); a call
    lasts its steps over the speed (``straggler_factor`` times longer with probability
    ``straggler_p``) plus ``comm_s`` per model moved (two per call). With probability
    ``dropout_p`` a call drops out: the client does not train, and its parent (sync or
    async) learns of it when the call would have finished.
    """

    sigma: Annotated[float, Field(ge=0)] = 0.0
    per: Literal["client", "group"] = "client"
    comm_s: Annotated[float, Field(ge=0)] = 0.0
    straggler_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    straggler_factor: Annotated[float, Field(ge=1)] = 10.0
    dropout_p: Annotated[float, Field(ge=0, lt=1)] = 0.0  # chance a client call drops out (its result never arrives)


class TreeConfig(Strict):
    """root -> intermediate servers (``groups``, nested to any depth) -> edge servers -> clients.

    ``groups`` maps each intermediate server either to the languages (edge servers)
    under it or to a mapping of sub-groups (intermediate servers one level deeper),
    e.g. ``{europe: {west: [en, fr], east: [de]}, asia: [zh]}``; siblings may differ
    (a leaf group's edge servers are one level below it, wherever it is). Leave it
    empty for root -> edges directly. ``flat: true`` puts every client directly under
    the root (classic one-server FL: FedAvg / FedOPT baselines).

    Settings of a node: its level's block (``root``, ``server``, ``edge``, ``client``),
    then for intermediate servers ``levels.<depth>`` (root = 0), then ``nodes.<id>``.

    ``tempo: true`` (seeds/001): after every root round the root retunes the client
    epochs of each edge server (institution) for the next round with Eq. 9
    (``bhfl_core/algorithm/tempo.py``); only for root -> edge servers -> clients.
    """

    flat: bool = False
    groups: dict[str, Any] = {}  # name -> list of languages/clusters, or name -> {sub-group: ...}
    root: LevelSettings = LevelSettings(rounds=4, proxy_train=True)
    server: LevelSettings = LevelSettings()
    levels: dict[int, NodeOverride] = {}  # depth -> overrides of ``server`` for intermediate servers there
    edge: LevelSettings = LevelSettings(rounds=2)
    client: LevelSettings = LevelSettings()
    nodes: dict[str, NodeOverride] = {}
    residuals: ResidualsConfig = ResidualsConfig()
    tempo: bool = False  # Tempo: the root retunes each edge's client epochs per root round (Eq. 9)
    clock: ClockSettings = ClockSettings()  # virtual clock of asynchronous nodes

    @field_validator("groups")
    @classmethod
    def _group_shape(cls, groups: dict[str, Any]) -> dict[str, Any]:
        """Each group: a non-empty list of names, or a non-empty mapping of sub-groups; names unique."""
        seen: dict[str, str] = {}

        def check(mapping: dict[Any, Any], key: str) -> None:
            for name, value in mapping.items():
                here = f"{key}.{name}"
                if not isinstance(name, str):
                    raise ValueError(f"{here}: a group name must be a string, got {name!r}")
                if name == "root":
                    raise ValueError(f"{here}: a group cannot be called 'root' (the root server's id)")
                if name in seen:
                    raise ValueError(f"{here}: group name {name!r} is already used at {seen[name]}")
                seen[name] = here
                if isinstance(value, dict):
                    if not value:
                        raise ValueError(f"{here}: an intermediate server needs at least one language below it")
                    check(value, here)
                elif isinstance(value, list):
                    if not value:
                        raise ValueError(f"{here}: an intermediate server needs at least one language")
                    bad = [v for v in value if not isinstance(v, str)]
                    if bad:
                        raise ValueError(f"{here}: {bad[0]!r} is not a language/cluster name")
                else:
                    raise ValueError(
                        f"{here}: a group holds a list of languages (e.g. [en, fr]) "
                        f"or a mapping of sub-groups (e.g. {{west: [en, fr]}}), got {value!r}"
                    )

        check(groups, "tree.groups")
        return groups

    def group_specs(self) -> list[GroupSpec]:
        """Every group of ``groups``, in pre-order (a group before its sub-groups, config order)."""
        out: list[GroupSpec] = []
        _walk_groups(self.groups, "tree.groups", 1, "root", out)
        return out

    @model_validator(mode="after")
    def _tempo(self) -> TreeConfig:
        if self.tempo and self.root.mode == "async":
            raise ValueError("tree.tempo: Tempo retunes epochs per synchronous root round; tree.root.mode is async")
        if self.tempo and (self.flat or self.groups):
            shape = "tree.flat is true (root -> clients)" if self.flat else "tree.groups puts servers between them"
            raise ValueError(
                f"tree.tempo: Tempo needs the root's children to be edge servers (root -> edge servers -> "
                f"clients, tree.groups: {{}}), but {shape}"
            )
        return self

    @model_validator(mode="after")
    def _levels(self) -> TreeConfig:
        depths = sorted({g.depth for g in self.group_specs()})
        for depth in self.levels:
            if depth == 0:
                raise ValueError("tree.levels.0: depth 0 is the root; its settings are tree.root")
            if depth not in depths:
                where = f"at depths {depths}" if depths else "(tree.groups is empty)"
                raise ValueError(
                    f"tree.levels.{depth}: no intermediate server at depth {depth} (root = 0); "
                    f"tree.groups has intermediate servers {where}"
                )
        return self
