"""Sweep configs: one experiment config crossed with named variants, a grid of keys and seeds.

A YAML file with a top-level ``grid:``, ``seeds:`` or ``configs:`` key is a sweep
(docs/sweeps.md)::

    name: eta-down                      # the sweep's name (letters, digits, _.-); default: the file's stem
    base: ../configs/embedded.yaml      # the experiment config every point starts from (relative to this file)
    set: {tree.root.rounds: 4}          # dotted keys for every point (as --set)
    configs:                            # named variants (optional), each {base: FILE, set: {KEY: VALUE}}
      hierfavg: {base: ../configs/hierfavg.yaml}
      bhfl: {set: {tree.edge.eta_down: 0.5}}
    grid:                               # dotted key -> the values it takes; the points are the product
      tree.client.eta_down: [1.0, 0.5]
    seeds: [0, 1, 2]                    # every point once per seed
    baseline: hierfavg                  # optional: the config the report compares every other against,
                                        # seed by seed (a point's label without its seed part)

The points are variants x grid x seeds, in that order (file order within each). How a
point's experiment config is made, lowest precedence first: its variant's ``base`` (else
the sweep's), the sweep's ``set``, the variant's ``set``, the ``--set`` overrides, its
grid values, its seed. A key the grid sweeps cannot also be set (the grid would silently
win); ``name`` and ``seed`` are not grid keys (``seeds:`` is). Each point keeps its config's
experiment ``name``: a sweep runs ordinary experiments, grouped by the sweep.

Each point has a label that stays the same for the same spec (``hierfavg,eta_down=0.5,seed=1``:
the variant, each grid key by its shortest unambiguous dotted suffix, the seed) and a
config hash: what identifies the experiment when a sweep resumes or is re-run (two
points with one hash are an error). Everything here is pure: parsing, expansion and
validation; every mistake is a ``ConfigError`` naming the file, the key and the value.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bhfl_core.config.base import ConfigError
from bhfl_core.config.loader import apply_override, config_from_dict, read_yaml
from bhfl_core.config.pipeline import is_pipeline, read_pipeline_yaml
from bhfl_core.config.schema import ExperimentConfig, dump
from bhfl_core.config.tree_schema import NodeOverride
from bhfl_core.config.yaml_reader import parse_yaml

TOP_KEYS = ("name", "base", "set", "configs", "grid", "seeds", "baseline")
SWEEP_KEYS = ("grid", "seeds", "configs")  # any of these at the top level makes a file a sweep
VARIANT_KEYS = ("base", "set")
# keys that change where and how a run runs, not what it computes (as for `bhfl resume --set`): not hashed
# and eval.figures, what the report draws of the same numbers (added later: hashes taken before it still match)
UNHASHED = ("runtime", "eval.batch_size", "eval.figures")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def config_hash(config: ExperimentConfig) -> str:
    """16 hex digits of SHA-256 over the resolved config, the ``UNHASHED`` keys left out.

    The formula of the ``bhfl.config_hash`` tag every run carries, over what decides its
    results only: a sweep resumed on fewer workers still recognises its finished runs.
    """
    data = dump(config)
    for dotted in UNHASHED:
        section, _, key = dotted.partition(".")
        if key:
            data.get(section, {}).pop(key, None)
        else:
            data.pop(section, None)
    _as_first_hashed(data.get("tree", {}))
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _as_first_hashed(tree: dict[str, Any]) -> None:
    """Per-node and per-depth entries in the form the hash was first taken over: every key, null where unset
    (``NodeOverride`` dumps only the keys written now), so runs recorded before still match; an explicit
    ``cohort: null`` (all children), which that form could not tell from an unset one, is marked."""
    for section in ("nodes", "levels"):
        for entry in (tree.get(section) or {}).values():
            if "cohort" in entry and entry["cohort"] is None:
                entry["cohort_all_children"] = True
            for key in NodeOverride.model_fields:
                entry.setdefault(key, None)


@dataclass(frozen=True)
class Point:
    """One experiment of a sweep: its label, what it sweeps (key -> value) and its validated config."""

    label: str
    values: dict[str, Any]
    config: ExperimentConfig
    hash: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hash", config_hash(self.config))


def config_label(label: str) -> str:
    """A point's label without its seed part (always last): the label of its config (``hierfavg,eta_down=0.5``)."""
    if label.startswith("seed="):
        return ""
    head, seed_part, _ = label.rpartition(",seed=")
    return head if seed_part else label


