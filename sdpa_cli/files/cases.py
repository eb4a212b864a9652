"""Case files: one YAML or JSON mapping holding ``q``, ``k``, ``v`` (inline nested lists
or paths relative to the case file), optional ``bias``, ``mask``, ``sinks`` and ``segment_ids`` (``_kv``), options and a
description."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from numpy.typing import NDArray

from sdpa_cli.errors import InputError
from sdpa_cli.files.confine import confine
from sdpa_cli.files.loaders import Source, load_array, sniff
from sdpa_cli.files.opening import claim_stdin, is_stdin, is_stream, open_input
from sdpa_cli.files.samples import expand
from sdpa_cli.files.structured import TEXT_SUFFIXES, nested_to_array, parse_text
from sdpa_cli.names import INPUT_TENSORS
from sdpa_cli.text import echoed, readable, shown, unechoed

TEXT_KEYS = ("description",)


@dataclass(frozen=True)
class Case:
    """A case file: tensors, options and a description, all keyed by name.

    Attributes:
        tensors: ``q``, ``k``, ``v`` and optionally ``bias``, ``mask``, as arrays.
        sources: tensor name → where it came from (``case.yaml: q`` or a path).
        options: option name (underscored) → the value as written.
        where: option name → ``case.yaml: name``, for messages.
    """

    path: Path
    tensors: dict[str, NDArray[Any]]
    sources: dict[str, str]
    options: dict[str, Any]
    where: dict[str, str]
    description: str | None


def is_case_file(text: str) -> bool:
    """Whether a single positional argument should be read as a case file: a ``.yaml``,
    ``.yml`` or ``.json`` name, or a stream (``-``, ``<(...)``) whose format is sniffed."""
    text = expand(text)  # sample:NAME
    return Path(text).suffix.lower() in TEXT_SUFFIXES or is_stream(text)


def load_case(path_text: str, option_names: tuple[str, ...]) -> Case:
    """Read a YAML or JSON case file holding ``q``, ``k``, ``v`` and options.

    Tensor entries are inline nested lists or paths relative to the case file.
    """
    src = Source.parse(path_text)
    if is_stdin(src.path):
        claim_stdin("the case file")
    data = _read_mapping(src)
    known = set(INPUT_TENSORS) | set(TEXT_KEYS) | set(option_names)
    tensors: dict[str, NDArray[Any]] = {}
    sources: dict[str, str] = {}
    options: dict[str, Any] = {}
    where: dict[str, str] = {}
    description = None
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in known:
            raise InputError(
                src.label, f"unknown key {shown(raw_key)} (known: {', '.join(sorted(known))})"
            )
        if key in INPUT_TENSORS:
            tensors[key], sources[key] = _tensor(key, value, src)
        elif key == "description":
            # shown above a command's tables: no escape sequence or lone surrogate of
            # the file's reaches the terminal (its lines stay lines)
            description = readable(str(value))
        else:
            options[key] = value
            where[key] = f"{src.label}: {raw_key}"
    missing = [k for k in ("q", "k", "v") if k not in tensors]
    if missing:
        raise InputError(src.label, f"a case file needs q, k and v; missing {', '.join(missing)}")
    return Case(src.path, tensors, sources, options, where, description)


def _read_mapping(src: Source) -> dict[Any, Any]:
    """The mapping a case file holds; anything else is refused, pointing to Q K V files."""
    with open_input(src.path, src.label) as inp:  # opened once: sniffed, then read
        fmt = sniff(inp, src.label)
        if fmt not in ("json", "yaml"):
            raise InputError(
                src.label,
                "a single input must be a case file (.yaml or .json); give Q K V as three files",
            )
        data = parse_text(inp, fmt, src.label)
    if not isinstance(data, dict):
        raise InputError(
            src.label,
            "a case file must be a mapping with q, k and v (and options); give Q K V as three files otherwise",
        )
    return data


def _tensor(key: str, value: Any, src: Source) -> tuple[NDArray[Any], str]:
    """A tensor entry of a case file and where it came from: a path relative to the
    case file, or inline nested lists."""
    if isinstance(value, str):
        # A case file from a pipe names paths from here, and is confined to here as a
        # file is to its folder: the rule holds whatever the case file came through.
        piped = is_stream(str(src.path))
        base = Path(".") if piped else src.path.parent
        ref = Source.parse(value) if piped else Source.parse(value, base)
        whose = "the working directory (the case file came through a pipe)" if piped else None
        confine(value, ref.path, base, f"{src.label}: {key}", *([whose] if whose else []))
        if not echoed():  # the path is this file's content: messages name the entry
            ref = dataclasses.replace(ref, label=f"{src.label}: {key}")
        with unechoed():  # a file the user did not name: its content stays out of messages
            return load_array(ref, name=key), ref.label
    return nested_to_array(value, src.label, key), f"{src.label}: {key}"
