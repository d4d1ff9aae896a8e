"""A node's aggregation settings resolved: its NODEOPTs, and how a server folds its children's models.

``topology.py`` merges a node's settings from its level, ``tree.levels`` and
``tree.nodes``; ``values`` / ``origin`` below are that merge (each key's value, and
where it was written, so every error names the key). What cannot be combined (DP or
secure aggregation at a client or an asynchronous server, DP-SGD at a server, ...) is
rejected here, as is a tuned NODEOPT without held-out data.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from bhfl_core.algorithm.compression import CompressParams
from bhfl_core.algorithm.node_opt import NodeOptParams, is_tuned
from bhfl_core.algorithm.privacy_params import (
    AdaptiveClip,
    CanaryParams,
    PrivacyBudget,
    PrivacyParams,
    SecAggParams,
    ZeroingParams,
)
from bhfl_core.algorithm.rule_registry import AggregateParams, WrapperParams
from bhfl_core.algorithm.rules import rule_traits
from bhfl_core.algorithm.tree import Role
from bhfl_core.config.adapter_settings import adapter_fold
from bhfl_core.config.base import ConfigError
from bhfl_core.config.schema import ExperimentConfig
from bhfl_core.config.tree_schema import AggregateSettings, TrainSettings
from bhfl_core.config.wrapper_schema import (
    WRAPPERS,
    CompressSettings,
    PrivacySettings,
    SecureAggregationSettings,
    ZeroingSettings,
    check_topk_fraction,
)
from bhfl_core.rng import derive_seed


def node_opt(
    values: dict[str, Any], origin: dict[str, str], direction: str, node_id: str, has_data: bool
) -> NodeOptParams:
    """The node's NODEOPT for ``direction`` (``up`` or ``down``): its ``opt_<direction>`` and ``eta_<direction>``."""
    o = values[f"opt_{direction}"]
    if is_tuned(o.kind):
        check_tuned(origin[f"opt_{direction}"], node_id, has_data, values["holdout"], origin["holdout"])
    return NodeOptParams(
        kind=o.kind,
        eta=values[f"eta_{direction}"],
        beta1=o.beta1,
        beta2=o.beta2,
        tau=o.tau,
        alphas=tuple(o.alphas),
    )


def check_tuned(key: str, node_id: str, has_data: bool, holdout: float, holdout_key: str) -> None:
    """A tuned NODEOPT (``interp``) needs held-out rows at its node: its own data and ``holdout > 0``."""
    if not has_data:
        raise ConfigError(
            f"{key}: NODEOPT interp tunes alpha on the node's held-out data, but {node_id!r} has none "
            "(clients have their private split; servers need a proxy split: data.proxy.servers)"
        )
    if holdout <= 0:
        raise ConfigError(
            f"{key}: NODEOPT interp tunes alpha on held-out rows of {node_id!r}'s training data; "
            f"set {holdout_key} (e.g. 0.2, the share of rows kept out of TRAIN)"
        )


