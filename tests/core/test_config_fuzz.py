"""Random mutations of valid configs never crash: they load, or fail with a ConfigError naming a key.

Each example starts from a shipped config and applies a few random mutations at
random places of the nested mapping: delete a key, misspell it, or replace a value with
something of another type or range. Whatever comes out, loading must either succeed or
raise ``ConfigError`` (the one-paragraph message the CLI prints), never another
exception (a stack trace for a user mistake).
"""

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bhfl_core.config.base import ConfigError
from bhfl_core.config.loader import config_from_dict, read_yaml

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ["embedded.yaml", "bhfl.yaml", "bhfl-full.yaml", "fedavg.yaml", "hierfavg.yaml"]

odd_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**12), max_value=10**12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.one_of(st.integers(-3, 40), st.text(max_size=6)), max_size=4),
    st.dictionaries(st.text(max_size=8), st.one_of(st.integers(-3, 40), st.text(max_size=6), st.none()), max_size=3),
    st.sampled_from(["root", "edge", "server", "client", "edge-de", "europe-west", "en", "fedadam", "l2", "auto"]),
)


def _containers(node: Any, path: tuple = ()) -> list[tuple]:
    """Paths of every mapping and list in the config (the places a mutation can act)."""
    found = [path] if isinstance(node, (dict, list)) and node else []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, value in items:
        found += _containers(value, (*path, key))
    return found


def _at(root: Any, path: tuple) -> Any:
    for key in path:
        root = root[key]
    return root


@st.composite
def mutated(draw: st.DrawFn) -> dict:
    data = read_yaml(REPO / "configs" / draw(st.sampled_from(CONFIGS)))
    for _ in range(draw(st.integers(1, 4))):
        places = _containers(data)
        if not places:
            break
        target = _at(data, draw(st.sampled_from(places)))
        keys = list(target) if isinstance(target, dict) else list(range(len(target)))
        key = draw(st.sampled_from(keys))
        action = draw(st.sampled_from(["delete", "replace", "replace", "misspell"]))
        if action == "delete":
            del target[key]
        elif action == "misspell" and isinstance(target, dict):
            target[f"{key}x"] = target.pop(key)
        else:
            target[key] = draw(odd_values)
    return data


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutated_configs_load_or_raise_config_error(data):
    try:
        config_from_dict(data)
    except ConfigError as exc:
        assert str(exc).strip()  # says something


@pytest.mark.parametrize("value", [[], "x", 3])
def test_top_level_that_is_not_a_mapping_is_a_config_error(value):
    with pytest.raises(ConfigError, match=f"top level must be a mapping of keys, got {type(value).__name__}"):
        config_from_dict(value)


def test_empty_top_level_is_the_default_config_and_unknown_keys_are_named():
    assert config_from_dict(None) == config_from_dict({})
    with pytest.raises(ConfigError, match="a: unknown key"):
        config_from_dict({"a": 1})