@dataclass(frozen=True)
class Sweep:
    name: str
    points: tuple[Point, ...]
    baseline: str | None = None  # a config label (``config_label``) the report pairs the others against

    def __iter__(self) -> Iterator[Point]:
        return iter(self.points)

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, label: str) -> Point:
        for p in self.points:
            if p.label == label:
                return p
        raise KeyError(label)

    @property
    def labels(self) -> list[str]:
        return [p.label for p in self.points]

    def dump(self) -> dict[str, Any]:
        """The resolved sweep as plain data: every point's full config (``sweep.yaml``; ``sweep_from_dump``)."""
        return {
            "name": self.name,
            "baseline": self.baseline,
            "points": {p.label: {"values": p.values, "config": dump(p.config)} for p in self.points},
        }


def is_sweep(data: Any) -> bool:
    """Whether a config file's top level is a sweep (it has ``grid:``, ``seeds:`` or ``configs:``)."""
    return isinstance(data, dict) and any(k in data for k in SWEEP_KEYS)


def parse_grid_option(assignment: str) -> tuple[str, list[Any]]:
    """``--grid KEY=V1,V2,...`` -> (KEY, [V1, V2, ...]); values parsed as YAML (``{a: 1, b: 2}`` stays one)."""
    if "=" not in assignment:
        raise ConfigError(f"--grid {assignment!r}: expected KEY=V1,V2,..., e.g. tree.edge.eta_down=1.0,0.5")
    key, raw = (s.strip() for s in assignment.split("=", 1))
    return key, parse_yaml(f"[{raw}]", f"--grid {key}: values {raw!r}")


def parse_seeds(text: str) -> list[int]:
    """``--seeds 0,1,2`` -> [0, 1, 2] (``0-4`` is 0 to 4 inclusive)."""
    seeds: list[int] = []
    for part in filter(None, (s.strip() for s in text.split(","))):
        low, dash, high = part.partition("-")
        try:
            seeds.extend(range(int(low), int(high) + 1) if dash and low else [int(part)])
        except ValueError:
            raise ConfigError(f"--seeds {text!r}: {part!r} is not an integer or a range like 0-4") from None
    return seeds


def _format(value: Any) -> str:
    """A value as it appears in a label: strings bare, the rest as compact JSON (``0.5``, ``true``)."""
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), default=str)


def short_keys(keys: Sequence[str]) -> dict[str, str]:
    """Each dotted key's shortest suffix that no other key ends with (``tree.edge.eta_down`` -> ``edge.eta_down``
    beside ``tree.client.eta_down``; ``eta_down`` alone)."""
    out: dict[str, str] = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            suffix = ".".join(parts[-n:])
            if not any(other != key and (other == suffix or other.endswith("." + suffix)) for other in keys):
                break
        out[key] = suffix
    return out


