"""The settings of what wraps a server's aggregation rule (``aggregate.wrap``): compression, zeroing, DP, secure
aggregation; each resolved per node by ``aggregation_settings.py`` (docs/config.md, "Aggregation rules and
wrappers")."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from bhfl_core.config.base import ConfigError, Strict


class CompressSettings(Strict):
    """What a server's children send it: their update compressed (``bhfl_core/algorithm/compression.py``).

    ``int8``: stochastic 8-bit quantisation, one float32 scale per ``block`` values;
    ``topk``: the ``fraction`` of entries largest in magnitude. ``error_feedback``: each
    child adds what its earlier payloads left out (kept in its state) before compressing.
    """

    kind: Literal["int8", "topk"]
    fraction: Annotated[float, Field(gt=0, le=1)] = 0.01
    block: Annotated[int, Field(ge=1)] = 512
    error_feedback: bool = True


TOPK_BREAK_EVEN = 0.5  # top-k's 8 bytes an entry kept (int32 index, float32 value) against 4 an entry sent dense


def check_topk_fraction(kind: str, fraction: float, key: str) -> None:
    """Refuse a top-k ``fraction`` whose payload is no smaller than the update sent uncompressed (``key``: the
    compress setting).

    ``ceil(f·n)`` entries at 8 bytes are at least the ``4 n`` bytes of all ``n`` values
    in float32 from ``f = 0.5`` on: such a setting sends more than no compression and
    still drops the rest. Refused, not warned (docs/config.md, ``aggregate.compress``): a
    fraction read as the share *dropped* (0.99 for 1% kept) is the likely way to write it.
    """
    if kind == "topk" and fraction >= TOPK_BREAK_EVEN:
        raise ConfigError(
            f"{key}.fraction: {fraction} keeps ceil({fraction}·n) of the update's n entries at 8 bytes each (int32 "
            f"index, float32 value), at least the 4·n bytes of sending all of them uncompressed, and drops the "
            f"rest; the fraction is the share kept, and only one below {TOPK_BREAK_EVEN} sends fewer bytes (the "
            "default 0.01: 2% of them). Give a smaller fraction, or no compression"
        )


class CompressDownSettings(Strict):
    """What a server broadcasts its children: the change of its model since its last broadcast, compressed, with
    the server's own error feedback (Double-Squeeze; ``bhfl_core/algorithm/downlink.py``), always on."""

    kind: Literal["int8", "topk"]
    fraction: Annotated[float, Field(gt=0, le=1)] = 0.01
    block: Annotated[int, Field(ge=1)] = 512


class AdaptiveClipSettings(Strict):
    """Adaptive clipping (Andrew et al. 2021): the clipping norm follows a quantile of the update norms.

    ``count_noise``: std of the noise on the count of unclipped updates (sigma_b); unset,
    the paper's ``expected cohort / 20``. It must exceed ``noise_multiplier / 2``.
    """

    quantile: Annotated[float, Field(gt=0, lt=1)] = 0.5
    lr: Annotated[float, Field(gt=0)] = 0.2
    count_noise: Annotated[float, Field(gt=0)] | None = None


class PrivacySettings(Strict):
    """Client-level differential privacy at a server (DP-FedAvg; docs/privacy.md).

    Each child's update (its model minus the model the server sent it) is clipped to L2
    norm ``clip``; Gaussian noise of std ``noise_multiplier * clip`` is added to the sum;
    the mean divides by the expected cohort size. ``delta``: the delta epsilon is reported at.
    ``randomness``: the noise from a generator seeded by (run seed, node, round) (``seeded``:
    runs repeat) or from a CSPRNG keyed by the OS (``secure``: never repeats).
    Instead of ``noise_multiplier``, ``target_epsilon`` has the smallest multiplier that keeps
    epsilon within it after every round the server is planned to run computed when the
    config is read; ``max_epsilon`` refuses a run planned to spend more. ``accountant``:
    ``pld`` (privacy loss distributions, near-tight) or ``rdp`` (Renyi DP).
    """

    clip: Annotated[float, Field(gt=0)]
    noise_multiplier: Annotated[float, Field(ge=0)] | None = None
    target_epsilon: Annotated[float, Field(gt=0)] | None = None
    max_epsilon: Annotated[float, Field(gt=0)] | None = None
    accountant: Literal["pld", "rdp"] = "pld"
    adaptive: AdaptiveClipSettings | None = None
    delta: Annotated[float, Field(gt=0, lt=1)] = 1e-5
    randomness: Literal["seeded", "secure"] = "seeded"
    distributed: bool = False  # the children add discrete Gaussian noise under secure aggregation (docs/privacy.md)

    @model_validator(mode="after")
    def _noise(self) -> PrivacySettings:
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError(
                "set exactly one of noise_multiplier (the noise std over the clip) and target_epsilon (the noise "
                "multiplier is then calibrated to it over the server's planned rounds)"
            )
        return self


class SecureAggregationSettings(Strict):
    """Secure aggregation at a server (Bonawitz et al. 2017, SecAgg+ of Bell et al. 2020; docs/privacy.md).

    Updates become fixed-point integers (``fraction_bits`` below the point) summed modulo
    ``2**bits``; ``threshold``: the Shamir threshold, how many shares (of the round's
    children; per neighbourhood with ``graph: sparse``) rebuild a client's secret (default:
    a majority of the cohort, or of the neighbours). ``graph``: who masks with whom (every
    pair, or ``neighbours`` each on a Harary graph; default ``2 ceil(log2 m)``).
    ``randomness``: keys and seeds derived from the run seed (``seeded``: runs repeat) or
    drawn from the OS (``secure``: masks never repeat, the unmasked sum is the same).
    """

    bits: Annotated[int, Field(ge=16, le=62)] = 48
    fraction_bits: Annotated[int, Field(ge=0, le=60)] = 24
    threshold: Annotated[int, Field(ge=1)] | None = None
    graph: Literal["complete", "sparse"] = "complete"
    neighbours: Annotated[int, Field(ge=2)] | None = None
    randomness: Literal["seeded", "secure"] = "seeded"


class ZeroingSettings(Strict):
    """Zeroing (TFF's ``zeroing_factory``): a child's update with a non-finite value, or an L2 norm above
    ``max_norm`` (unset: no bound), is replaced by zero and counted (``zeroing/zeroed``)."""

    max_norm: Annotated[float, Field(gt=0)] | None = None


WRAPPERS = ("compress", "zeroing", "dp", "secagg")
"""The wrappers ``aggregate.wrap`` lists, in the one order they compose (outermost first)."""


class WrapSettings(Strict):
    """One wrapper of ``aggregate.wrap``: exactly one of its keys is set."""

    compress: CompressSettings | None = None
    zeroing: ZeroingSettings | None = None
    dp: PrivacySettings | None = None
    secagg: SecureAggregationSettings | None = None

    @model_validator(mode="before")
    @classmethod
    def _named(cls, data: Any) -> Any:
        if isinstance(data, str):  # ``- zeroing``: the wrapper with its defaults
            if data not in WRAPPERS:
                raise ValueError(f"unknown wrapper {data!r}; choose one of {list(WRAPPERS)}")
            return {data: {}}
        return data

    @model_validator(mode="after")
    def _one(self) -> WrapSettings:
        chosen = [name for name in WRAPPERS if getattr(self, name) is not None]
        if len(chosen) != 1:
            raise ValueError(f"each wrap entry names one wrapper of {list(WRAPPERS)}, got {chosen or 'none'}")
        return self

    @property
    def name(self) -> str:
        return next(name for name in WRAPPERS if getattr(self, name) is not None)
