"""scale.py's cases: a population and clients per round, as the ``--set`` overrides that give them.

The embedded config is changed only through overrides (benchmarks/scale.py's docstring
says which); the edge cohort that gives the asked clients per root round is solved from
the tree bhfl itself builds for that population (``resolve``), and checked against it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SIZES = "{median: 40, sigma: 0.8, min: 10, max: 200}"


@dataclass(frozen=True)
class Case:
    population: int  # clients in all (languages x clients per language)
    asked: int  # clients per round asked for
    per_round: int  # client trainings per root round the tree gives
    edge_cohort: int
    unit: float  # trainings per root round per unit of edge cohort
    edges: tuple[str, ...]
    per_edge_round: int  # clients one edge server trains per root round
    per_language: int
    rounds: int
    overrides: tuple[str, ...]

    @property
    def trainings(self) -> int:
        return self.per_round * self.rounds

    @property
    def name(self) -> str:
        return f"scale-{self.population}x{self.per_round}"

    def describe(self) -> str:
        return (
            f"{self.population} clients ({len(self.edges)} edge servers x {self.per_language}), "
            f"tree.edge.cohort={self.edge_cohort}: {self.per_round} client trainings per root round "
            f"({self.per_edge_round} per edge server; asked {self.asked}), {self.rounds} root rounds = "
            f"{self.trainings} trainings"
        )


def base_overrides(args: argparse.Namespace) -> list[str]:
    """The issue's population-only changes of the embedded config (the benchmark's own keys come later)."""
    return [
        f"data.sizes={SIZES}",
        "tree.root.proxy_train=false",
        "tree.server.rounds=1",
        "tree.edge.rounds=1",
        f"tree.client.persistent={str(args.persistent).lower()}",
        # a persistent client with eta_down 1.0 adopts its parent's model: nothing of it is read again, so bhfl
        # writes no state for it (unless its model is scored); 0.5 mixes its own model in, read from disk
        *(["tree.client.eta_down=0.5"] if args.persistent else []),
        "eval.every=0",
        f"eval.client_models={str(args.eval_client_models).lower()}",
    ]


def _trainings_per_execution(tree: Any, node: Any) -> float:
    """Client trainings one execution of ``node`` makes (a server samples ``cohort`` of its children per round)."""
    if node.is_leaf:
        return 1.0
    children = tree.children(node.id)
    sampled = node.settings.cohort or len(children)
    mean = sum(_trainings_per_execution(tree, c) for c in children) / len(children)
    return node.settings.rounds * sampled * mean


def _tree(config: Path, overrides: list[str], per_language: int) -> tuple[Any, Any]:
    """The config with ``overrides`` (validated by bhfl's loader) and its tree over a population of that size."""
    from bhfl_core.config.loader import load_config
    from bhfl_core.config.topology import ClientInfo, build_tree

    cfg = load_config(config, overrides)
    languages = list(cfg.data.source.languages)
    clients = [ClientInfo(f"{lang}-{j:06d}", lang, 32) for lang in languages for j in range(per_language)]
    return cfg, build_tree(cfg, clients)


def resolve(
    args: argparse.Namespace, population: int, per_round: int, languages: int
) -> Case | str:  # a case, or why it is skipped
    from bhfl_core.algorithm.tree import Role

    per_language = population // languages
    if per_language < 1:
        return f"population {population} has fewer clients than the {languages} languages"
    sets = [*base_overrides(args), *args.overrides, f"data.clients_per_language={per_language}"]
    _, tree = _tree(args.config, [*sets, "tree.root.rounds=1", "tree.edge.cohort=1"], per_language)
    edges = [n for n in tree if n.role == Role.EDGE]
    unit = _trainings_per_execution(tree, tree.root) / tree.root.settings.rounds
    cohort = max(1, round(per_round / unit))
    smallest = min(len(e.children) for e in edges)
    if cohort > smallest:
        return f"{per_round} clients per round needs tree.edge.cohort={cohort}, above the {smallest} clients of an edge"
    given = round(cohort * unit)
    rounds = max(1, round(args.trainings / given)) if args.trainings else args.rounds
    sets += [f"tree.root.rounds={rounds}", f"tree.edge.cohort={cohort}"]
    _, tree = _tree(args.config, sets, per_language)  # the very config bhfl gets, validated
    check = _trainings_per_execution(tree, tree.root)
    if round(check) != given * rounds:
        raise RuntimeError(f"the resolved tree trains {check} clients, not {given * rounds}")
    per_edge = round(given / len(edges))  # each edge server's share of a root round (the loop draws as many)
    return Case(
        population=per_language * languages,
        asked=per_round,
        per_round=given,
        edge_cohort=cohort,
        unit=unit,
        edges=tuple(e.id for e in edges),
        per_edge_round=per_edge,
        per_language=per_language,
        rounds=rounds,
        overrides=(*sets, f"name=scale-{per_language * languages}x{given}"),
    )
