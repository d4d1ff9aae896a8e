"""The one YAML reader for everything a user writes: config, pipeline and sweep files, ``--set`` values.

PyYAML's ``safe_load`` keeps the last of two equal keys without a word (``seed: 1`` ...
``seed: 2`` runs seed 2), lets a tagged scalar it cannot convert escape as a bare
``ValueError`` (``!!int x``), and recurses once per nesting level. This reader is a
``SafeLoader`` whose ``construct_mapping`` refuses a key written twice in one mapping
(at any depth; a key after a ``<<: *anchor`` merge key may still override a merged
one, which is what merge keys are for), and it turns every way a text can fail to load
into a ``ConfigError`` naming the source and, where YAML knows it, the line: a user's
typo is a one-paragraph message, never a traceback.

Anchors and aliases stay allowed (shared blocks are legitimate YAML), but a structure
that contains itself, or that aliases expand beyond ``MAX_VALUES`` values (the
"billion laughs"), is refused: everything downstream walks configs as trees.
"""

from __future__ import annotations

import io
import shlex
from pathlib import Path
from typing import Any, BinaryIO

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node

from bhfl_core.config.base import ConfigError

MAX_VALUES = 1_000_000
"""Most values (scalars and collections, counted as the tree aliases expand to) one YAML text may hold."""

_MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(ConstructorError):
    """A key written twice in one mapping (both lines are 1-based)."""

    def __init__(self, key: Any, line: int, first_line: int, node: Node) -> None:
        super().__init__(None, None, f"key {key!r} is written twice (first on line {first_line})", node.start_mark)
        self.key, self.line, self.first_line = key, line, first_line


class UniqueKeyLoader(yaml.SafeLoader):
    """``SafeLoader`` that rejects duplicate mapping keys and reports unconvertible scalars as YAML errors."""

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:  # `<<: *base`: its keys may be overridden, that is what it is for
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                seen = first.get(key)
            except TypeError:  # unhashable: SafeConstructor reports it with its line
                continue
            line = key_node.start_mark.line + 1
            if seen is not None:
                raise DuplicateKeyError(key, line, seen, key_node)
            first[key] = line
        return super().construct_mapping(node, deep)

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, OverflowError) as exc:  # e.g. `!!int x`, `!!timestamp 2001-13-99`
            raise ConstructorError(None, None, f"cannot read this value ({exc})", node.start_mark) from None


def parse_yaml(text: str | BinaryIO, source: str) -> Any:
    """The value of one YAML document; ``ConfigError`` naming ``source`` (and the line) if it cannot be read.

    A binary stream is decoded as YAML specifies (UTF-8, or UTF-16 with a byte-order
    mark), so a file's bytes never pass through the locale's encoding; its ``name`` is
    what YAML's messages call it.
    """
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader)  # a SafeLoader: plain data only
    except DuplicateKeyError as exc:
        raise ConfigError(
            f"{source}: line {exc.line}: key {exc.key!r} is written twice (first on line {exc.first_line})"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{source}: not valid YAML: nested too deeply to read") from None
    _check_size(data, source)
    return data


def read_yaml_file(path: Path) -> Any:
    """A YAML file's top level, read with ``parse_yaml``; ``ConfigError`` if it is missing or unreadable."""
    try:
        raw = path.read_bytes() if path.is_file() else None
    except (OSError, ValueError) as exc:  # a name the OS refuses (too long, NUL byte), no permission
        raise ConfigError(f"config file {str(path)!r} cannot be read ({exc})") from None
    if raw is None:  # a folder exists but is no file: "not found" would send the user looking for it
        what = "is a folder, not a YAML file" if path.is_dir() else "not found"
        if not path.is_dir() and not path.is_absolute():  # e.g. the default configs/embedded.yaml outside a checkout
            what += f" (relative to the current directory, {Path.cwd()})"
        raise ConfigError(f"config file {str(path)!r} {what}")
    _check_utf8(raw, path)
    stream = io.BytesIO(raw)
    stream.name = str(path)  # YAML's messages then say `in "<path>", line 3, column 7`
    return parse_yaml(stream, str(path))


def _check_utf8(raw: bytes, path: Path) -> None:
    """A file that is not UTF-8 (nor UTF-16 with its byte-order mark, which YAML also reads): ``ConfigError``
    saying so, with the first bad byte's line, column and offset.

    YAML's own message ("unacceptable character #x00e9: invalid continuation byte ...
    position 51") names neither the encoding the file must have nor a line: a file saved
    as Latin-1 or Windows-1252 (an accent in a comment or a name) left users guessing.
    """
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        return
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        start = exc.start
        line_start = raw.rfind(b"\n", 0, start) + 1
        line = raw.count(b"\n", 0, start) + 1
        raise ConfigError(
            f"{path}: not UTF-8 text: byte 0x{raw[start]:02x} on line {line}, column {start - line_start + 1} "
            f"(byte offset {start}) is not valid UTF-8. A config file must be UTF-8 (the file was likely saved "
            f"as Latin-1 or Windows-1252): save it as UTF-8, e.g. "
            f"`iconv -f latin1 -t utf-8 {shlex.quote(str(path))} > new.yaml`"
        ) from None


def _check_size(data: Any, source: str) -> None:
    """Refuse a value that contains itself, or that expands beyond ``MAX_VALUES`` values.

    Aliases make the loaded value a graph; its size as a tree is counted once per shared
    piece (memoised by identity), so the check costs one pass over what was parsed.
    """
    sizes: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[Any, bool]] = [(data, False)]
    while stack:
        value, children_done = stack.pop()
        if not isinstance(value, (dict, list)) or (id(value) in sizes and not children_done):
            continue
        items = list(value.keys()) + list(value.values()) if isinstance(value, dict) else value
        if children_done:
            open_.discard(id(value))
            total = 1 + sum(sizes.get(id(v), 1) for v in items)
            if total > MAX_VALUES:
                raise ConfigError(f"{source}: its aliases expand to more than {MAX_VALUES:,} values")
            sizes[id(value)] = total
            continue
        if id(value) in open_:
            raise ConfigError(f"{source}: an alias refers to a mapping or list that contains it (a cycle)")
        open_.add(id(value))
        stack.append((value, True))
        stack.extend((v, False) for v in items)
