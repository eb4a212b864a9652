"""JSON and YAML files: their text read with a size limit per format, parsed (YAML
through the safe loader with libyaml's parser where present, aliases refused; a key
given twice in a JSON object or YAML mapping refused), and nested lists of numbers turned into arrays, naming the
first bad element by its path (``q[3][1]``)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from numpy.typing import NDArray

from sdpa_cli.errors import InputError
from sdpa_cli.files.checks import MAX_DEPTH
from sdpa_cli.files.opening import Input, opened
from sdpa_cli.text import one_line, shown

TEXT_SUFFIXES = {".json": "json", ".yaml": "yaml", ".yml": "yaml"}
_C_YAML = hasattr(yaml, "CSafeLoader")
"""Whether PyYAML has its C parser (libyaml): four times faster than the pure one."""
TEXT_CAPS = {
    "json": 64 << 20,
    "yaml": (4 << 20) if _C_YAML else (1 << 20),
}
"""The most bytes a text input may hold, per format, from the measured cost of its
worst case: the most numbers a megabyte can hold (``1.5,`` for JSON; one short row
per line, ``- [0, 0]``, for YAML, whose cost goes by the node), read with ``sdpa
inspect`` on one core of a loaded 2-core machine: text to array (read, parse, check,
``np.array``), peak memory above the process's own ~65 MiB:

- JSON: 0.1 s and 11 MiB per MB (20 MB of ``1.5,``: 1.9 s, 216 MiB; 18-digit numbers
  cost a quarter of that); 64 MiB reads in about 7 s and 740 MiB.
