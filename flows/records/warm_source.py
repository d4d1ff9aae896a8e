"""The run a warm start (``model.init_from``) reads from: found, checked, and copied from.

``resolve_init_from`` runs before a new run writes anything: it finds RUN (a folder,
absolute or relative to the current directory or the run dir, ``<name>/<stamp>``,
``latest`` or an MLflow run id: ``listing.resolve_run``), checks that it finished,
that its ``model`` section and ``data.task`` agree with the new config, and that it
saved NODE, and returns the config with the absolute folder in ``model.init_from``,
so the new run's ``config.yaml`` (and any resume of it) never depends on the current
directory. Every problem is a ``ConfigError`` naming ``model.init_from`` and the value.
``check_sources`` does it for every stage of a pipeline that starts from a run folder
(not from an earlier stage), before the pipeline (or a served run of it) writes anything.

``warm_start`` copies the models into the new run's state store once its data are
prepared (bhfl_core/store/warm_start.py plans and copies), after checking that the two
runs' prepared data give models of one shape; a LoRA run from a full fine-tuning run
gets the source model as its frozen backbone file instead, and a LoRA run from such a
LoRA run gets its backbone file beside its adapters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from bhfl_core.config.base import ConfigError
from bhfl_core.config.pipeline import Pipeline, Stage
from bhfl_core.config.schema import ExperimentConfig, dump
from bhfl_core.config.topology import ROOT_ID
from bhfl_core.store.node_store import StateStore
from bhfl_core.store.run_layout import BACKBONE_FILE, CONFIG_FILE, DATA_POINTER, STATE_DIR
from bhfl_core.store.warm_start import (
    KEY,
    InitFrom,
    carry_backbone,
    config_mismatch,
    copy_models,
    copy_plan,
    is_backbone_start,
    is_carried,
    mismatch_reason,
    parse_init_from,
    save_backbone,
)
from data_prep.manifest import Manifest
from flows.records.listing import resolve_run
from flows.records.run_record import RunRecord
from flows.records.run_state import RunStateError
from tasks.context import RunContext


def _error(value: str, why: str) -> ConfigError:
    return ConfigError(f"{KEY}: {value!r}: {why}")


def saved_nodes(store: StateStore) -> list[str]:
    """Node ids with a state file in ``store`` (sorted)."""
    folder = store.node_path(ROOT_ID).parent
    return sorted(p.name.removesuffix(".safetensors") for p in folder.glob("*.safetensors")) if folder.is_dir() else []


def _listed(nodes: list[str], limit: int = 12) -> str:
    shown = ", ".join(nodes[:limit])
    return shown + (f", ... ({len(nodes)} in all)" if len(nodes) > limit else "") if nodes else "none"


def find_source(value: str, run_dir: Path) -> tuple[InitFrom, Path]:
    """The parsed value and RUN's absolute folder (ConfigError if there is no such run folder)."""
    spec = parse_init_from(value)
    try:
        folder = resolve_run(spec.run, run_dir)
    except RunStateError:
        raise _error(
            value,
            f"no run folder {spec.run!r} (absolute, relative to the current directory or to the run dir "
            f"{run_dir}, <name>/<stamp>, `latest`, or an MLflow run id; `bhfl runs --run-dir {run_dir}` lists them)",
        ) from None
    return spec, folder