def aggregate_params(
    config: ExperimentConfig,
    node_id: str,
    role: Role,
    values: dict[str, Any],
    origin: dict[str, str],
    cohort: float | None,
    num_children: int,
) -> AggregateParams:
    """How ``node_id`` folds its children: its rule inside its wrappers (compression, zeroing, DP, secure
    aggregation, checked in that order); every error names the key.

    ``cohort``: the contributions a round expects (``None``: all children; under Poisson
    sampling the rate times the children, a fraction)."""
    settings = values["aggregate"]
    assert isinstance(settings, AggregateSettings)
    defaults = AggregateParams()
    expected = values["buffer"] if values["mode"] == "async" else cohort or num_children  # contributions a fold
    wrappers: list[WrapperParams] = []
    compress = None
    entries = _wrap_entries(settings, node_id, values, origin)
    wrapped = {name: key for name, _, key in entries}
    dp_entry = next((chosen for name, chosen, _ in entries if name == "dp"), None)
    for name, chosen, key in entries:
        if name == "compress":
            compress = _compress(chosen, key, node_id, role, wrapped)
        elif name == "zeroing":
            wrappers.append(_zeroing(chosen, key, node_id, role))
        elif name == "dp":
            wrappers.append(_privacy(config, chosen, key, node_id, role, values, expected, num_children))
        elif values["sampling"] == "poisson" and values["mode"] == "sync":
            raise ConfigError(
                f"{key}: secure aggregation needs each round's cohort known in advance (its threshold and mask "
                f"group); {origin['sampling']}: poisson draws a cohort of any size. Use sampling: fixed there"
            )
        else:
            size_key = origin["buffer"] if values["mode"] == "async" else origin["cohort"]
            wrappers.append(
                _secagg(config, chosen, key, node_id, role, values, (int(expected), num_children, size_key), dp_entry)
            )
    params = AggregateParams(
        settings.kind,
        tuple(wrappers),
        compress,
        trim=defaults.trim if settings.trim is None else settings.trim,
        byzantine=defaults.byzantine if settings.byzantine is None else settings.byzantine,
        keep=defaults.keep if settings.keep is None else settings.keep,
        adapter=adapter_fold(config, settings.kind, wrapped, node_id, role, values, origin),
    )
    if params.privacy is not None and params.privacy.distributed and params.secagg is None:
        raise ConfigError(
            f"{wrapped['dp']}.distributed: distributed DP has the children add the noise under secure aggregation, "
            f"so no server sees an un-noised sum; {node_id!r} has none: wrap secagg inside dp there "
            "(aggregate: {wrap: [{dp: {...}}, secagg]})"
        )
    children_are_clients = role is Role.EDGE or (role is Role.ROOT and config.tree.flat)
    if config.tree.tempo and role is Role.ROOT:
        for name in ("dp", "secagg"):
            if name in wrapped:
                raise ConfigError(
                    f"tree.tempo: Tempo sets each edge's next epochs from the model it sent up (omega = ||w_m - "
                    f"w_root||), which {wrapped[name]} at 'root' protects (the root may see only a clipped-and-noised "
                    "or masked sum); put the privacy at the edges, or turn Tempo off"
                )
    _check_rule(params, node_id, role, values, origin, max(1, round(expected)), children_are_clients, wrapped)
    return params


def _wrap_entries(
    settings: AggregateSettings, node_id: str, values: dict[str, Any], origin: dict[str, str]
) -> list[tuple[str, Any, str]]:
    """The node's wrappers as (name, settings, key), outermost first: ``aggregate.wrap`` and the shorthands.

    The list must follow the one order they compose in (``WRAPPERS``); a wrapper set both
    in the list and by its shorthand (``privacy:``, ``secure_aggregation:``,
    ``aggregate.compress``) is an error naming both keys.
    """
    base = origin["aggregate"]
    listed = [(w.name, getattr(w, w.name), f"{base}.wrap[{i}].{w.name}") for i, w in enumerate(settings.wrap)]
    for (before, _, before_key), (name, _, key) in itertools.pairwise(listed):
        if WRAPPERS.index(name) <= WRAPPERS.index(before):
            raise ConfigError(
                f"{key}: {name} cannot come after {before} ({before_key}); wrappers compose outermost first in the "
                f"order {', '.join(WRAPPERS)} (children's compressed updates are decoded before zeroing checks them; "
                "dp clips before secagg masks and adds its noise after the sum is unmasked), each at most once"
            )
    shorthands = (
        ("compress", settings.compress, f"{base}.compress"),
        ("dp", values["privacy"], origin["privacy"]),
        ("secagg", values["secure_aggregation"], origin["secure_aggregation"]),
    )
    entries = list(listed)
    for name, chosen, key in shorthands:
        if chosen is None:
            continue
        twice = [k for n, _, k in listed if n == name]
        if twice:
            raise ConfigError(f"{key} and {twice[0]} both set the {name} wrapper of {node_id!r}: keep one of them")
        entries.append((name, chosen, key))
    return sorted(entries, key=lambda entry: WRAPPERS.index(entry[0]))


