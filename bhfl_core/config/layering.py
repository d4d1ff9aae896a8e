"""Where each of a node's settings comes from, and the keys only one mode of server reads.

A node's settings are layered: its level's block (``tree.root``, ``tree.server``,
``tree.edge``, ``tree.client``), for an intermediate server ``tree.levels.<depth>``, then
``tree.nodes.<id>`` (``layered``). A level's value applies to all its nodes, and a per-depth
or per-node entry may make some of them asynchronous, so whether a mode-specific key is read
is a question about the nodes that take their value from where it was written, its readers
(``check_mode_keys``):

- ``concurrency``, ``buffer``, ``staleness`` are read by the asynchronous engine only
  (``bhfl_core/algorithm/async_engine.py``). Written where none of its readers is an
  asynchronous server (synchronous servers, clients), the key is an error naming where it
  was written. A level value with one asynchronous reader is accepted (it applies to that
  one). A level block holding the default (``buffer: 2``) is not refused: every saved config
  (a run's ``config.yaml``) writes every key, so the default is what "not written" reads as.
- ``cohort`` is not read by an asynchronous server. One written in a ``tree.levels.<depth>``
  or ``tree.nodes.<id>`` entry whose readers are all asynchronous is an error; one in a level
  block is ignored there (docs/config.md ``mode``): a config made asynchronous over a
  synchronous base inherits the base's level cohort (configs/async-fedbuff.yaml's root,
  configs/bhfl-async.yaml's edges), and the loader cannot tell it from one written anew.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from bhfl_core.algorithm.tree import Node, Role
from bhfl_core.config.base import ConfigError
from bhfl_core.config.schema import ExperimentConfig
from bhfl_core.config.selectors import LEVEL_KEY
from bhfl_core.config.tree_schema import LevelSettings, NodeOverride

ASYNC_KEYS = ("concurrency", "buffer", "staleness")
"""Level keys only an asynchronous server (``mode: async``) reads."""

_OVERRIDES = ("tree.levels.", "tree.nodes.")


def layered(config: ExperimentConfig, node_id: str, role: Role, depth: int) -> tuple[dict[str, Any], dict[str, str]]:
    """Each settings key's value and where it was written: the level block, then ``tree.levels.<depth>``
    (intermediate servers), then ``tree.nodes.<id>``."""
    level_key = f"tree.{LEVEL_KEY[role]}"
    level: LevelSettings = getattr(config.tree, LEVEL_KEY[role])
    values = {key: getattr(level, key) for key in LevelSettings.model_fields}
    origin = {key: f"{level_key}.{key}" for key in values}
    layers = [(f"tree.nodes.{node_id}", config.tree.nodes.get(node_id, NodeOverride()))]
    if role is Role.SERVER and depth in config.tree.levels:
        layers.insert(0, (f"tree.levels.{depth}", config.tree.levels[depth]))
    for where, override in layers:
        for key in override.model_fields_set:  # keys written in YAML; `cohort: null` means "all children"
            if getattr(override, key) is None and key != "cohort":
                continue
            values[key] = getattr(override, key)
            origin[key] = f"{where}.{key}"
    return values, origin


def check_mode_keys(config: ExperimentConfig, nodes: Iterable[Node]) -> None:
    """Refuse an asynchronous-only key no asynchronous server reads, and a per-depth or per-node cohort only
    asynchronous servers read (the module docstring has the rule)."""
    readers: dict[str, tuple[Any, list[Node], list[str]]] = {}  # where written -> (value, readers, their mode's key)
    for node in nodes:
        values, origin = layered(config, node.id, node.role, node.depth)
        for key in (*ASYNC_KEYS, "cohort"):
            _, group, modes = readers.setdefault(origin[key], (values[key], [], []))
            group.append(node)
            modes.append(origin["mode"])
    for where, (value, group, modes) in readers.items():
        key = where.rsplit(".", 1)[1]
        asynchronous = [n.settings.asynchronous is not None for n in group]
        if key == "cohort":
            if value is not None and where.startswith(_OVERRIDES) and all(asynchronous):
                raise ConfigError(
                    f"{where}: {_names(group)} {'runs' if len(group) == 1 else 'run'} asynchronously ({modes[0]}: "
                    f"async): FedBuff calls children as others finish and samples no cohort, so cohort {value} would "
                    "never be used; drop the key"
                )
        elif not any(asynchronous) and (where.startswith(_OVERRIDES) or value != _default(key)):
            raise ConfigError(
                f"{where}: {key} is read only by asynchronous servers (mode: async, FedBuff), and "
                f"{_why_synchronous(group, modes[0])}; {_remedy(where, key)}"
            )


def _default(key: str) -> Any:
    return LevelSettings.model_fields[key].default


def _names(group: list[Node]) -> str:
    shown = ", ".join(repr(n.id) for n in group[:3])
    return shown + (f" and {len(group) - 3} more" if len(group) > 3 else "")


def _why_synchronous(group: list[Node], mode: str) -> str:
    one = len(group) == 1
    if group[0].role is Role.CLIENT:
        return f"{_names(group)} {'is a client' if one else 'are clients'}, which never run asynchronously"
    return f"{_names(group)} {'runs' if one else 'run'} synchronously ({mode}: sync)"


def _remedy(where: str, key: str) -> str:
    if where.startswith(_OVERRIDES):
        return "drop the key, or set it where mode: async is"
    default = "{}" if key == "staleness" else _default(key)
    return f"drop the key, or set it where mode: async is (one a base config sets is undone by {where}={default})"