def _assign(data: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """``data`` with the dotted ``key`` set to an already parsed value (the path logic of --set)."""
    return apply_override(data, f"{key}={json.dumps(value, default=str)}")


def _mapping(value: Any, where: str, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected {what}, got {value!r}")
    return value


def _check_keys(mapping: dict[str, Any], where: str) -> None:
    for key in mapping:
        if not isinstance(key, str) or not key or not all(key.split(".")):
            raise ConfigError(f"{where}: {key!r} is not a dotted config key (e.g. tree.edge.eta_down)")


def _no_pipeline(data: Any, path: Path, where: str = "") -> None:
    """A pipeline file where a sweep needs an experiment config: a ConfigError saying so (it was "stages: unknown
    key", as if the file were a misspelt experiment)."""
    if is_pipeline(data):
        prefix = f"{where}: " if where else ""
        raise ConfigError(
            f"{prefix}{path} is a pipeline (top-level stages:), and a sweep's points are experiment configs: a "
            f"pipeline is not swept. Run it once per value (`bhfl run {path} --set seed=1`, or --set "
            "stages.<stage>.KEY=VALUE for one stage), or sweep one stage's experiment config"
        )


def _base_data(base: Any, base_dir: Path, where: str) -> dict[str, Any]:
    if not isinstance(base, str):
        raise ConfigError(f"{where}: expected a config file name, got {base!r}")
    path = (base_dir / base).resolve()
    _no_pipeline(read_pipeline_yaml(path) if path.is_file() else None, path, where)
    try:
        return read_yaml(path)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


@dataclass(frozen=True)
class _Variant:
    name: str  # "" when the sweep has no configs:
    data: dict[str, Any]  # its base file's experiment config
    sets: dict[str, Any]  # the sweep's set, then its own


def _variants(data: dict[str, Any], source: str, base_dir: Path) -> list[_Variant]:
    shared = _mapping(data.get("set"), f"{source}: set", "a mapping of dotted config keys to values")
    _check_keys(shared, f"{source}: set")
    base = data.get("base")
    configs = data.get("configs")
    if configs is None:
        if base is None:
            raise ConfigError(f"{source}: base: a sweep needs an experiment config to start from (base: FILE)")
        return [_Variant("", _base_data(base, base_dir, f"{source}: base"), shared)]
    if not isinstance(configs, dict) or not configs:
        raise ConfigError(f"{source}: configs: expected a non-empty mapping of variant name -> {{base:, set:}}")
    out = []
    for name, raw in configs.items():
        where = f"{source}: configs.{name}"
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"{where}: a variant name has letters, digits and _.- only")
        body = _mapping(raw, where, "a mapping with base: and/or set:")
        if unknown := [k for k in body if k not in VARIANT_KEYS]:
            raise ConfigError(f"{where}: {unknown[0]}: unknown key of a variant; a variant has base and set")
        own_base = body.get("base", base)
        if own_base is None:
            raise ConfigError(f"{where}.base: no base file here and none for the whole sweep (top-level base:)")
        sets = _mapping(body.get("set"), f"{where}.set", "a mapping of dotted config keys to values")
        _check_keys(sets, f"{where}.set")
        where_base = f"{where}.base" if "base" in body else f"{source}: base"
        out.append(_Variant(name, _base_data(own_base, base_dir, where_base), {**shared, **sets}))
    return out


def _grid(data: dict[str, Any], grid_options: Sequence[str], source: str) -> dict[str, list[Any]]:
    grid = dict(_mapping(data.get("grid"), f"{source}: grid", "a mapping of dotted config key -> list of values"))
    _check_keys(grid, f"{source}: grid")
    for option in grid_options:
        key, values = parse_grid_option(option)
        grid[key] = values
    for key, values in grid.items():
        where = f"{source}: grid.{key}" if key in (data.get("grid") or {}) else f"--grid {key}"
        if key in ("name", "seed"):
            hint = "give seeds: (or --seeds)" if key == "seed" else "each point keeps its config's name"
            raise ConfigError(f"{where}: {key} is not a grid key: {hint}")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where}: expected a non-empty list of values, got {values!r}")
        labels = [_format(v) for v in values]
        if len(set(labels)) < len(labels):
            raise ConfigError(f"{where}: a value is listed twice: {values!r}")
    return grid


def _seeds(data: dict[str, Any], seeds: Sequence[int] | None, source: str) -> list[int] | None:
    if seeds is None:
        if "seeds" not in data:
            return None
        seeds = data["seeds"]
        if not isinstance(seeds, list) or not seeds or not all(type(s) is int for s in seeds):
            raise ConfigError(f"{source}: seeds: expected a non-empty list of integers, got {seeds!r}")
    if not seeds:
        raise ConfigError("--seeds: give at least one seed, e.g. --seeds 0,1,2")
    if len(set(seeds)) < len(seeds):
        raise ConfigError(f"{source}: seeds: a seed is listed twice: {list(seeds)!r}")
    return list(seeds)


def _point_config(
    variant: _Variant, overrides: Sequence[str], values: dict[str, Any], seed: int | None, where: str
) -> ExperimentConfig:
    data = variant.data
    try:
        for key, value in variant.sets.items():
            data = _assign(data, key, value)
        for assignment in overrides:
            data = apply_override(data, assignment)
        for key, value in values.items():
            data = _assign(data, key, value)
        if seed is not None:
            data = _assign(data, "seed", seed)
        return config_from_dict(data, source=where)
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(where) else f"{where}: {message}") from None