- YAML with libyaml (C parser, PyYAML's composer and safe constructor): 4.1 s and
  145 MiB per MB in block style (2 MB: 8.1 s, 290 MiB; flow style with one-digit
  numbers 3 s and 108 MiB per MB, 18-digit numbers 0.3 s and 23 MiB); 4 MiB reads in
  about 17 s and 610 MiB.
- YAML with the pure-Python parser (no libyaml): about four times libyaml's time;
  1 MiB reads in about 17 s.

So every accepted file reads in under ~20 s and ~1 GiB; larger tensors belong in
``.npy`` or ``.safetensors`` (read at disk speed, memory = their size)."""
_FLOAT_LIMIT = 2**1024 - 2**970
"""Integers this large or larger round past float64's largest number: float() overflows."""


def read_text(path: Path | Input, fmt: str, label: str) -> str:
    """The UTF-8 text of a JSON or YAML input, refused above its format's cap."""
    cap = TEXT_CAPS[fmt]
    with opened(path, label) as inp:
        raw = inp.read_all(
            cap,
            f"of text; the most sdpa reads as {fmt.upper()} is {cap >> 20} MiB (more would "
            "take minutes and gigabytes): tensors this large belong in .npy or .safetensors",
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(label, "is not UTF-8 text") from None


def parse_text(path: Path | Input, fmt: str, label: str) -> Any:
    """The data of a JSON or YAML file (YAML through the safe loader, no aliases, no
    duplicate keys; JSON with no duplicate keys)."""
    text = read_text(path, fmt, label)
    return parse_json(text, label) if fmt == "json" else parse_yaml(text, label)


def parse_json(text: str, label: str) -> Any:
    """JSON text → data; a duplicate key in an object is refused, naming the key."""
    try:
        return json.loads(text, object_pairs_hook=lambda pairs: _unique(pairs, label))
    except json.JSONDecodeError as exc:
        raise InputError(
            label, f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise InputError(label, "is nested too deeply") from None
    except ValueError as exc:  # an integer of more than sys.get_int_max_str_digits()
        raise InputError(label, f"invalid JSON: {_value_problem(exc)}") from None


def _unique(pairs: list[tuple[str, Any]], label: str) -> dict[str, Any]:
    """A JSON object's pairs as a dict, refusing a key given twice (json keeps the last)."""
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise InputError(label, f"duplicate key {shown(key)} in a JSON object")
            seen.add(key)
    return data


def parse_yaml(text: str, label: str) -> Any:
    """YAML text → data, through :class:`_StrictLoader`."""
    try:
        loader = _StrictLoader(text)  # what yaml.load(text, Loader=...) does
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        if "nesting depth" in str(exc.problem):  # PyYAML ≥ 6.0.4 stops where we recursed
            raise InputError(label, "is nested too deeply") from None
        mark = exc.problem_mark
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        raise InputError(label, f"invalid YAML{where}: {one_line(exc.problem or exc)}") from None
    except yaml.reader.ReaderError as exc:  # its str() takes two lines
        char = exc.character
        what = f"byte #x{char[0]:02x}" if isinstance(char, bytes) else f"character #x{char:04x}"
        raise InputError(
            label, f"invalid YAML at character {exc.position + 1}: {what}: {exc.reason}"
        ) from None
    except yaml.YAMLError as exc:
        raise InputError(label, f"invalid YAML: {one_line(exc)}") from None
    except RecursionError:
        raise InputError(label, "is nested too deeply") from None
    except (ValueError, TypeError, AttributeError, KeyError, IndexError, OverflowError) as exc:
        # The safe loader's constructors, on a value they cannot build: a 5000-digit
        # integer, a date 2024-13-45, a tagged scalar such as !!bool x or !!timestamp 1.
        raise InputError(label, f"invalid YAML: {_value_problem(exc)}") from None


def _value_problem(exc: Exception) -> str:
    """What a value the parser could not construct is, in words."""
    text = str(exc)
    if "integer string conversion" in text:
        return f"an integer has more than {sys.get_int_max_str_digits()} digits"
    return f"a value cannot be read as its type ({type(exc).__name__}: {one_line(text)})"


class _Strict(yaml.composer.Composer, yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
    """PyYAML's composer and safe constructor, refusing aliases (a few lines of them
    can expand to gigabytes) and a key given twice in a mapping."""

    check_event: Any  # the parser's (libyaml's or PyYAML's), a sibling base
    peek_event: Any

    def __init__(self) -> None:  # each base's own, as PyYAML's loaders call them
        yaml.composer.Composer.__init__(self)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "YAML aliases (*name) are not accepted", self.peek_event().start_mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        if not isinstance(node, yaml.MappingNode):
            return super().construct_mapping(node, deep)  # its error names the node
        self.flatten_mapping(node)
        mapping: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                seen = key in mapping
            except TypeError:  # an unhashable key: the base constructor words it
                return super().construct_mapping(node, deep)
            if seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {shown(key)}", key_node.start_mark
                )
            mapping[key] = self.construct_object(value_node, deep=deep)
        return mapping


if _C_YAML:

    class _StrictLoader(yaml._yaml.CParser, _Strict):
        """libyaml's scanner and parser (the cost of YAML is there) under PyYAML's
        composer: libyaml's own composer recurses without a limit (a 100,000-deep
        ``[[[...`` crashes the process), PyYAML's raises RecursionError."""

        def __init__(self, stream: str) -> None:
            yaml._yaml.CParser.__init__(self, stream)
            _Strict.__init__(self)

        get_node = yaml.composer.Composer.get_node
        check_node = yaml.composer.Composer.check_node
        get_single_node = yaml.composer.Composer.get_single_node

else:  # pragma: no cover - PyYAML built without libyaml

    class _StrictLoader(  # type: ignore[no-redef]
        yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser, _Strict
    ):
        """The pure-Python safe loader, with :class:`_Strict`'s refusals."""

        def __init__(self, stream: str) -> None:
            yaml.reader.Reader.__init__(self, stream)
            yaml.scanner.Scanner.__init__(self)
            yaml.parser.Parser.__init__(self)
            _Strict.__init__(self)


def nested_to_array(data: Any, label: str, name: str = "value") -> NDArray[Any]:
    """Nested lists of numbers (or booleans) → an array; names the first bad element.

    Raises:
        InputError: ``q[3][1]: expected a number, got 'x'``, ragged rows, too deep.
    """
    if isinstance(data, Mapping):
        raise InputError(
            label, f"{name} is a mapping; expected a number or nested lists of numbers"
        )
    shape = _first_row_shape(data, label, name)
    kinds: set[str] = set()
    if shape:
        _walk(data, shape, 0, name, label, kinds)
    else:
        kinds.add(_leaf_kind(data, name, label))
    if kinds == {"bool", "number"}:
        raise InputError(label, f"{name} mixes booleans and numbers")
    if kinds == {"bool"}:
        return np.array(data, dtype=np.bool_)
    arr = np.array(data, dtype=np.float64) if shape and 0 in shape else np.array(data)
    if arr.dtype.kind not in "biuf":
        arr = arr.astype(np.float64)
    return arr


def _first_row_shape(data: Any, label: str, name: str) -> list[int]:
    """The shape the first entry at each depth declares; every row is held to it."""
    shape: list[int] = []
    probe = data
    while isinstance(probe, list):
        if len(shape) >= MAX_DEPTH:
            raise InputError(label, f"{name} is nested more than {MAX_DEPTH} levels deep")
        shape.append(len(probe))
        if not probe:
            break
        probe = probe[0]
    return shape


def _walk(node: Any, shape: list[int], depth: int, path: str, label: str, kinds: set[str]) -> None:
    """Check that ``node`` (at ``path``, ``depth`` axes down) is a list of ``shape[depth]``
    entries all the way down, adding the kind of each leaf to ``kinds``."""
    if not isinstance(node, list):
        raise InputError(
            label,
            f"{path}: rows are ragged: expected a list of {shape[depth]}, got {shown(node)}",
        )
    if len(node) != shape[depth]:
        raise InputError(
            label, f"{path}: rows are ragged: expected {shape[depth]} entries, got {len(node)}"
        )
    if depth + 1 == len(shape):
        for i, leaf in enumerate(node):
            kinds.add(_leaf_kind(leaf, f"{path}[{i}]", label))
    else:
        for i, child in enumerate(node):
            _walk(child, shape, depth + 1, f"{path}[{i}]", label, kinds)


def _leaf_kind(node: Any, path: str, label: str) -> str:
    """``bool`` or ``number`` for a leaf; anything else (a list among numbers, a string,
    an integer too large for a float) refused."""
    if isinstance(node, bool):
        return "bool"
    if isinstance(node, float):
        return "number"
    if isinstance(node, int):
        if not -_FLOAT_LIMIT < node < _FLOAT_LIMIT:
            raise InputError(
                label,
                f"{path}: {len(str(abs(node)))}-digit integer is too large for a float",
            )
        return "number"
    if isinstance(node, list):
        raise InputError(label, f"{path}: rows are ragged: expected a number, got a list")
    raise InputError(label, f"{path}: expected a number, got {type(node).__name__} {shown(node)}")
