"""An existing run folder as a resume sees it: its config and record, and what may change."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml
from pydantic import ValidationError

from bhfl_core.config.base import ConfigError
from bhfl_core.config.loader import config_from_dict, format_validation_error, validate_tree
from bhfl_core.config.schema import ExperimentConfig, dump
from bhfl_core.store.atomic import write_text_atomic
from bhfl_core.store.run_layout import CONFIG_FILE
from flows.records.run_record import RunRecord, RunStateError, default_tracking_uri

__all__ = [
    "RESUME_OVERRIDABLE",
    "RunStateError",
    "check_resume_overrides",
    "check_saved_tree",
    "load_run",
    "resume_config",
]

# libyaml's safe loader where PyYAML has it: a saved config (~300 lines, written by bhfl) took ~0.1 s in pure Python,
# most of `bhfl runs`'s time per run (a 100-point sweep listed with --json in 19 s on a loaded 2-core machine)
_SAFE = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

RESUME_OVERRIDABLE = ("runtime.", "eval.batch_size")  # where and how it runs, not what it computes


def check_resume_overrides(overrides: Sequence[str], noun: str = "run") -> None:
    """The one rule for ``--set`` on a resume of any job (run, sweep, pipeline): only keys that do not change
    results (``RESUME_OVERRIDABLE``); anything else is a ConfigError naming the assignment."""
    for assignment in overrides:
        if not assignment.split("=", 1)[0].strip().startswith(RESUME_OVERRIDABLE):
            raise ConfigError(
                f"--set {assignment}: a resumed {noun} keeps its config; only runtime.* and eval.batch_size "
                f"may change (they do not change results). Start a new {noun} instead."
            )


def load_run(run_path: Path) -> tuple[ExperimentConfig, RunRecord]:
    """The resolved config and the record of an existing run folder."""
    if not (run_path / CONFIG_FILE).is_file():
        raise RunStateError(f"{run_path} is not a run folder (no {CONFIG_FILE}); `bhfl runs` lists the runs")
    try:
        config = ExperimentConfig.model_validate(
            yaml.load((run_path / CONFIG_FILE).read_text(encoding="utf-8"), Loader=_SAFE)
        )
    except ValidationError as exc:  # a saved config a newer rule refuses, or one edited by hand: its keys named
        raise RunStateError(_refused(run_path, format_validation_error(exc))) from None
    except (ValueError, yaml.YAMLError) as exc:
        raise RunStateError(f"{run_path}: the run's {CONFIG_FILE} is unreadable ({exc})") from None
    try:
        record = RunRecord.read(run_path)
    except ValueError as exc:
        raise RunStateError(f"{run_path}: the run's run.json is unreadable ({exc})") from None
    if record is None:
        record = RunRecord(name=config.name, status="failed", tracking_uri=default_tracking_uri(run_path.parents[1]))
    return config, record


def check_saved_tree(run_path: Path, config: ExperimentConfig) -> None:
    """The saved config's tree checks (``validate_tree``) before a resume touches the run: one refused by a rule
    newer than the run is named with its file, the run's record left as it was (the checks met mid-resume
    marked it failed, a finished run's ``--force-eval`` included). Not in ``load_run``: ``bhfl runs`` lists
    without building trees."""
    try:
        validate_tree(config)
    except ConfigError as exc:
        raise RunStateError(_refused(run_path, str(exc))) from None


def resume_config(run_path: Path, config: ExperimentConfig, overrides: Sequence[str]) -> ExperimentConfig:
    """The run's config with the changes a resume makes (written back), checked by ``check_resume_overrides``
    (flows/lifecycle.py checks them once, before any kind of job applies them)."""
    if not overrides:
        return config
    config = config_from_dict(dump(config), overrides, source=str(run_path / CONFIG_FILE))
    write_text_atomic(run_path / CONFIG_FILE, yaml.safe_dump(dump(config), sort_keys=False))
    return config


def _refused(run_path: Path, problems: str) -> str:
    return (
        f"{run_path / CONFIG_FILE}: the run's saved config is refused by this bhfl (a rule newer than the run, or "
        f"an edit)\n{problems}\nedit that file to go on"
    )