def sweep_from_dict(
    data: Any,
    overrides: Sequence[str] = (),
    grid: Sequence[str] = (),
    seeds: Sequence[int] | None = None,
    name: str | None = None,
    source: str = "sweep",
    base_dir: Path = Path("."),
) -> Sweep:
    """The validated sweep of a sweep file's data; ``grid`` (``--grid`` options) adds or replaces grid keys,
    ``seeds`` replaces the file's, ``name`` its name. Every point is validated before this returns."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {type(data).__name__}")
    if unknown := [k for k in data if k not in TOP_KEYS]:
        raise ConfigError(
            f"{source}: {unknown[0]}: unknown top-level key of a sweep; a sweep has {', '.join(TOP_KEYS)} "
            "(experiment keys go in set: as dotted keys, or in the base file)"
        )
    sweep_name = name or data.get("name", Path(source).stem)
    if not isinstance(sweep_name, str) or not _NAME.match(sweep_name):
        raise ConfigError(f"{source}: name: {sweep_name!r} is not a sweep name (letters, digits, _.-)")
    variants = _variants(data, source, base_dir)
    grid_values = _grid(data, grid, source)
    seed_list = _seeds(data, seeds, source)
    set_keys = {k for v in variants for k in v.sets} | {a.split("=", 1)[0].strip() for a in overrides}
    for key in grid_values:
        clash = [k for k in set_keys if k == key or k.startswith(key + ".") or key.startswith(k + ".")]
        if clash:
            raise ConfigError(f"{source}: grid.{key}: {clash[0]} is also set (set: or --set); the grid would win")
    if seed_list is not None and "seed" in set_keys:
        raise ConfigError(f"{source}: seeds: seed is also set (set: or --set); the seeds would win")
    if len(variants) == 1 and not variants[0].name and not grid_values and seed_list is None:
        # the config's own mistakes first (a typo'd `grid:` in an experiment file is an unknown key there)
        _point_config(variants[0], overrides, {}, None, source)
        raise ConfigError(f"{source}: nothing to sweep: give a grid (grid: or --grid KEY=V1,V2) or seeds")
    short = short_keys(list(grid_values))
    points: list[Point] = []
    seen: dict[str, str] = {}
    for variant in variants:
        for combo in itertools.product(*grid_values.values()):
            values = dict(zip(grid_values, combo, strict=True))
            for seed in seed_list if seed_list is not None else [None]:
                parts = [variant.name] if variant.name else []
                parts += [f"{short[k]}={_format(v)}" for k, v in values.items()]
                parts += [f"seed={seed}"] if seed is not None else []
                label = ",".join(parts)
                shown = {**({"config": variant.name} if variant.name else {}), **values}
                shown.update({"seed": seed} if seed is not None else {})
                point = Point(label, shown, _point_config(variant, overrides, values, seed, f"{source}: {label}"))
                if point.config.name == sweep_name:
                    raise ConfigError(
                        f"{source}: name: the sweep and its experiments are both called {sweep_name!r}; their "
                        "folders would mix under the run dir: name the sweep differently"
                    )
                if point.hash in seen:
                    raise ConfigError(
                        f"{source}: points {seen[point.hash]!r} and {label!r} are the same experiment "
                        f"(config hash {point.hash}): drop one value or variant"
                    )
                seen[point.hash] = label
                points.append(point)
    baseline = data.get("baseline")
    configs = list(dict.fromkeys(config_label(p.label) for p in points))
    if baseline is not None and baseline not in configs:
        raise ConfigError(f"{source}: baseline: {baseline!r} is not a config of this sweep; its configs: {configs}")
    return Sweep(sweep_name, tuple(points), baseline)


def load_sweep(
    path: str | Path,
    overrides: Sequence[str] = (),
    grid: Sequence[str] = (),
    seeds: Sequence[int] | None = None,
    name: str | None = None,
) -> Sweep:
    """A sweep from a sweep file, or from an experiment config swept by ``grid`` and ``seeds``.

    An experiment config becomes ``{base: <it>}``; its sweep is named ``<experiment name>-sweep``
    unless ``name`` is given.
    """
    path = Path(path)
    data = read_pipeline_yaml(path)  # the top level as written (duplicate keys are errors)
    if is_sweep(data):
        return sweep_from_dict(data, overrides, grid, seeds, name, source=str(path), base_dir=path.parent)
    _no_pipeline(data, path)
    experiment = read_yaml(path)  # an experiment config (its own base: chain resolved)
    named = [a.split("=", 1)[1].strip() for a in overrides if a.split("=", 1)[0].strip() == "name" and "=" in a]
    default = f"{named[-1] if named else experiment.get('name', path.stem)}-sweep"  # after the experiments' name
    spec = {"name": name or default, "base": path.name}
    return sweep_from_dict(spec, overrides, grid, seeds, source=str(path), base_dir=path.parent)


def sweep_from_dump(data: Mapping[str, Any], source: str) -> Sweep:
    """A resolved sweep (``Sweep.dump``, a sweep folder's ``sweep.yaml``), every config validated again."""
    points = []
    for label, body in dict(data.get("points") or {}).items():
        config = config_from_dict(body["config"], source=f"{source}: points.{label}")
        points.append(Point(str(label), dict(body.get("values") or {}), config))
    return Sweep(str(data["name"]), tuple(points), data.get("baseline"))


def with_overrides(sweep: Sweep, overrides: Sequence[str], labels: Sequence[str], source: str) -> Sweep:
    """The sweep with ``overrides`` applied to the points ``labels`` (a resume's ``runtime.*`` changes)."""
    points = []
    for p in sweep:
        if p.label in labels and overrides:
            config = config_from_dict(dump(p.config), overrides, source=f"{source}: {p.label}")
            points.append(Point(p.label, p.values, config))
        else:
            points.append(p)
    return Sweep(sweep.name, tuple(points), sweep.baseline)
