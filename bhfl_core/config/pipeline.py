"""Pipeline configs: one YAML file that chains experiment runs (stages), e.g. GroupPerFL.

A YAML file with a top-level ``stages:`` key is a pipeline (docs/pipelines.md)::

    name: groupperfl                 # the pipeline's name (letters, digits, _.-)
    shared: {seed: 0}                # experiment-config keys every stage gets (optional)
    stages:                          # run in this order
      global: {base: fedadam.yaml}
      group:  {base: embedded.yaml, model: {init_from: "global:root"}}

How a stage's experiment config is made, lowest precedence first: its ``base:`` file
(relative to the pipeline file, resolved as in any config), ``shared``, the stage's
own keys, then the ``--set`` overrides for every stage, then ``--set
stages.<stage>.<key>=...`` for that stage. ``--set name=...`` and ``--set
shared.<key>=...`` edit the pipeline file's own keys. A stage's experiment ``name`` is
``<pipeline>-<stage>`` unless the stage itself sets one.

``model.init_from`` may name an earlier stage (``<stage>`` or ``<stage>:<node>``): the
stage then starts from that stage's run, resolved when it starts (flows/pipeline.py).
Anything else is a run folder, checked before the pipeline starts (flows/records/warm_source.py).

Everything here is pure: parsing, merging and validation; every mistake is a
``ConfigError`` naming the file, the stage and the key.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bhfl_core.config.base import ConfigError
from bhfl_core.config.loader import apply_override, config_from_dict, merge, read_yaml
from bhfl_core.config.schema import ExperimentConfig, dump
from bhfl_core.config.topology import build_tree, placeholder_clients
from bhfl_core.config.yaml_reader import read_yaml_file
from bhfl_core.store.warm_start import KEY as INIT_FROM
from bhfl_core.store.warm_start import config_mismatch, mismatch_reason, parse_init_from

TOP_KEYS = ("name", "shared", "stages")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True)
class Stage:
    """One stage: its name, its validated experiment config, and the earlier stage it starts from.

    ``source_stage`` is set when ``model.init_from`` names an earlier stage (then
    ``config.model.init_from`` still holds the stage reference, e.g. ``global:root``).
    """

    name: str
    config: ExperimentConfig
    source_stage: str | None = None


@dataclass(frozen=True)
class Pipeline:
    name: str
    stages: tuple[Stage, ...]

    def __getitem__(self, stage: str) -> Stage:
        for s in self.stages:
            if s.name == stage:
                return s
        raise KeyError(stage)

    def __iter__(self) -> Iterator[Stage]:
        return iter(self.stages)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    def replace_stage(self, stage: Stage) -> Pipeline:
        return Pipeline(self.name, tuple(stage if s.name == stage.name else s for s in self.stages))

    def dump(self) -> dict[str, Any]:
        """The resolved pipeline as plain data: every stage's full config (``pipeline.yaml``; reloadable)."""
        return {"name": self.name, "stages": {s.name: dump(s.config) for s in self.stages}}


def read_pipeline_yaml(path: Path) -> Any:
    """A YAML file's top level (duplicate keys are errors); ConfigError if missing or not YAML."""
    return read_yaml_file(path)


def is_pipeline(data: Any) -> bool:
    """Whether a config file's top level is a pipeline (it has ``stages:``)."""
    return isinstance(data, dict) and "stages" in data


def _split_overrides(
    overrides: Sequence[str], stages: Sequence[str], source: str
) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """(edits of the pipeline file's own keys, overrides for every stage, overrides per stage)."""
    own: list[str] = []
    every: list[str] = []
    per_stage: dict[str, list[str]] = {s: [] for s in stages}
    for assignment in overrides:
        key = assignment.split("=", 1)[0].strip()
        if key == "name" or key.startswith("shared."):
            own.append(assignment)
        elif key == "stages" or key.startswith("stages."):
            parts = key.split(".", 2)
            if len(parts) < 3 or not parts[2]:
                raise ConfigError(
                    f"--set {assignment}: name a key inside one stage, e.g. stages.<stage>.seed=1 (stages: "
                    f"{', '.join(stages)})"
                )
            if parts[1] not in per_stage:
                raise ConfigError(
                    f"--set {assignment}: {source} has no stage {parts[1]!r} (stages: {', '.join(stages)})"
                )
            per_stage[parts[1]].append(f"{parts[2]}={assignment.split('=', 1)[1]}" if "=" in assignment else parts[2])
        else:
            every.append(assignment)
    return own, every, per_stage


def _check_top(data: Any, source: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The pipeline's name, shared mapping and stage mappings, or a ConfigError naming the bad key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {type(data).__name__}")
    unknown = [k for k in data if k not in TOP_KEYS]
    if unknown:
        hint = " (a stage inherits a config with stages.<stage>.base)" if "base" in unknown else ""
        raise ConfigError(
            f"{source}: {unknown[0]}: unknown top-level key of a pipeline; a pipeline has {', '.join(TOP_KEYS)}{hint}"
        )
    name = data.get("name", Path(source).stem)
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"{source}: name: {name!r} is not a pipeline name (letters, digits, _.-)")
    shared = data.get("shared") or {}
    if not isinstance(shared, dict):
        raise ConfigError(f"{source}: shared: expected a mapping of experiment-config keys, got {shared!r}")
    if "name" in shared:
        raise ConfigError(
            f"{source}: shared.name: each stage's experiment name is <pipeline>-<stage> unless the stage sets "
            "stages.<stage>.name; shared cannot name them all alike"
        )
    if "base" in shared:
        raise ConfigError(f"{source}: shared.base: give base files per stage (stages.<stage>.base)")
    stages = data.get("stages")
    if not isinstance(stages, dict) or not stages:
        raise ConfigError(f"{source}: stages: expected a non-empty mapping of stage name -> experiment config")
    for stage, body in stages.items():
        if not isinstance(stage, str) or not _NAME.match(stage):
            raise ConfigError(f"{source}: stages.{stage}: a stage name has letters, digits and _.- only")
        if body is not None and not isinstance(body, dict):
            raise ConfigError(f"{source}: stages.{stage}: expected a mapping of experiment-config keys, got {body!r}")
    return name, shared, stages


