"""What the round loops ask of whoever runs them: ``EngineHooks``, and the pending work they start.

``engine.execute_node`` and ``async_engine.execute_async_node`` drive every node the
same way, wherever it runs: servers in the orchestrator (``flows/training.py``
``FlowHooks``: child servers as node executions, clients as worker batches), clients
inside a worker (``tasks/client_training.py`` ``LocalTrainer``: TRAIN on their data),
fake trees in unit tests. Those callers provide these protocols; the loops and the
pieces below them (``round_commits.py``: a commit's ``round_done``) depend on the
protocols only, so none of them imports the loop that uses it. Like
``store_protocol.py`` for the store, this module imports nothing but the types the
protocols speak.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from bhfl_core.algorithm.contract import ChildResult, RoundPlan
from bhfl_core.algorithm.node_state import NodeResult, RoundKey
from bhfl_core.algorithm.tree import Node


class PendingResult(Protocol):
    def result(self) -> ChildResult | None:
        """Wait for the work (it runs from the moment it was started); None: a child that failed and was dropped."""
        ...


class PendingTrain(Protocol):
    def result(self) -> NodeResult:
        """Wait for a TRAIN started earlier (a server's proxy TRAIN alongside its children)."""
        ...


class EngineHooks(Protocol):
    def run_children(
        self, node: Node, cohort: list[Node], theta: torch.Tensor, plans: Mapping[str, RoundPlan]
    ) -> list[ChildResult]:
        """Execute every child of the cohort from ``theta``, each with its plan; return their results (any order)."""
        ...

    def train(self, node: Node, theta: torch.Tensor, key: RoundKey, plan: RoundPlan) -> NodeResult:
        """TRAIN on the node's own data (private for clients, proxy for servers); ``plan``: the execution's."""
        ...

    def call_duration(self, node: Node, child: Node, plan: RoundPlan) -> float | None:
        """A client call's virtual duration, known before it runs; None for servers (their result carries it)."""
        ...

    def start_train(self, node: Node, theta: torch.Tensor, key: RoundKey) -> PendingTrain:
        """Begin a server's proxy TRAIN without waiting (``proxy_train: async``; ``proxy_child``)."""
        ...

    def round_done(self, node: Node, key: RoundKey, theta: torch.Tensor, metrics: dict[str, float]) -> None:
        """Called after each node round is committed (logging, progress, evaluation)."""
        ...

    def score(self, node: Node, candidates: Sequence[torch.Tensor]) -> list[float]:
        """Losses of candidate models on the node's held-out data (tuned NODEOPTs such as ``interp``)."""
        ...

    def train_personal(self, node: Node, personal: torch.Tensor, anchor: torch.Tensor, key: RoundKey) -> NodeResult:
        """Ditto: TRAIN a client's personal model with ``(mu/2)·||v - anchor||²`` (``settings.personal``)."""
        ...
