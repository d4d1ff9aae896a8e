"""Every key of the experiment schema is named in docs/config.md.

The page promises to list every key (the loader's unknown-key error points users to it),
so a field added to bhfl_core/config without a docs row fails here. The check is by the
key's own name inside backticks anywhere on the page: cheap and independent of how a row
spells the path (level keys such as `eta_down` are documented once for every level).
"""

import inspect
import re
import typing
from pathlib import Path

from pydantic import BaseModel

from bhfl_core.config.schema import ExperimentConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _models(annotation: object) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (through unions, lists, dicts)."""
    found: list[type[BaseModel]] = []
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        found.append(annotation)
    for arg in typing.get_args(annotation):
        found += _models(arg)
    return found


def schema_keys(model: type[BaseModel]) -> dict[str, str]:
    """Every field name (its alias where set) of a model and the models below it -> one path to it."""
    keys: dict[str, str] = {}
    todo: list[tuple[type[BaseModel], str]] = [(model, "")]
    seen: set[type[BaseModel]] = set()
    while todo:
        current, prefix = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for name, field in current.model_fields.items():
            key = field.alias or name
            keys.setdefault(key, prefix + key)
            todo += [(sub, f"{prefix}{key}.") for sub in _models(field.annotation)]
    return keys


def undocumented(keys: dict[str, str], text: str) -> list[str]:
    """The paths whose key name appears in no backticked span of the text."""
    spans = " ".join(re.findall(r"`([^`]*)`", text))
    return sorted(path for key, path in keys.items() if not re.search(rf"(?<![\w-]){re.escape(key)}(?![\w-])", spans))


def test_every_schema_key_is_named_in_docs_config_md() -> None:
    keys = schema_keys(ExperimentConfig)
    assert len(keys) > 100  # the walk reaches the nested models (data, tree levels, privacy, eval, ...)
    assert undocumented(keys, DOC.read_text()) == []


def test_a_key_missing_from_the_page_is_reported_by_its_path() -> None:
    keys = schema_keys(ExperimentConfig)
    text = DOC.read_text().replace("torch_threads", "torch-threads-renamed")
    assert undocumented(keys, text) == ["runtime.torch_threads"]
