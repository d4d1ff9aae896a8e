"""A server's ``compress_down`` (compressed broadcasts to its children; ``algorithm/downlink.py``), checked
against the rest of its settings; every error names the key."""

from __future__ import annotations

from typing import Any

from bhfl_core.algorithm.compression import CompressParams
from bhfl_core.algorithm.rule_registry import AggregateParams
from bhfl_core.algorithm.tree import Role
from bhfl_core.config.base import ConfigError
from bhfl_core.config.wrapper_schema import CompressDownSettings, check_topk_fraction


def downlink_params(
    values: dict[str, Any], origin: dict[str, str], node_id: str, role: Role, aggregate: AggregateParams
) -> CompressParams | None:
    """The node's broadcast compression, or None.

    Refused where a broadcast reference cannot be kept: at a client (no children), at an
    asynchronous server (each child is sent its own model version when it is dispatched,
    so there is no round-wide ``x_hat``), and with ``model.adapter.aggregation: exact``
    (its re-factorised product is not a sum of the children's models, so the server's
    residual cannot be added back to it: ``downlink.rebase``).
    """
    settings = values["compress_down"]
    if settings is None:
        return None
    assert isinstance(settings, CompressDownSettings)
    key = origin["compress_down"]
    if role is Role.CLIENT:
        raise ConfigError(f"{key}: compressed broadcasts are set at the server sending them; {node_id!r} is a client")
    if values["mode"] == "async":
        raise ConfigError(
            f"{key}: {node_id!r} runs asynchronously ({origin['mode']}: async), and sends each child the model version "
            "current when it is dispatched, so its children hold no common model to send a compressed change against. "
            "Compress the broadcasts of a synchronous server, or only the updates (aggregate.compress)"
        )
    if aggregate.adapter is not None and aggregate.adapter.aggregation == "exact":
        raise ConfigError(
            f"{key}: model.adapter.aggregation: exact re-factorises the children's mean product, which is not a sum of "
            f"their vectors, so {node_id!r} cannot add back what its compressed broadcast left out. Use ab-mean or ffa"
        )
    check_topk_fraction(settings.kind, settings.fraction, key)
    return CompressParams(settings.kind, settings.fraction, settings.block, error_feedback=True)
