"""What every config model shares: unknown keys are errors, values are frozen."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """A config section: an unknown key is an error that names it; instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ConfigError(ValueError):
    """A user mistake in the config; the message names the offending key."""


class SettingError(ConfigError):
    """A config value the run cannot use, found only once the run has started (e.g. an adapter option that no
    module of the built model matches): a resume cannot fix it, since a run keeps its config (only ``runtime``
    and ``eval.batch_size`` change on a resume), so the CLI says to start a new run with the key fixed."""
