"""What every config model shares: unknown keys are errors, values are frozen, a boolean is no number."""

from __future__ import annotations

import functools
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class Strict(BaseModel):
    """A config section: an unknown key is an error that names it; instances are immutable.

    pydantic's lax mode reads YAML's ``true`` as 1 for an integer key and 1.0 for a float one
    (``rounds: true`` ran one round), and 1 or 0 as a boolean (``persistent: 1``). Here a
    boolean where only a number is accepted, and a number where only a boolean is, are errors
    naming the key, in every section (``_no_bool_for_number``). Strings keep pydantic's lax
    reading (PyYAML reads ``1e-3`` as a string), and a key whose type admits both (none yet)
    takes either.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name
        if name is not None and name in cls.model_fields:
            problem = _bool_number_mixup(cls.model_fields[name].annotation, value)
            if problem:
                raise ValueError(problem)
        return value


def _bool_number_mixup(annotation: Any, value: Any, where: str = "") -> str | None:
    """Why ``value`` is a boolean where ``annotation`` takes a number but no boolean (or the reverse), or None.

    Lists and mappings are looked into (``alphas: [0.5, true]``, ``rank_pattern: {query: true}``);
    nested sections check themselves.
    """
    if isinstance(value, (list, tuple, dict)):
        inner = _container_args(annotation, dict if isinstance(value, dict) else list)
        if inner is None:
            return None
        if isinstance(value, dict):
            for key, item in value.items():
                problem = _bool_number_mixup(inner[0], key, f"{where}key {_show(key)}: ") or _bool_number_mixup(
                    inner[-1], item, f"{where}{_show(key)}: "
                )
                if problem:
                    return problem
            return None
        for i, item in enumerate(value):
            problem = _bool_number_mixup(inner[0], item, f"{where}item {i}: ")
            if problem:
                return problem
        return None
    takes = _accepts(annotation)
    if "any" in takes or not isinstance(value, (bool, int, float)):
        return None
    shown = _show(value)
    if isinstance(value, bool) and "number" in takes and "bool" not in takes:
        return f"{where}expected a number, got the boolean {shown} (YAML's true/false/yes/no/on/off are booleans)"
    if not isinstance(value, bool) and "bool" in takes and "number" not in takes:
        return f"{where}expected true or false, got the number {shown}"
    return None


def _show(value: Any) -> str:
    """``value`` as YAML writes it (``true``, ``1``, ``query``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


@functools.cache
def _accepts(annotation: Any) -> frozenset[str]:
    """What kinds of plain value a type admits: ``bool``, ``number``, ``any`` (unchecked), ``other``."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _accepts(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return frozenset().union(*(_accepts(a) for a in get_args(annotation)))
    if origin is Literal:
        return frozenset(_kind(type(a)) for a in get_args(annotation))
    if annotation is Any:
        return frozenset({"any"})
    return frozenset({_kind(annotation)})


def _kind(tp: Any) -> str:
    if tp is bool:
        return "bool"
    return "number" if tp in (int, float) else "other"


def _container_args(annotation: Any, container: type) -> tuple[Any, ...] | None:
    """The element type(s) of the ``list``/``tuple`` (``container=list``) or ``dict`` member of ``annotation``."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _container_args(get_args(annotation)[0], container)
    if origin in (Union, types.UnionType):
        found = (_container_args(a, container) for a in get_args(annotation))
        return next((f for f in found if f is not None), None)
    if container is dict and origin is dict:
        return get_args(annotation) or None
    if container is list and origin in (list, tuple, set, frozenset):
        args = tuple(a for a in get_args(annotation) if a is not Ellipsis)
        return args or None
    return None


class ConfigError(ValueError):
    """A user mistake in the config; the message names the offending key."""


class SettingError(ConfigError):
    """A config value the run cannot use, found only once the run has started (e.g. an adapter option that no
    module of the built model matches): a resume cannot fix it, since a run keeps its config (only ``runtime``
    and ``eval.batch_size`` change on a resume), so the CLI says to start a new run with the key fixed."""