def _check_rule(
    params: AggregateParams,
    node_id: str,
    role: Role,
    values: dict[str, Any],
    origin: dict[str, str],
    cohort: int,
    children_are_clients: bool,
    wrapped: dict[str, str],
) -> None:
    """What a rule other than the mean needs of its node (its ``RuleTraits``); errors name the key and the value.

    DP and secure aggregation wrap a sum (the mean's), whatever the kind, so no other kind
    goes inside them; an asynchronous server folds buffers of arrivals, not a round's cohort.
    ``wrapped``: the node's wrappers, by name, with the key that set each.
    """
    kind = params.kind
    if kind == "mean":
        return
    key, traits = f"{origin['aggregate']}.kind", rule_traits(kind)
    if role is Role.CLIENT:
        raise ConfigError(f"{key}: {kind} folds a server's children; {node_id!r} is a client and has none")
    for other, what in (("dp", "clipped, noised sums"), ("secagg", "masked sums")):
        if other in wrapped:
            raise ConfigError(
                f"{key}: {kind} cannot be combined with {wrapped[other]} at {node_id!r}: that server folds "
                f"{what} of its children's updates, never a child's model, so its aggregate.kind must be mean"
            )
    if traits.whole_round and values["mode"] == "async":
        raise ConfigError(
            f"{key}: {kind} folds a synchronous round's whole cohort; {node_id!r} runs asynchronously "
            f"({origin['mode']}: async, buffers of arrivals): use mode: sync there, or aggregate.kind: mean"
        )
    if traits.steps and not children_are_clients:
        raise ConfigError(
            f"{key}: {kind} divides each child's update by its local steps, which only clients report; the "
            f"children of {node_id!r} are servers"
        )
    if traits.steps and values["proxy_train"] == "async":
        raise ConfigError(
            f"{key}: {kind} would fold {node_id!r}'s own proxy TRAIN (proxy_train: async) like a child, but it has "
            f"no client's step count; use {origin['proxy_train']}: true (after aggregating) or false"
        )
    if traits.cohort_error is not None:
        n = cohort + (values["proxy_train"] == "async")  # its own proxy TRAIN is one more contribution
        error = traits.cohort_error(params, n)
        if error is not None:
            raise ConfigError(f"{key}: {error} ({node_id!r} folds {n} models a round: its cohort)")


def _privacy(
    config: ExperimentConfig,
    settings: PrivacySettings,
    key: str,
    node_id: str,
    role: Role,
    values: dict[str, object],
    expected: float,
    children: int,
) -> PrivacyParams:
    """A server's ``dp`` wrapper (``privacy:``) resolved for its cohort (``expected`` of its ``children``) and
    with its noise seed; errors name the key.

    At an asynchronous server (DP-FedBuff) a fold is a flush of ``buffer`` updates, one per
    child at most, so ``expected`` is the buffer and the accountant assumes no sampling
    (``population == expected``: docs/privacy.md, "At an asynchronous server"). A
    ``target_epsilon`` leaves the noise multiplier to ``privacy_plan.py``, which knows the
    rounds the server is planned to run.
    """
    _check_server_fold(key, "client-level DP", node_id, role, values)
    asynchronous = values["mode"] == "async"
    _check_flush(key, "a DP flush", node_id, values, int(expected), children)
    adaptive = None
    if settings.adaptive is not None:
        a = settings.adaptive
        adaptive = AdaptiveClip(a.quantile, a.lr, a.count_noise if a.count_noise is not None else expected / 20)
    params = PrivacyParams(
        clip=settings.clip,
        noise_multiplier=settings.noise_multiplier if settings.noise_multiplier is not None else 0.0,
        expected=expected,
        population=int(expected) if asynchronous else children,  # asynchronous: every child may be in every flush
        noise_seed=derive_seed(config.seed, "privacy", node_id),
        delta=settings.delta,
        adaptive=adaptive,
        randomness=settings.randomness,
        poisson=values["sampling"] == "poisson" and not asynchronous,
        accountant=settings.accountant,
        budget=PrivacyBudget(key, settings.target_epsilon, settings.max_epsilon),
        canaries=_canaries(config, node_id),
        distributed=settings.distributed,
    )
    if settings.target_epsilon is None:
        check_noise_split(params, key, default=settings.adaptive is not None and settings.adaptive.count_noise is None)
    return params


def _canaries(config: ExperimentConfig, node_id: str) -> CanaryParams | None:
    """The audit's canaries at a DP server (``eval.privacy_audit``), seeded by (run seed, server); None without."""
    audit = config.eval.privacy_audit
    return None if audit is None else CanaryParams(audit.canaries, derive_seed(config.seed, "canary", node_id))


def check_noise_split(params: PrivacyParams, key: str, default: bool = False) -> None:
    """Adaptive clipping's count noise must leave the update some of the noise multiplier (``default``: it is unset)."""
    try:
        params.update_noise_multiplier  # noqa: B018  (validates the split of the budget)
    except ValueError as exc:
        origin = f"; not set, it is the default: {params.expected:g} contributions a fold / 20" if default else ""
        raise ConfigError(f"{key}.adaptive.count_noise: {exc}{origin}") from None


