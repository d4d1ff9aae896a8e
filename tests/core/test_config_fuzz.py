"""Random mutations of valid configs never crash: they load, or fail with a ConfigError naming a key.

Two layers. Parsed configs: each example starts from a shipped config and applies a
few random mutations at random places of the nested mapping: delete a key, misspell
it, or replace a value with something of another type or range. YAML text: each
example starts from a shipped config *file* (or from a mutated config dumped as YAML)
and edits its text and bytes (a line written twice, a key repeated with another value
at some depth, a tab, anchors and aliases, huge integers, tagged scalars, a top level
that is no mapping, bytes that are not UTF-8), then loads it as ``bhfl run`` does: the
file path and the ``--set`` path. Whatever comes out, loading must either succeed or
raise ``ConfigError`` (the one-paragraph message the CLI prints), never another
exception (a stack trace for a user mistake).
"""

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bhfl_core.config.base import ConfigError
from bhfl_core.config.loader import config_from_dict, load_config, read_yaml

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


# ---------------------------------------------------------------- YAML text and bytes

# pieces of YAML that stress the reader: aliases (also cyclic and exponential), merge keys, tags whose
# constructors raise, huge and odd numbers, tabs, flow collections, documents, NUL and other bytes
YAML_PIECES = [
    "&a [1, 2]",
    "*a",
    "&b {seed: 3}",
    "{<<: *b, seed: 4}",
    "&c [*c]",
    "&d {x: *d}",
    "!!int x",
    "!!float y",
    "!!timestamp 2001-13-99",
    "!!binary zz",
    "!!python/object:os.system x",
    "!!set {a, a}",
    "!!omap [a: 1, a: 2]",
    "9" * 400,
    "-1e999",
    ".nan",
    "0x_",
    "\t1",
    "[" * 300 + "]" * 300,
    "{" * 50,
    "{a: 1, a: 2}",
    "? [1, 2]\n: 3",
    "---\nb: 2",
    "...",
    "'\\x00'",
    '"\\ud800"',
    "~",
    "",
]
RAW_BYTES = [b"\xff", b"\xfe\xff", b"\xc3\x28", b"\x00", b"\t", b"\r", b"\xef\xbb\xbf", b"\x85", b"\x1b[0m"]


def _key_paths(node: Any, path: tuple = ()) -> list[tuple]:
    """Every key path of a nested mapping (the places a duplicate key can be written), 8 levels deep at most."""
    found = []
    for key, value in node.items() if isinstance(node, dict) and len(path) < 8 else []:
        found.append((*path, key))
        found += _key_paths(value, (*path, key))
    return found


def _parsed(text: str) -> Any:
    """The text as PyYAML reads it (duplicates kept silently), or None if it does not parse."""
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, ValueError, RecursionError):
        return None


@st.composite
def yaml_texts(draw: st.DrawFn) -> bytes:
    """A shipped config's file, or a mutated config dumped as YAML, with its text and bytes edited."""
    if draw(st.booleans()):
        text = (REPO / "configs" / draw(st.sampled_from(CONFIGS))).read_text()
    else:
        text = yaml.safe_dump(draw(mutated()), sort_keys=False, allow_unicode=True)
    lines = text.splitlines()
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(lines)))
        action = draw(st.sampled_from(["repeat", "duplicate key", "piece", "indent", "replace char", "top"]))
        if action == "repeat" and lines:  # a line written twice: often a duplicate key
            lines.insert(at, lines[min(at, len(lines) - 1)])
        elif action == "duplicate key":  # `key: <something>` again, at the key's own indentation
            paths = _key_paths(_parsed("\n".join(lines))) if draw(st.booleans()) else []
            key = str(draw(st.sampled_from(paths))[-1]) if paths else draw(st.sampled_from(["seed", "name", "tree"]))
            lines.insert(at, f"{' ' * draw(st.sampled_from([0, 2, 4, 6]))}{key}: {draw(st.sampled_from(YAML_PIECES))}")
        elif action == "piece":
            key = draw(st.sampled_from(["seed", "name", "base", "tree", "data", "x", "<<", "rounds", "1", "? [1]"]))
            lines.insert(at, f"{' ' * draw(st.sampled_from([0, 2, 4]))}{key}: {draw(st.sampled_from(YAML_PIECES))}")
        elif action == "indent" and lines:
            at = min(at, len(lines) - 1)
            lines[at] = draw(st.sampled_from(["\t", "  ", " ", "- "])) + lines[at]
        elif action == "replace char" and lines:
            line = lines[min(at, len(lines) - 1)]
            i = draw(st.integers(0, len(line)))
            lines[min(at, len(lines) - 1)] = line[:i] + draw(st.text(min_size=1, max_size=3)) + line[i + 1 :]
        elif action == "top":  # a top level that is no mapping
            lines = [draw(st.sampled_from(["- ", "", "!!str ", "&t ", "? "])) + line for line in lines] or ["[]"]
    raw = "\n".join(lines).encode("utf-8", "surrogatepass")
    if draw(st.booleans()):  # bytes that are no UTF-8 (or a byte-order mark, a control character)
        i = draw(st.integers(0, len(raw)))
        raw = raw[:i] + draw(st.sampled_from(RAW_BYTES)) + raw[i:]
    return raw


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory) -> Path:
    """A folder with the shipped configs, so a fuzzed file's ``base:`` chain resolves as in configs/."""
    folder = tmp_path_factory.mktemp("configs")
    for path in (REPO / "configs").glob("*.yaml"):
        shutil.copy(path, folder / path.name)
    return folder


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    raw=yaml_texts(), base=st.sampled_from([None, "embedded.yaml", "fuzz.yaml", "missing.yaml", "a\x00b", "x" * 300])
)
def test_any_yaml_file_loads_or_raises_config_error(config_dir, raw, base):
    path = config_dir / "fuzz.yaml"
    path.write_bytes(raw if base is None else f"base: {json.dumps(base)}\n".encode() + raw)
    try:
        load_config(path)
    except ConfigError as exc:
        assert str(exc).strip()


