"""The report's privacy section: each DP server's spent epsilon and its clipping, from its MLflow history."""

from __future__ import annotations

from dataclasses import dataclass

from bhfl_core.algorithm.canaries import empirical_epsilon, statistics
from bhfl_core.algorithm.privacy_accounting import epsilon
from bhfl_core.algorithm.round_tail import client_epsilon
from bhfl_core.algorithm.tree import Tree
from bhfl_core.store.node_store import StateStore
from flows.tracking.tracker import Tracker

KEYS = ("privacy/epsilon", "privacy/clip", "privacy/noise_std", "privacy/clipped_fraction")
EMPIRICAL_MAX = "privacy/epsilon_empirical_max"
"""Parent-run metric with an audit (``eval.privacy_audit``): the largest epsilon the canaries imply at any DP server."""
EPSILON_MAX = "privacy/epsilon_max"
"""Parent-run metric: the largest epsilon any DP server spent (what the run as a whole guarantees its clients)."""


@dataclass(frozen=True)
class PrivacyRow:
    """A DP server at the end of the run: its last round's logged values, its plan, and its epsilon each round."""

    node: str
    delta: float
    rounds: int
    epsilon: float
    clip: float
    noise_std: float
    clipped: float
    planned_rounds: int
    planned_epsilon: float
    budget: float | None  # max_epsilon, else target_epsilon, else None
    curve: tuple[tuple[int, float], ...]  # (step, epsilon) for every round it logged
    empirical: float | None = None  # the canary audit's estimate (eval.privacy_audit), None without one

    def cells(self) -> list[str]:
        numbers = (self.epsilon, self.clip, self.noise_std, self.clipped)
        budget = "-" if self.budget is None else f"{self.budget:g}"
        plan = [str(self.planned_rounds), f"{self.planned_epsilon:.3g}", budget]
        audit = "-" if self.empirical is None else f"{self.empirical:.3g}"
        return [self.node, f"{self.delta:g}", str(self.rounds), *(f"{v:.3g}" for v in numbers), *plan, audit]


HEADERS = [
    "server", "delta", "rounds", "epsilon", "clip", "noise std", "clipped", "planned rounds", "planned epsilon",
    "budget", "audit epsilon",
]  # fmt: skip


def privacy_rows(tracker: Tracker, tree: Tree, store: StateStore) -> list[PrivacyRow]:
    """One row per DP server that logged a round (none without DP); with an audit, its empirical epsilon from the
    canaries' statistics in the server's saved rule state (``bhfl_core/algorithm/canaries.py``)."""
    rows = []
    for node in tree.servers():
        privacy = node.settings.aggregate.privacy
        run_id = tracker.node_runs.get(node.id)
        if privacy is None or run_id is None:
            continue
        history = {key: tracker.history(run_id, key) for key in KEYS}
        if not history["privacy/epsilon"]:
            continue
        last = max(history["privacy/epsilon"])
        values = [history[key].get(last, float("nan")) for key in KEYS]
        budget = privacy.budget
        planned = budget.planned_rounds if budget is not None else 0
        limit = None if budget is None else (budget.max_epsilon or budget.target_epsilon)
        curve = tuple(sorted(history["privacy/epsilon"].items()))
        empirical = None
        if privacy.canaries is not None:
            inserted, held_out = statistics(store.load_header(node.id).rule_state, privacy.canaries.count)
            empirical = empirical_epsilon(inserted, held_out, privacy.delta)
        spent, clip, noise_std, clipped = values
        planned_epsilon = epsilon(privacy, planned)
        rows.append(
            PrivacyRow(
                node.id, privacy.delta, len(curve), spent, clip, noise_std, clipped, planned, planned_epsilon,
                limit, curve, empirical,
            )
        )  # fmt: skip
    return rows


def curve_csv(rows: list[PrivacyRow]) -> str:
    """``eval/privacy_epsilon.csv``: every DP server's epsilon after each of its logged rounds."""
    lines = ["server,step,round,epsilon"]
    for row in rows:
        lines += [f"{row.node},{step},{i + 1},{value!r}" for i, (step, value) in enumerate(row.curve)]
    return "\n".join(lines) + "\n"


def epsilon_max(rows: list[PrivacyRow]) -> dict[str, float]:
    """The parent's ``privacy/epsilon_max`` and, with an audit, ``privacy/epsilon_empirical_max`` (none without DP)."""
    out = {EPSILON_MAX: max(r.epsilon for r in rows)} if rows else {}
    audited = [r.empirical for r in rows if r.empirical is not None]
    return {**out, EMPIRICAL_MAX: max(audited)} if audited else out


CLIENT_EPSILON_MAX = "privacy/client_epsilon_max"
"""Parent-run metric: the largest epsilon a DP-SGD client's own TRAIN calls spent (sample-level)."""


def client_epsilons(tree: Tree, store: StateStore) -> dict[str, float]:
    """Every DP-SGD client's epsilon at the end, from the steps its saved state counts (none without DP-SGD)."""
    out = {}
    for node in tree.clients():
        train = node.settings.train
        if train is not None and train.dp_sgd is not None:
            out[node.id] = client_epsilon(node, store.load_header(node.id).dp_steps)
    return out


def client_lines(epsilons: dict[str, float], tree: Tree) -> list[str]:
    """The report's paragraph on sample-level DP-SGD (empty without it)."""
    if not epsilons:
        return []
    values = sorted(epsilons.values())
    worst = max(epsilons, key=lambda c: epsilons[c])
    train = tree[worst].settings.train
    assert train is not None and train.dp_sgd is not None
    dp = train.dp_sgd
    return [
        f"Sample-level DP-SGD at {len(values)} clients (noise multiplier {dp.noise_multiplier:g}, per-example "
        f"clip {dp.max_grad_norm:g}): epsilon at delta {dp.delta:g} after their TRAIN calls, median "
        f"{values[len(values) // 2]:.3g}, largest {values[-1]:.3g} ({worst}).",
        "",
    ]