def _stage_data(
    stage: str, body: dict[str, Any] | None, shared: dict[str, Any], pipeline: str, base_dir: Path, where: str
) -> dict[str, Any]:
    """base file, then shared, then the stage's own keys; the default experiment name."""
    own = dict(body or {})
    base = own.pop("base", None)
    data: dict[str, Any] = {}
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{where}.base: expected a file name, got {base!r}")
        try:
            data = read_yaml((base_dir / base).resolve())
        except ConfigError as exc:
            raise ConfigError(f"{where}.base: {exc}") from None
    data = merge(merge(data, shared), own)
    if "name" not in own:
        data["name"] = f"{pipeline}-{stage}"
    return data


def _stage_config(data: dict[str, Any], overrides: Sequence[str], where: str) -> ExperimentConfig:
    try:
        return config_from_dict(data, overrides, source=where)
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(where) else f"{where}: {message}") from None


def _source_stage(stage: Stage, earlier: Mapping[str, Stage], names: Sequence[str], where: str) -> str | None:
    """The earlier stage ``model.init_from`` names (checked against it), or None for a run folder."""
    value = stage.config.model.init_from
    if value is None:
        return None
    try:
        spec = parse_init_from(value)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if spec.run not in names:
        return None  # a run folder: found and checked before the pipeline starts
    if spec.run == stage.name:
        raise ConfigError(f"{where}: {INIT_FROM}: {value!r}: a stage cannot start from itself")
    if spec.run not in earlier:
        raise ConfigError(
            f"{where}: {INIT_FROM}: {value!r}: stage {spec.run!r} runs later (stages run in order: "
            f"{', '.join(names)}); a stage can start only from an earlier one"
        )
    source = earlier[spec.run].config
    mismatch = config_mismatch(dump(source), dump(stage.config))
    if mismatch is not None:
        key, theirs, ours = mismatch
        raise ConfigError(
            f"{where}: {INIT_FROM}: {value!r}: {key} differs: {theirs!r} in stage {spec.run!r}, {ours!r} here "
            f"({mismatch_reason(key)})"
        )
    if spec.node is not None and source.data.source.kind != "prepared":  # a prepared dataset's clients: known later
        tree = build_tree(source, placeholder_clients(source))
        if spec.node not in {n.id for n in tree}:
            shown = ", ".join(n.id for n in tree if not n.is_leaf)
            raise ConfigError(
                f"{where}: {INIT_FROM}: {value!r}: stage {spec.run!r} has no node {spec.node!r} "
                f"(its servers: {shown}; clients are <language>-NN)"
            )
    return spec.run


def pipeline_from_dict(
    data: Any, overrides: Sequence[str] = (), source: str = "pipeline", base_dir: Path = Path(".")
) -> Pipeline:
    """A validated pipeline from a pipeline file's data; every stage is validated before this returns."""
    name, shared, stages = _check_top(data, source)
    own, every, per_stage = _split_overrides(overrides, list(stages), source)
    if own:
        edited = dict(data)
        for assignment in own:
            edited = apply_override(edited, assignment)
        name, shared, stages = _check_top(edited, source)
    built: dict[str, Stage] = {}
    experiments: dict[str, str] = {}
    names = list(stages)
    for stage_name, body in stages.items():
        where = f"{source}: stages.{stage_name}"
        stage_data = _stage_data(stage_name, body, shared, name, base_dir, where)
        config = _stage_config(stage_data, [*every, *per_stage[stage_name]], where)
        if config.name in experiments:
            raise ConfigError(
                f"{where}: name: experiment name {config.name!r} is also stage {experiments[config.name]!r}'s; "
                "give each stage its own"
            )
        experiments[config.name] = stage_name
        stage = Stage(stage_name, config)
        built[stage_name] = Stage(stage_name, config, _source_stage(stage, built, names, where))
    return Pipeline(name, tuple(built.values()))


def load_pipeline(path: str | Path, overrides: Sequence[str] = ()) -> Pipeline:
    """Read, merge and validate a pipeline file (``base:`` files relative to it)."""
    path = Path(path)
    return pipeline_from_dict(read_pipeline_yaml(path), overrides, source=str(path), base_dir=path.parent)


def with_init_from(stage: Stage, run_folder: str) -> ExperimentConfig:
    """The stage's config with its stage reference replaced by that stage's run folder (node kept)."""
    value = stage.config.model.init_from
    assert value is not None and stage.source_stage is not None
    node = parse_init_from(value).node
    resolved = run_folder if node is None else f"{run_folder}:{node}"
    model = stage.config.model.model_copy(update={"init_from": resolved})
    return stage.config.model_copy(update={"model": model})
