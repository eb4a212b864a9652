"""JSON and YAML files: their text read with a size limit, parsed (YAML through the safe
loader, aliases refused), and nested lists of numbers turned into arrays, naming the
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
from sdpa_cli.files.checks import MAX_DEPTH, reading
from sdpa_cli.text import one_line

TEXT_SUFFIXES = {".json": "json", ".yaml": "yaml", ".yml": "yaml"}
MAX_TEXT_BYTES = 256 << 20
"""Text inputs above this size are refused: nested lists of that size do not fit in memory."""
_FLOAT_LIMIT = 2**1024 - 2**970
"""Integers this large or larger round past float64's largest number: float() overflows."""


def _read_text(path: Path, label: str) -> str:
    with reading(label):
        if path.is_dir():
            raise InputError(label, "is a directory, not a file")
        size = path.stat().st_size
        if size > MAX_TEXT_BYTES:
            raise InputError(label, f"is {size} bytes of text; tensors this large belong in .npy")
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise InputError(label, "is not UTF-8 text") from None


def parse_text(path: Path, fmt: str, label: str) -> Any:
    """The data of a JSON or YAML file (YAML through the safe loader, no aliases)."""
    text = _read_text(path, label)
    return _parse_json(text, label) if fmt == "json" else _parse_yaml(text, label)


def _parse_json(text: str, label: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            label, f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise InputError(label, "is nested too deeply") from None
    except ValueError as exc:  # an integer of more than sys.get_int_max_str_digits()
        raise InputError(label, f"invalid JSON: {_value_problem(exc)}") from None


def _parse_yaml(text: str, label: str) -> Any:
    try:
        return yaml.load(text, Loader=_SafeNoAliasLoader)
    except yaml.MarkedYAMLError as exc:
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


class _SafeNoAliasLoader(yaml.SafeLoader):
    """The safe loader, refusing aliases: a few lines of them can expand to gigabytes."""

    def fetch_alias(self) -> None:
        raise yaml.constructor.ConstructorError(
            None, None, "YAML aliases (*name) are not accepted", self.get_mark()
        )


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
            f"{path}: rows are ragged: expected a list of {shape[depth]}, got {node!r:.40}",
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
    raise InputError(label, f"{path}: expected a number, got {type(node).__name__} {node!r:.40}")
