"""What each privacy option costs a server round: the fold of its children's models and the finalize, beside the
plain mean measured in the same run.

For ``--clients`` children of a ``--values``-value model (one CPU thread, in process,
the rule API the engine calls: ``start``, ``contribute`` per child, ``finalize``), the
median over ``--repeats`` rounds of:

- mean: the exact weighted mean (no privacy), the baseline;
- dp rdp: central DP-FedAvg with the RDP accountant (what every DP server did before);
- dp pld: the same, PLD (the default now; unsampled: closed form);
- dp poisson pld: a Poisson cohort, PLD (the accountant's PoissonSampled event each round);
- secagg: secure aggregation alone (complete graph);
- dp + secagg: central DP around secure aggregation;
- distributed dp: each child's discrete Gaussian under secure aggregation.

Each line prints seconds a round and the ratio to the mean. The accountant's figure is
cached per (noise, rounds, cohort), so each round asks for a new round count, as a run does.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import replace

import torch

from bhfl_core.algorithm.node_state import Caller, RoundKey
from bhfl_core.algorithm.privacy_params import PrivacyParams, SecAggParams
from bhfl_core.algorithm.rule_registry import AggregateParams
from bhfl_core.algorithm.rules import rule_for


def _settings(clients: int) -> dict[str, AggregateParams]:
    z, clip, t = 1.0, 1.0, clients // 2 + 1
    central = PrivacyParams(clip, z, expected=clients, population=clients, noise_seed=1)
    poisson = PrivacyParams(clip, z, expected=clients, population=10 * clients, noise_seed=1, poisson=True)
    secagg = SecAggParams(t, 2)
    sigma = z * clip * 2.0**24 / math.sqrt(t)
    noised = SecAggParams(t, 2, client_noise=sigma, client_norm=clip * 2.0**24)
    distributed = PrivacyParams(clip, z, expected=clients, population=clients, noise_seed=1, distributed=True)
    return {
        "mean": AggregateParams(),
        "dp rdp": AggregateParams(wrappers=(replace(central, accountant="rdp"),)),
        "dp pld": AggregateParams(wrappers=(central,)),
        "dp poisson pld": AggregateParams(wrappers=(poisson,)),
        "secagg": AggregateParams(wrappers=(secagg,)),
        "dp + secagg": AggregateParams(wrappers=(central, secagg)),
        "distributed dp": AggregateParams(wrappers=(distributed, noised)),
    }


def _round(aggregate: AggregateParams, models: dict[str, torch.Tensor], reference: torch.Tensor, index: int) -> float:
    rule = rule_for(aggregate)
    key = RoundKey("edge", index, Caller("root", index))
    start = time.perf_counter()
    plan = rule.plan({}, list(models))
    partial = rule.start(key.as_caller(), plan, reference)
    for member, model in models.items():
        rule.contribute(partial, member, model, 10.0)
    rule.finalize(partial, key)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--values", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    reference = torch.randn(args.values, generator=gen)
    models = {f"c{i:03d}": reference + 0.01 * torch.randn(args.values, generator=gen) for i in range(args.clients)}
    times = {}
    for name, aggregate in _settings(args.clients).items():
        _round(aggregate, models, reference, 0)  # warm: imports, the accountant's first curve
        times[name] = statistics.median(_round(aggregate, models, reference, i + 1) for i in range(args.repeats))
    print(f"{args.clients} children x {args.values:,} values, one thread, median of {args.repeats} rounds")
    for name, seconds in times.items():
        print(f"  {name:16s} {seconds:8.4f} s a round  {seconds / times['mean']:6.1f}x the mean")


if __name__ == "__main__":
    main()