set_keys = st.one_of(
    st.sampled_from(["seed", "name", "tree", "tree.root.rounds", "tree.groups.x", "data.source", "tree.levels.2"]),
    st.sampled_from(["runtime.workers", "tree.nodes.edge-de", "tree.root.rounds.x", "", ".", "a..b", "tree.2.x"]),
    st.sampled_from(["tree.levels.1.rounds", "tree.levels.\u00b2.rounds", "tree.levels.--1", "tree.levels.-1"]),
    st.text(max_size=12),
)
set_values = st.one_of(st.sampled_from(YAML_PIECES), st.text(max_size=30), st.integers().map(str))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(assignments=st.lists(st.tuples(set_keys, st.sampled_from(["=", " = ", "", "=="]), set_values), max_size=3))
def test_any_set_override_loads_or_raises_config_error(assignments):
    try:
        load_config(REPO / "configs" / "embedded.yaml", ["".join(a) for a in assignments])
    except ConfigError as exc:
        assert str(exc).strip()


@pytest.mark.parametrize(
    "text, message",
    [
        ("seed: !!int x\n", "line 1"),  # a tagged scalar its constructor refuses (was a bare ValueError)
        ("seed: !!timestamp 2001-13-99\n", "cannot read this value"),
        ("seed: " + "[" * 2000 + "]" * 2000 + "\n", "nested too deeply"),  # was a RecursionError
        ("seed: &a [*a]\n", "a cycle"),
        (
            "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n"
            + "".join(f"{k}: &{k} [{', '.join([f'*{p}'] * 10)}]\n" for p, k in zip("abcdef", "bcdefg")),
            "expand to more than 1,000,000 values",
        ),  # 10^7: the "billion laughs"
    ],
    ids=["int-tag", "timestamp-tag", "deep", "cycle", "billion-laughs"],
)
def test_yaml_the_reader_refuses_is_a_config_error_naming_the_file(tmp_path, text, message):
    path = tmp_path / "odd.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as err:
        load_config(path)
    assert str(err.value).startswith(str(path))


@pytest.mark.parametrize("key", ["tree.levels.\u00b2", "tree.levels.--1"])
def test_set_keys_that_only_look_like_integers_are_named(key):
    """``--set tree.levels.2.x`` finds YAML's integer key 2; ``²`` (str.isdigit, yet no int) was a ValueError."""
    with pytest.raises(ConfigError, match=f"{key}: Input should be a valid integer"):
        load_config(REPO / "configs" / "embedded.yaml", [f"{key}.rounds=2"])


def test_bytes_that_are_not_utf8_and_unreadable_names_are_config_errors(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.yaml: not UTF-8 text: byte 0xe9 on line 1, column 10"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"cannot be read \(.*name too long"):
        load_config(tmp_path / ("x" * 5000))  # a name the OS refuses: too long
    with pytest.raises(ConfigError, match="is a folder, not a YAML file"):
        load_config(tmp_path)  # a folder: it exists, so "not found" would mislead