def _source_config(value: str, folder: Path) -> dict[str, Any]:
    """RUN's dumped config (``config.yaml``), ConfigError if unreadable.

    Validated and dumped again where today's schema reads it, so a key added since RUN
    was made (e.g. ``model.adapter.aggregation``) compares at its default, not as missing;
    as written where it no longer validates (the comparison then names what differs).
    """
    try:
        source = yaml.safe_load((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise _error(value, f"its {CONFIG_FILE} is unreadable ({exc})") from None
    if not isinstance(source, dict):
        return {}
    try:
        return dump(ExperimentConfig.model_validate(source))
    except ValueError:  # pydantic's ValidationError, or a ConfigError of a validator
        return source


def check_source(value: str, spec: InitFrom, folder: Path, config: ExperimentConfig) -> None:
    """RUN finished, agrees with ``config`` on the model and task, and saved NODE (else ConfigError)."""
    record = RunRecord.read(folder)
    if record is None:
        raise _error(value, f"{folder} has no run.json: it is not a run that started")
    status = record.effective_status
    if status != "finished":
        then = (  # a live run's `bhfl resume` is refused: wait for it instead
            f"wait for it to finish; `bhfl runs {folder}` shows how far it is"
            if status == "running"
            else f"finish it first: `bhfl resume {folder}`"
        )
        raise _error(value, f"the run in {folder} is {status}; a warm start needs a finished run ({then})")
    mismatch = config_mismatch(_source_config(value, folder), dump(config))
    if mismatch is not None:
        key, theirs, ours = mismatch
        raise _error(value, f"{key} differs: {theirs!r} in the source run, {ours!r} here ({mismatch_reason(key)})")
    node = spec.node or ROOT_ID
    store = StateStore(folder / STATE_DIR)
    if not store.has(node):
        what = f"node {node!r}" if spec.node else "a root model (required for a tree-shaped warm start)"
        raise _error(value, f"the run in {folder} saved no {what}; its saved nodes: {_listed(saved_nodes(store))}")


def resolve_init_from(config: ExperimentConfig, run_dir: Path) -> ExperimentConfig:
    """``config`` with ``model.init_from`` checked and made absolute (unchanged when unset)."""
    value = config.model.init_from
    if value is None:
        return config
    spec, folder = find_source(value, run_dir)
    check_source(value, spec, folder, config)
    absolute = str(InitFrom(str(folder), spec.node))
    if absolute == value:
        return config
    return config.model_copy(update={"model": config.model.model_copy(update={"init_from": absolute})})


def warm_start(ctx: RunContext) -> list[str]:
    """Copy the source models into the run's store (model only); return the nodes written.

    A LoRA run from a full fine-tuning run copies no node (``is_backbone_start``): it
    writes the source node's model as its frozen backbone file (kept if a resumed run
    already has it) and returns ``[]``; the run's initial model is then built on it.
    A LoRA run from a LoRA run that has a backbone file (it was itself warm-started from
    a full run) gets that file too, before the node models (``carry_backbone``).
    The two runs' prepared data must give models of one shape (same labels and
    vocabulary size); tiny-bert learns its vocabulary from the data, so a source run on
    other data fits in shape but not in meaning: that is the user's call.
    """
    value = ctx.config.model.init_from
    assert value is not None
    backbone = ctx.run_path / BACKBONE_FILE
    if backbone.is_file() and not is_carried(backbone):  # a resume after a backbone start: the source is not needed
        return []
    spec = parse_init_from(value)
    folder = Path(spec.run)
    if not (folder / STATE_DIR).is_dir():
        raise _error(value, f"the source run folder {folder} (or its {STATE_DIR}/) is gone")
    try:
        source_data = Path(json.loads((folder / DATA_POINTER).read_text(encoding="utf-8"))["data_root"])
        theirs = Manifest.read(source_data)
    except (OSError, ValueError, KeyError) as exc:
        raise _error(value, f"the source run's prepared data cannot be read ({exc})") from None
    ours = ctx.manifest
    for field, a, b in (("labels", theirs.labels, ours.labels), ("vocab_size", theirs.vocab_size, ours.vocab_size)):
        if a != b:
            raise _error(
                value,
                f"the source run's data give models of another shape: {field} {a!r} there, {b!r} here "
                "(same data settings for both runs, or at least the same labels and tokenizer)",
            )
    source = StateStore(folder / STATE_DIR)
    if is_backbone_start(_source_config(value, folder), dump(ctx.config)):
        save_backbone(source, spec.node or ROOT_ID, ctx.run_path / BACKBONE_FILE)
        return []
    if (folder / BACKBONE_FILE).is_file():  # a LoRA source on a warm-started backbone: its adapters fit that one
        carry_backbone(folder / BACKBONE_FILE, backbone)
    plan = copy_plan(spec, [n.id for n in ctx.tree], ctx.tree.root_id)
    return copy_models(source, ctx.store, plan)


def check_sources(pipeline: Pipeline, run_dir: Path) -> Pipeline:
    """The pipeline with every run-folder ``model.init_from`` found, checked and made absolute.

    Stage references are left for their stage's start; a value that is neither an earlier
    stage nor a run folder is a ConfigError naming the stage, the key and the value.
    """
    for stage in pipeline:
        if stage.config.model.init_from is None or stage.source_stage is not None:
            continue
        where = f"stages.{stage.name}"
        try:
            config = resolve_init_from(stage.config, run_dir)
        except ConfigError as exc:
            spec = parse_init_from(stage.config.model.init_from)
            hint = (
                f" (and no stage of this pipeline is called {spec.run!r}: stages {', '.join(pipeline.names)})"
                if "/" not in spec.run
                else ""
            )
            raise ConfigError(f"{where}: {exc}{hint}") from None
        pipeline = pipeline.replace_stage(Stage(stage.name, config))
    return pipeline
