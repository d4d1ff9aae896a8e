"""PLD against RDP for every shipped DP config, and the noise a target epsilon needs.

For each config in ``configs/`` with DP at a server (``privacy:`` or a ``dp`` wrapper):
load it, build its tree from placeholder clients (the clients the config will produce,
before any data exists), and for each DP server print its planned rounds, its noise
multiplier ``z``, and the epsilon at its ``delta`` after the planned rounds by both
accountants (``bhfl_core.algorithm.privacy_accounting.server_epsilon``): what a run of
it reports (PLD, the default) and the looser figure the DP-FedAvg papers before 2021
report (RDP). Then the ``z`` that ``target_epsilon`` would calibrate for epsilon 1, 4
and 8 at the servers of the configs named with ``--calibrate``. No data, no training:
a few seconds per sampled server (a PLD call near ``z`` ~0.3 s, more at a small ``z``).

Run:  .venv/bin/python benchmarks/privacy_accounting.py [--calibrate bhfl-dp-large.yaml bhfl-dp.yaml]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _env import REPO

from bhfl_core.algorithm.privacy_accounting import calibrate_server, server_epsilon
from bhfl_core.algorithm.privacy_params import PrivacyParams
from bhfl_core.config.loader import load_config
from bhfl_core.config.topology import build_tree, placeholder_clients


def dp_servers(config: Path) -> list[tuple[str, PrivacyParams]]:
    """Each DP server of ``config`` with its planned privacy (first of a set of identical servers only)."""
    cfg = load_config(config)
    tree = build_tree(cfg, placeholder_clients(cfg))
    out: list[tuple[str, PrivacyParams]] = []
    seen: set[tuple[object, ...]] = set()
    for node in tree.servers():
        params = node.settings.aggregate.privacy
        if params is None:
            continue
        key = (params.noise_multiplier, params.expected, params.population, params.poisson, _rounds(params))
        if key in seen:
            continue
        seen.add(key)
        same = sum(
            1
            for other in tree.servers()
            if (p := other.settings.aggregate.privacy) is not None
            and (p.noise_multiplier, p.expected, p.population, p.poisson, _rounds(p)) == key
        )
        out.append((node.id if same == 1 else f"{node.id} (and {same - 1} alike)", params))
    return out


def _rounds(params: PrivacyParams) -> int:
    return params.budget.planned_rounds if params.budget is not None else 0


def _epsilons(params: PrivacyParams, z: float) -> tuple[float, float]:
    terms = (_rounds(params), params.expected, params.population, params.poisson, params.delta)
    return server_epsilon(z, *terms[:4], terms[4], "pld"), server_epsilon(z, *terms[:4], terms[4], "rdp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibrate", nargs="*", default=["bhfl-dp-large.yaml", "bhfl-dp.yaml"])
    args = parser.parse_args()
    configs = sorted(p for p in (REPO / "configs").glob("*.yaml") if "dp" in p.stem or "fedbuff" in p.stem)
    print("| config | DP server | sampling | cohort / children | planned rounds | z | epsilon PLD | epsilon RDP |")
    print("|---|---|---|---|---|---|---|---|")
    for config in configs:
        for node, params in dp_servers(config):
            pld, rdp = _epsilons(params, params.noise_multiplier)
            sampling = "poisson" if params.poisson else "fixed"
            print(
                f"| {config.name} | {node} | {sampling} | {params.expected:g} / {params.population} | "
                f"{_rounds(params)} | {params.noise_multiplier:.4g} | {pld:.4g} | {rdp:.4g} |"
            )
    print()
    print("| config | DP server | delta | z for epsilon 1 | 4 | 8 (PLD; RDP in brackets) |")
    print("|---|---|---|---|---|---|")
    for name in args.calibrate:
        for node, params in dp_servers(REPO / "configs" / name):
            terms = (_rounds(params), params.expected, params.population, params.poisson, params.delta)
            cells = [
                f"{calibrate_server(t, *terms, 'pld'):.4g} ({calibrate_server(t, *terms, 'rdp'):.4g})"
                for t in (1.0, 4.0, 8.0)
            ]
            print(f"| {name} | {node} | {params.delta:g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
