"""The parameters of the wrappers around a server's rule (DP, secure aggregation, zeroing) and of DP-SGD, resolved
for one node (no torch: configs build these).

What they mean: ``privacy.py``; how epsilon is counted: ``privacy_accounting.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Randomness = Literal["seeded", "secure"]
"""Where a wrapper's random draws come from: generators seeded by where they happen, or the OS (not reproducible)."""


@dataclass(frozen=True)
class AdaptiveClip:
    """Andrew et al. 2021: move the clipping norm towards the ``quantile`` of the update norms."""

    quantile: float = 0.5  # gamma: the share of updates meant to stay unclipped
    lr: float = 0.2  # eta_C: the geometric step
    count_noise: float = 1.0  # sigma_b: std of the noise on the count of unclipped updates


@dataclass(frozen=True)
class CanaryParams:
    """An empirical audit at one DP server (``canaries.py``): ``count`` inserted and ``count`` held-out canaries;
    ``seed``: from (run seed, server)."""

    count: int
    seed: int


@dataclass(frozen=True)
class PrivacyBudget:
    """What a DP server may spend over the whole run (``privacy.target_epsilon`` / ``max_epsilon``).

    ``planned_rounds``: the most rounds (flushes) the server can run in the run, over all
    its executions (``config/privacy_plan.py``); ``key``: the config key that set the
    server's privacy, for the errors that name it.
    """

    key: str = field(compare=False)  # where it was written is not what it is (a shorthand and a list agree)
    target_epsilon: float | None = None
    max_epsilon: float | None = None
    planned_rounds: int = 0


@dataclass(frozen=True)
class PrivacyParams:
    """A server's client-level DP (``privacy:`` in the config), resolved for one node.

    ``expected``: contributions a round expects (its cohort size; with Poisson sampling the
    rate times the children, not a whole number): the mean's denominator.
    ``population``: the children a cohort is drawn from (the sampling rate is ``expected /
    population``). ``poisson``: each child is in a round independently (add/remove-one
    accounting) rather than ``expected`` of them without replacement (replace-one).
    ``noise_seed``: derived from (run seed, node) when the tree is built; each round's draws
    derive from it and the round key. ``accountant``: ``pld`` or ``rdp``
    (``privacy_accounting.py``). ``budget``: the run's plan and limits, once known.
    """

    clip: float
    noise_multiplier: float
    expected: float
    population: int
    noise_seed: int
    delta: float = 1e-5
    adaptive: AdaptiveClip | None = None
    randomness: Randomness = "seeded"  # or "secure": the noise from a CSPRNG keyed by the OS (privacy.noise)
    poisson: bool = False
    accountant: Literal["pld", "rdp"] = "pld"
    budget: PrivacyBudget | None = None
    canaries: CanaryParams | None = None  # an empirical audit's canary clients (canaries.py); None: no audit
    distributed: bool = False  # the children add the noise under secure aggregation (discrete_gaussian.py)

    @property
    def update_noise_multiplier(self) -> float:
        """The update sum's noise multiplier: ``z``, or less with adaptive clipping (some budget is the count's)."""
        z = self.noise_multiplier
        if self.adaptive is None or z == 0:
            return z
        rest = z**-2 - (2 * self.adaptive.count_noise) ** -2
        if rest <= 0:
            raise ValueError(
                f"adaptive clipping: count_noise {self.adaptive.count_noise} leaves no budget for the update "
                f"at noise_multiplier {z} (it needs 2 * count_noise > noise_multiplier)"
            )
        return float(rest**-0.5)


@dataclass(frozen=True)
class DpSgdParams:
    """Sample-level DP-SGD in a client's TRAIN (Abadi et al. 2016, through Opacus; ``learning/dp_sgd.py``).

    Each example's gradient is clipped to L2 norm ``max_grad_norm`` and Gaussian noise of
    std ``noise_multiplier * max_grad_norm`` is added to the batch's sum; ``delta``: the
    delta of the client's reported epsilon.
    """

    noise_multiplier: float
    max_grad_norm: float
    delta: float = 1e-5
    accountant: Literal["pld", "rdp"] = "rdp"  # rdp: a client's epsilon is computed every round, ~0.3 s with pld


@dataclass(frozen=True)
class SecAggParams:
    """A server's secure aggregation (``secure_aggregation:`` in the config), resolved for one node.

    Updates are fixed-point integers with ``fraction_bits`` below the point, summed modulo
    ``2**bits``; ``threshold``: Shamir's t, the shares (per neighbourhood) needed to rebuild a
    client's secret. ``mask_seed``: derived from (run seed, node); with ``randomness:
    seeded`` every key, mask and share of a round derives from it and the round, with
    ``secure`` from 32 bytes of ``os.urandom`` drawn at the round's plan
    (secagg_parties.py). ``neighbours``: SecAgg+'s sparse graph's k, None for the complete
    graph (secagg_graph.py).
    """

    threshold: int
    mask_seed: int
    bits: int = 48
    fraction_bits: int = 24
    neighbours: int | None = None
    randomness: Randomness = "seeded"
    client_noise: float = 0.0  # distributed DP: each child's discrete Gaussian std, integer units (privacy_plan)
    client_norm: float = 0.0  # distributed DP: the L2 bound of a child's integer vector, clip * 2**fraction_bits


@dataclass(frozen=True)
class ZeroingParams:
    """A server's ``zeroing`` wrapper (``zeroing_rule.py``): a child's update that is not finite, or whose L2 norm is
    above ``max_norm``, is replaced by zero (the model the child was sent) and counted (TFF's zeroing factory)."""

    max_norm: float = float("inf")
