"""When a node's round becomes durable, and when it is logged: in the round, or behind its next round's training.

A server's round commit is a model-sized checkpoint (write, checksum, fsync): at 110M
parameters, a large share of a round's time when its clients train on a GPU. Where no
other state depends on the order of commits (``commits_behind``), the engine writes it
while the next round's children train, and logs the round only once it is durable.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from bhfl_core.algorithm.engine_hooks import EngineHooks
from bhfl_core.algorithm.node_state import NodeState, RoundKey
from bhfl_core.algorithm.node_step import keeps_state
from bhfl_core.algorithm.store_protocol import ExecutionStore
from bhfl_core.algorithm.tree import Node, Tree


def commits_behind(tree: Tree, node: Node) -> bool:
    """Whether a node's round commits may be written while its next round's children train.

    Only when nothing else's state depends on the order: every child is a client that
    keeps no state (``keeps_state``: FedAvg's stateless clients), and the node receives
    no residuals. A crash before such a commit is durable loses that round, which a
    resume re-runs to the same bits: the children it trained again wrote nothing, and
    the round was not logged yet (``RoundCommits``: logging waits for durability).
    """
    children = tree.children(node.id)
    if not children or node.settings.res_in:
        return False
    return all(c.is_leaf and not keeps_state(c.settings, True) for c in children)


class RoundCommits:
    """A node's round commits, and the ``round_done`` that follows each once it is durable.

    ``behind=False``: commit, then ``round_done``, in the round (the order everything
    else relies on). ``behind=True`` (``commits_behind``): the commit is written in a
    background thread (a model-sized checkpoint: write, checksum, fsync) while the next
    round's children train; ``settle`` — called once they have returned, and when the
    execution ends — waits for it and runs its ``round_done`` (logging, evaluation), so
    nothing is logged that a crash could still undo, and the parent's commit still comes
    after this node's last one.
    """

    def __init__(self, store: ExecutionStore, hooks: EngineHooks, node: Node, behind: bool) -> None:
        self.store, self.hooks, self.node, self.behind = store, hooks, node, behind
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"bhfl-commit-{node.id}") if behind else None
        self._pending: tuple[Future[None], RoundKey, torch.Tensor, dict[str, float]] | None = None

    def __enter__(self) -> RoundCommits:
        return self

    def commit(self, state: NodeState, persist: bool, key: RoundKey, metrics: dict[str, float]) -> None:
        if self._writer is None:
            self.store.commit(self.node.id, state, persist)
            self.hooks.round_done(self.node, key, state.theta, metrics)
            return
        self.settle()
        written = self._writer.submit(self.store.commit, self.node.id, state, persist)
        self._pending = (written, key, state.theta, metrics)

    def settle(self) -> None:
        """Wait for the commit in flight (its error raised here) and run its ``round_done``."""
        if self._pending is not None:
            written, key, theta, metrics = self._pending
            self._pending = None
            written.result()
            self.hooks.round_done(self.node, key, theta, metrics)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: object) -> None:
        if self._writer is None:
            return
        try:
            if kind is None:
                self.settle()
            elif self._pending is not None:  # failing anyway: the write finishes (durable or not), nothing is logged
                wait([self._pending[0]])
        finally:
            self._writer.shutdown(wait=True)