def _compress(
    settings: CompressSettings, key: str, node_id: str, role: Role, wrapped: dict[str, str]
) -> CompressParams:
    """A server's ``compress`` wrapper (what its children send it); a client has no children to compress.

    ``wrapped``: the server's wrappers by name, with the key that set each. With
    ``zeroing`` or ``dp`` among them its children send a non-finite update as it is, for
    the server to fold as no update and count (``nonfinite: "send"``); otherwise they
    refuse to compress one (``compression.py``).
    Top-k with ``secagg`` is refused: masking makes every child's upload dense.
    """
    if role is Role.CLIENT:
        raise ConfigError(
            f"{key}: compression is set where updates are received (the parent); "
            f"{node_id!r} is a client and has no children"
        )
    if settings.kind == "topk" and "secagg" in wrapped:
        raise ConfigError(
            f"{key}.kind: topk cannot be combined with {wrapped['secagg']} at {node_id!r}: secure aggregation masks "
            "every value of each child's update, so the upload is dense whatever top-k keeps; the sparsity would "
            "save nothing and comm/up_bytes would count 8k bytes for it. Use kind: int8, or no compression"
        )
    check_topk_fraction(settings.kind, settings.fraction, key)
    nonfinite = "send" if "zeroing" in wrapped or "dp" in wrapped else "error"  # both fold it as no update, counted
    return CompressParams(settings.kind, settings.fraction, settings.block, settings.error_feedback, nonfinite)


def _zeroing(settings: ZeroingSettings, key: str, node_id: str, role: Role) -> ZeroingParams:
    """A server's ``zeroing`` wrapper; a client folds no children."""
    if role is Role.CLIENT:
        raise ConfigError(f"{key}: zeroing checks a server's children's updates; {node_id!r} is a client")
    return ZeroingParams(settings.max_norm if settings.max_norm is not None else float("inf"))


def _check_server_fold(key: str, what: str, node_id: str, role: Role, values: dict[str, object]) -> None:
    """DP and secure aggregation change how a server folds its children: not for clients, nor for a proxy TRAIN
    folded like a child."""
    if role is Role.CLIENT:
        raise ConfigError(f"{key}: {what} is a server's (it folds its children's updates); {node_id!r} is a client")
    if values["proxy_train"] == "async":
        raise ConfigError(
            f"{key}: {node_id!r} trains on its proxy split alongside its children (proxy_train: async), which "
            f"{what} would fold as one of them; use proxy_train: true (after aggregating) or false"
        )


def _check_flush(key: str, what: str, node_id: str, values: dict[str, object], buffer: int, children: int) -> None:
    """At an asynchronous server a DP or secure-aggregation flush takes one update per child: its buffer must fit."""
    if values["mode"] == "async" and buffer > children:
        raise ConfigError(
            f"{key}: {what} takes at most one update per child, so buffer ({buffer}) cannot exceed the "
            f"{children} children {node_id!r} has"
        )


