"""What the round loops need of a state store: the one seam between the algorithm and persistence.

The engines (``engine.py``, ``async_engine.py``) read a node's state and its residual
inbox, deliver posts, commit each round and, for an asynchronous node, keep the child
results it used since its last flush. They are typed against this protocol, not
against ``bhfl_core.store.node_store.StateStore``, which implements it structurally
(no inheritance): the store imports the algorithm's types (``NodeState``, ``Inbox``,
``ChildResult``) to write them, so the algorithm importing the store back would tie
the two rooms into one (docs/design.md, "The rooms"). A test can pass any object with
these methods, e.g. an in-memory dict of states.
"""

from __future__ import annotations

from typing import Protocol

from bhfl_core.algorithm.contract import ChildResult
from bhfl_core.algorithm.node_state import NodeState
from bhfl_core.algorithm.node_step import Inbox, ResidualPost


class ExecutionStore(Protocol):
    """Node states, residual accumulators and an asynchronous node's saved child results, of one run."""

    def load(self, node_id: str, lazy_model: bool = False) -> NodeState:
        """A node's state (empty if it has none); ``lazy_model``: its model mapped, not read or checked."""
        ...

    def inbox(self, target: str, direction: str, seen: dict[str, int]) -> Inbox:
        """The residual accumulators of ``direction`` (``"up"``/``"down"``) waiting at ``target``, past ``seen``."""
        ...

    def post(self, sender: str, round_index: int, posts: list[ResidualPost]) -> None:
        """Deliver a sending round's residual posts; posting a round again (a re-run) changes nothing."""
        ...

    def commit(self, node_id: str, state: NodeState, persist: bool = True) -> None:
        """The round's one commit point: save the state (unless not ``persist``), then drop what it consumed."""
        ...

    def save_result(self, node_id: str, dispatch: int, result: ChildResult | None) -> None:
        """Keep a child's result (None: dropped) until the node's next commit, for a replay after a crash."""
        ...

    def has_result(self, node_id: str, dispatch: int) -> bool:
        """Whether ``save_result`` kept a result of this dispatch."""
        ...

    def load_result(self, node_id: str, dispatch: int) -> ChildResult | None:
        """A result ``save_result`` kept (None: a dropped child)."""
        ...

    def drop_results(self, node_id: str) -> None:
        """Forget a node's kept child results (after a commit that no longer needs them)."""
        ...
