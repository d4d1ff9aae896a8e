"""Load an experiment config: YAML file + ``--set key.path=value`` overrides -> validated config.

All user mistakes surface as ``ConfigError`` with the offending file or dotted key in
the message: unreadable YAML or a key written twice (``yaml_reader.py``, which reads
every YAML a user writes), unknown keys, wrong types, impossible trees (checked by
building the tree with the configured number of clients per language).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from bhfl_core.config.base import ConfigError
from bhfl_core.config.schema import ExperimentConfig
from bhfl_core.config.topology import build_tree, placeholder_clients
from bhfl_core.config.yaml_reader import parse_yaml, read_yaml_file


def apply_override(data: dict[str, Any], assignment: str) -> dict[str, Any]:
    """Apply one ``a.b.c=value`` (value parsed as YAML) to a nested dict, returning a copy."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. tree.root.rounds=2")
    path, raw = assignment.split("=", 1)
    keys = path.strip().split(".")
    if not all(keys):
        raise ConfigError(f"--set {assignment!r}: empty key in {path!r}")
    value = parse_yaml(raw, f"--set {path}: value {raw!r}")
    out = copy.deepcopy(data)
    cursor = out
    for i, name in enumerate(keys[:-1]):
        key = _existing_key(cursor, name)
        nxt = cursor.setdefault(key, {})
        if nxt is None:
            nxt = cursor[key] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {path}: {'.'.join(keys[: i + 1])} is a value, not a section")
        cursor = nxt
    cursor[_existing_key(cursor, keys[-1])] = value
    return out


def _existing_key(mapping: dict[Any, Any], name: str) -> Any:
    """``name``, or the integer key YAML read for it (``tree.levels.2`` -> the key ``2`` of ``levels: {2: ...}``)."""
    if name not in mapping and re.fullmatch(r"-?[0-9]+", name) and int(name) in mapping:  # not `²`: isdigit, no int
        return int(name)
    return name


# discriminated unions: pydantic puts the chosen ``kind`` in the error location; users never wrote it
_UNIONS = {"source": {"embedded", "xglue", "prepared"}, "clustering": {"language", "kmeans"}}


def _names_its_key(msg: str, loc: str) -> bool:
    """Whether ``msg`` already starts with a key path at or below ``loc`` (``tree.groups.europe: ...``)."""
    head = msg.split(": ", 1)[0] if ": " in msg else ""
    if not head or " " in head or not head[0].isalpha():
        return False
    return not loc or head == loc or head.startswith((f"{loc}.", f"{loc}["))


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        parts = [
            p
            for i, p in enumerate(err["loc"])
            if not str(p).startswith(("function-", "constrained-"))
            and p != "[key]"  # a mapping's key: its path
            and not (i and str(err["loc"][i - 1]) in _UNIONS and p in _UNIONS[str(err["loc"][i - 1])])
        ]
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".") or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; docs/config.md lists every key)"
        if _names_its_key(msg, "" if not parts else loc):  # a validator's message that starts with its key path
            lines.append(msg)
        else:
            lines.append(f"{loc}: {msg}")
    return "\n".join(dict.fromkeys(lines))


def validate_tree(config: ExperimentConfig) -> None:
    """Build the tree with placeholder clients (real ids and edges) so impossible trees fail before any work.

    A prepared dataset's clients are known only from its manifest: its tree is checked
    when it is built from it, before training.
    """
    if config.data.source.kind != "prepared":
        build_tree(config, placeholder_clients(config))


def config_from_dict(data: Any, overrides: Sequence[str] = (), source: str = "config") -> ExperimentConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {type(data).__name__}")
    for assignment in overrides:
        data = apply_override(data, assignment)
    try:
        config = ExperimentConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid config\n{format_validation_error(exc)}") from None
    validate_tree(config)
    return config


def merge(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """Deep merge: mappings merge key by key; anything else (and an empty mapping ``{}``) replaces.

    A mapping that changes ``kind`` (e.g. ``data.source: {kind: xglue, ...}`` over an
    embedded source) replaces the inherited one: the old kind's keys mean nothing to the new.
    """
    out = copy.deepcopy(base)
    for key, value in child.items():
        old = out.get(key)
        switches = (
            isinstance(value, dict) and isinstance(old, dict) and value.get("kind", old.get("kind")) != old.get("kind")
        )
        if isinstance(value, dict) and value and isinstance(old, dict) and not switches:
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def read_yaml(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a config file, resolving ``base: other.yaml`` (relative to the file) recursively."""
    data = read_yaml_file(path)
    if data is None:  # an empty file (or only comments) is a mistake, not a wish for the built-in defaults
        raise ConfigError(
            f"{path}: the config file is empty; give at least the keys that differ from the defaults, "
            "e.g. `base: embedded.yaml` and `name: my-run` (docs/config.md)"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{path}: base: expected a config file name (relative to this file), got {base!r}")
    try:
        base_path = (path.parent / base).resolve()
    except (OSError, ValueError) as exc:  # a name the OS refuses (NUL byte, a symlink loop)
        raise ConfigError(f"{path}: base: {base!r} is not a usable file name ({exc})") from None
    if base_path in _seen:
        raise ConfigError(f"{path}: base: {base} includes itself")
    return merge(read_yaml(base_path, (*_seen, path.resolve())), data)


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> ExperimentConfig:
    path = Path(path)
    return config_from_dict(read_yaml(path), overrides, source=str(path))
