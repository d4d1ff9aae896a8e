"""The experiment tree: nodes, their roles, settings and subtree weights.

A ``Tree`` is an immutable mapping ``node_id -> Node``. Clients are leaves; every
other node is a server (root, intermediate server, or edge server: a server whose
children are clients). Node settings are resolved per node (level defaults plus
per-node overrides) before the tree is built, so algorithms read one flat object.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum

from bhfl_core.algorithm.adapter_fold import OwnB, ProductSteps, RankCap
from bhfl_core.algorithm.asynchrony import AsyncParams
from bhfl_core.algorithm.compression import CompressParams
from bhfl_core.algorithm.node_opt import NodeOptParams, is_tuned
from bhfl_core.algorithm.privacy_params import DpSgdParams
from bhfl_core.algorithm.residuals import DownLink, UpLink
from bhfl_core.algorithm.rule_registry import AggregateParams


class Role(str, Enum):  # noqa: UP042 (StrEnum would change str(Role.X) in messages)
    ROOT = "root"
    SERVER = "server"  # intermediate server
    EDGE = "edge"  # server whose children are clients
    CLIENT = "client"


@dataclass(frozen=True)
class TrainParams:
    """Local training (TRAIN) hyperparameters: clients on private data, servers on proxy data."""

    lr: float = 5e-4
    epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 32
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    mu: float = 0.0  # FedProx: + (mu/2)·||theta - theta_start||² on the trainable parameters; 0 = off
    precision: str = "fp32"  # fp32, or bf16 / fp16: the forward pass under torch autocast (mixed precision)
    dp_sgd: DpSgdParams | None = None  # clients: per-example clipping and noise in TRAIN (Opacus); None = off


def planned_steps(examples: int, params: TrainParams) -> int:
    """Optimizer steps a TRAIN with ``params`` takes on ``examples`` rows (placement's unit of work, the clock's)."""
    steps = -(-examples // params.batch_size) * params.epochs
    return min(steps, params.max_steps) if params.max_steps is not None else steps


def held_out_rows(rows: int, fraction: float) -> int:
    """Rows of ``rows`` kept out of TRAIN for ``holdout: fraction``: ``round(fraction * rows)``, at least 1 and at
    most ``rows - 1``; none for ``fraction == 0`` or fewer than two rows (``learning/local_train.split_holdout``)."""
    return min(max(round(fraction * rows), 1), rows - 1) if fraction > 0 and rows >= 2 else 0


def call_steps(node: Node, epochs: int | None = None) -> int:
    """The optimiser steps of one of a client's TRAIN calls on its training rows (0 for a node that does not train).

    ``epochs``: its plan's local epochs (Tempo), instead of its ``train.epochs``. A pure
    function of the tree, so a client handed back from its checkpoint (a retried batch)
    reports the same count as one that trained: TRAIN takes exactly ``planned_steps``
    (fixed batches, ``max_steps`` a cap).
    """
    params = node.settings.train
    if params is None:
        return 0
    if epochs is not None:
        params = replace(params, epochs=epochs)
    rows = int(node.weight)
    return planned_steps(rows - held_out_rows(rows, node.settings.holdout), params)


def local_steps(node: Node, epochs: int | None = None) -> int:
    """The optimiser steps of a client's execution: its rounds' TRAIN calls (``call_steps``; ``fednova_norm``)."""
    return node.settings.rounds * call_steps(node, epochs)


@dataclass(frozen=True)
class NodeSettings:
    """Everything EXECUTENODE needs to know about one node."""

    rounds: int = 1
    cohort: int | None = None  # children sampled per round; None = all
    poisson_rate: float | None = None  # sampling: poisson: each child called with this chance a round (cohort None)
    opt_up: NodeOptParams = field(default_factory=NodeOptParams)
    opt_down: NodeOptParams = field(default_factory=NodeOptParams)
    persistent: bool = True
    train: TrainParams | None = None  # None = no local/proxy training at this node
    proxy_async: bool = False  # servers: proxy TRAIN alongside the children, merged like a child result
    res_up: tuple[UpLink, ...] = ()  # residuals this node sends to ancestors
    res_down: tuple[DownLink, ...] = ()  # residuals this node sends to descendants
    res_in: tuple[tuple[str, NodeOptParams], ...] = ()  # residual kinds it receives -> their optimiser
    holdout: float = 0.0  # share of the node's training data kept out of TRAIN to tune NODEOPT interp's alpha
    personal: TrainParams | None = None  # Ditto (clients): a personal model trained towards theta with mu = lambda
    asynchronous: AsyncParams | None = None  # FedBuff at this server (async_engine.py); None = synchronous rounds
    dropout: float = 0.0  # clients: chance that a call drops out (tree.clock.dropout_p; virtual_clock.drops_out)
    aggregate: AggregateParams = field(default_factory=AggregateParams)  # how the children's models are folded
    tempo: int | None = None  # the root under Tempo (seeds/001): the clients' first-round epochs c; None = off
    evaluated: bool = True  # clients: the saved model is read after training (eval.client_models): keep it
    uplink: CompressParams | None = None  # how it sends its model up: its parent's aggregate.compress
    downlink: CompressParams | None = None  # servers: how it broadcasts its model to its children (compress_down)
    rank: RankCap | None = None  # LoRA: its adapters' rank below the model's (adapter_rank; adapter_fold.py)
    own_b: OwnB | None = None  # LoRA clients under aggregation: fedsa: B kept from their own model (adapter_fold.py)
    products: ProductSteps | None = None  # LoRA under exact: linear steps combine products (adapter_mix.py)

    @property
    def tunes(self) -> bool:
        """Whether a NODEOPT of this node tunes on held-out data (``interp``): then it needs ``holdout`` rows."""
        return any(is_tuned(p.kind) for p in (self.opt_up, self.opt_down, *(p for _, p in self.res_in)))

    @property
    def reports_loss(self) -> bool:
        """Whether the node's training loss (and rows seen) may go to its parent: not a DP-SGD client's.

        Computed un-noised from the examples its DP-SGD protects, against the parent too
        (docs/privacy.md, "Sample-level DP-SGD at clients"): it stays in the client's own
        metrics (the experimenter's), so its parent logs no ``Training/loss`` for it.
        """
        return self.train is None or self.train.dp_sgd is None

    def residual_opt(self, key: str) -> NodeOptParams:
        for k, params in self.res_in:
            if k == key:
                return params
        raise KeyError(f"no residual input {key!r} configured for this node")


@dataclass(frozen=True)
class Node:
    id: str
    role: Role
    depth: int  # root = 0
    parent: str | None
    children: tuple[str, ...]
    settings: NodeSettings
    weight: float  # training examples in the subtree (p_c before normalisation)
    group: str | None = None  # language / cluster label, when the node has one

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass(frozen=True)
class Tree:
    nodes: Mapping[str, Node]
    root_id: str

    def __getitem__(self, node_id: str) -> Node:
        return self.nodes[node_id]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes.values())

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def root(self) -> Node:
        return self.nodes[self.root_id]

    def children(self, node_id: str) -> list[Node]:
        return [self.nodes[c] for c in self.nodes[node_id].children]

    def ancestors(self, node_id: str) -> list[str]:
        """Parent first, root last."""
        out: list[str] = []
        parent = self.nodes[node_id].parent
        while parent is not None:
            out.append(parent)
            parent = self.nodes[parent].parent
        return out

    def leaves_under(self, node_id: str) -> list[str]:
        node = self.nodes[node_id]
        if node.is_leaf:
            return [node_id]
        return [leaf for c in node.children for leaf in self.leaves_under(c)]

    def distance(self, a: str, b: str) -> int:
        """Number of edges between two nodes."""
        path_a = [a, *self.ancestors(a)]
        path_b = [b, *self.ancestors(b)]
        common = next(n for n in path_a if n in set(path_b))
        return path_a.index(common) + path_b.index(common)

    def servers(self) -> list[Node]:
        return [n for n in self if not n.is_leaf]

    def clients(self) -> list[Node]:
        return [n for n in self if n.is_leaf]