def _secagg(
    config: ExperimentConfig,
    settings: SecureAggregationSettings,
    key: str,
    node_id: str,
    role: Role,
    values: dict[str, object],
    sizes: tuple[int, int, str],
    privacy: PrivacySettings | None,
) -> SecAggParams:
    """A server's ``secagg`` wrapper resolved (threshold, mask seed); errors name the key. ``sizes``: the
    contributions a fold expects (cohort, or async buffer), the children, the key that set the first; ``privacy``:
    ``dp`` around it. A threshold below 2 is refused: a sum of one child's update would be unmasked."""
    cohort, children, size_key = sizes
    _check_server_fold(key, "secure aggregation", node_id, role, values)
    _check_flush(key, "a secure-aggregation flush", node_id, values, cohort, children)
    if settings.fraction_bits >= settings.bits - 1:
        raise ConfigError(f"{key}.fraction_bits: {settings.fraction_bits} leaves no integer bits of {settings.bits}")
    if privacy is not None and privacy.adaptive is not None:
        raise ConfigError(
            f"{key}: adaptive clipping with secure aggregation is not supported yet (the unclipped count would need "
            f"its own masked sum); use a fixed dp clip without adaptive"
        )
    neighbours = _neighbours(settings, key, children if values["mode"] == "async" else cohort)
    majority = min(neighbours or cohort, cohort) // 2 + 1  # of the neighbours, and of an asynchronous buffer
    threshold = settings.threshold if settings.threshold is not None else majority
    if threshold < 2:
        folds = "flush" if values["mode"] == "async" else "round"
        named = f"{key}.threshold: {threshold}" if settings.threshold is not None else f"{size_key}: {cohort}"
        raise ConfigError(
            f"{named} lets {node_id!r} unmask a {folds} that one child's update alone went into: the 'sum' would be "
            "that child's update, so secure aggregation would hide nothing; it needs a threshold of at least 2 "
            f"(and so at least 2 children a {folds})"
        )
    if threshold > cohort:
        folds = "its buffer holds at a flush" if values["mode"] == "async" else f"{node_id!r} calls a round"
        raise ConfigError(f"{key}.threshold: {threshold} is more than the {cohort} children {folds}")
    if neighbours is not None and threshold > neighbours:
        raise ConfigError(
            f"{key}.threshold: {threshold} is more than the {neighbours} neighbours of graph: sparse (a dropped "
            f"client's key is rebuilt from its neighbours' shares alone)"
        )
    seed = derive_seed(config.seed, "secagg", node_id)
    return SecAggParams(threshold, seed, settings.bits, settings.fraction_bits, neighbours, settings.randomness)


def _neighbours(settings: SecureAggregationSettings, key: str, group: int) -> int | None:
    """SecAgg+'s k for ``graph: sparse`` (even, below the mask group of ``group`` children), None for complete.

    Unset: ``2 ceil(log2 group)`` (Bell et al.'s O(log n)), capped at the largest even k below the group.
    """
    if settings.graph == "complete":
        if settings.neighbours is not None:
            raise ConfigError(
                f"{key}.neighbours: {settings.neighbours} needs graph: sparse (complete masks every pair)"
            )
        return None
    k = settings.neighbours
    if k is None:
        k = min(2 * math.ceil(math.log2(max(group, 2))), (group - 1) // 2 * 2)
    if k % 2:
        raise ConfigError(f"{key}.neighbours: {k} is odd; the Harary mask graph needs an even number of neighbours")
    if k < 2 or k >= group:
        raise ConfigError(f"{key}.neighbours: {k} must be at least 2 and below the mask group of {group} children")
    return k


def check_dp_sgd(
    train: TrainSettings,
    key: str,
    node_id: str,
    role: Role,
    task: str,
    tuned: str | None = None,
    proximal: str = "FedProx's term",
) -> None:
    """DP-SGD protects a client's examples; what it cannot be combined with is rejected here.

    ``task``: the run's ``data.task``; ``tuned``: the key of a tuned NODEOPT (``interp``) at the
    node, which would choose its model by the loss on held-out rows no DP-SGD step protects;
    ``proximal``: what ``mu`` is in the error (FedProx's term; Ditto's lambda for ``personal``).
    """
    if train.dp_sgd is None:
        return
    from bhfl_core.learning.task_kinds import get_task_kind

    if not get_task_kind(task).per_example_loss:
        raise ConfigError(
            f"{key}.dp_sgd: data.task {task!r} averages its loss over the batch's tokens, so one example's gradient "
            "depends on the others in its batch and per-example clipping bounds nothing; DP-SGD needs a task with a "
            "per-example loss (classification)"
        )
    if tuned is not None:
        raise ConfigError(
            f"{key}.dp_sgd: {tuned} is interp, which picks {node_id!r}'s model by its loss on held-out rows that no "
            "DP-SGD step protects; use a NODEOPT that is not tuned there"
        )
    if role is not Role.CLIENT:
        raise ConfigError(
            f"{key}.dp_sgd: sample-level DP-SGD protects clients' private examples; {node_id!r} trains on the proxy "
            "split (use privacy: at a server for client-level DP)"
        )
    if train.mu > 0:
        raise ConfigError(
            f"{key}.dp_sgd: {proximal} (mu: {train.mu}) would be overwritten by the DP optimizer; set mu: 0"
        )
    if train.precision != "fp32":
        raise ConfigError(f"{key}.dp_sgd: DP-SGD runs in fp32 only (precision is {train.precision!r})")
