"""Paths → numpy arrays, for every input format, with the safety checks at the door.

Formats: ``.npy`` (read into memory, never unpickled), ``.npz`` (``file.npz:name`` picks
an array), ``.safetensors`` (read into memory; ``file.safetensors:name`` picks a tensor;
BF16, F8_E4M3 and F8_E5M2 as ``ml_dtypes`` arrays, upcast block by block like the
rest), PyTorch files (``torch.save``'s zip or legacy pickle, read only through
``torch.load(weights_only=True)`` when torch is installed; ``file.pt:name`` picks a
tensor), ``.json`` and ``.yaml``/``.yml`` (nested
lists of numbers; YAML through the safe loader, aliases refused). The format is sniffed
from the file's first bytes (``\\x93NUMPY``, ``PK`` (a zip holding ``*/data.pkl`` is
PyTorch's), a pickle's PROTO opcode, a safetensors header length followed by ``{``)
before the extension is trusted. Every error is an
:class:`~sdpa_cli.errors.InputError` naming the file. A URL (``s3://...``,
``file://...``) is copied to a temporary file first (:mod:`~sdpa_cli.files.remote`)
and read from there like any other file.

This module names the source and dispatches on the sniffed format; each format's reader
and checks live in :mod:`~sdpa_cli.files.npy`, :mod:`~sdpa_cli.files.safetensors`,
:mod:`~sdpa_cli.files.pytorch` and :mod:`~sdpa_cli.files.structured`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.errors import InputError
from sdpa_cli.files.checks import reading
from sdpa_cli.files.npy import NPY_MAGIC, ZIP_MAGIC, load_npy, load_npz
from sdpa_cli.files.opening import (
    STDIN,
    STDIN_LABEL,
    Input,
    claim_stdin,
    is_stdin,
    open_input,
    opened,
)
from sdpa_cli.files.pytorch import (
    HEAD_BYTES,
    TORCH_SUFFIXES,
    is_legacy_torch,
    is_pickle,
    is_torch_archive,
    load_torch,
)
from sdpa_cli.files.remote import fetched, is_url
from sdpa_cli.files.safetensors import SAFETENSORS_SUFFIX, load_safetensors, looks_like_safetensors
from sdpa_cli.files.samples import PREFIX as SAMPLE_PREFIX
from sdpa_cli.files.samples import expand
from sdpa_cli.files.structured import TEXT_SUFFIXES, nested_to_array, parse_text
from sdpa_cli.text import printable

MEMBER_SUFFIXES = (".npz", SAFETENSORS_SUFFIX, *TORCH_SUFFIXES)
"""Formats that hold several arrays, one picked with ``file:name``."""


@dataclass(frozen=True)
class Source:
    """Where an array comes from: ``path`` and, for ``.npz``, ``.safetensors`` and
    PyTorch files, a member ``name``."""

    path: Path
    member: str | None
    label: str

    @classmethod
    def parse(cls, text: str, base: Path | None = None) -> Source:
        """``file``, ``file.npz:name``, ``file.safetensors:name`` or ``file.pt:name``,
        relative to ``base`` when given."""
        if base is None and text.startswith(SAMPLE_PREFIX):  # sample:NAME, a shipped file
            return replace(cls.parse(expand(text)), label=printable(text))
        member = None
        path_text = text
        head, sep, tail = text.rpartition(":")
        if sep and head.lower().endswith(MEMBER_SUFFIXES) and not Path(text).exists():
            path_text, member = head, tail
        if base is None and is_stdin(text):
            return cls(path=Path(STDIN), member=None, label=STDIN_LABEL)
        path = Path(path_text).expanduser()
        if base is not None and not path.is_absolute():
            path = base / path
        label = text if base is None else str(path) + (f":{member}" if member else "")
        return cls(path=path, member=member, label=printable(label))


def sniff(path: Path | Input, label: str) -> str:
    """The format of ``path``: ``npy``, ``npz``, ``safetensors``, ``torch``, ``json`` or
    ``yaml``; a stream with no known extension (``-``, ``<(...)``) holding text is JSON
    when it starts with ``{`` or ``[``, YAML otherwise."""
    with opened(path, label) as inp:
        return _sniff(inp)


def _sniff(inp: Input) -> str:
    label = inp.label
    head = inp.head(HEAD_BYTES)
    size = inp.size
    if not head:
        raise InputError(
            label, "is empty" + (" (nothing was written to it)" if inp.stream is not None else "")
        )
    suffix = inp.path.suffix.lower()
    if head.startswith(NPY_MAGIC):
        return "npy"
    if head.startswith(ZIP_MAGIC):
        with reading(label):
            return "torch" if is_torch_archive(inp.fh) else "npz"
    if is_legacy_torch(head):
        return "torch"
    if suffix == SAFETENSORS_SUFFIX or looks_like_safetensors(head, size):
        return "safetensors"
    if is_pickle(head):
        raise InputError(
            label,
            "is a Python pickle, not a tensor file (nor torch.save's); sdpa never unpickles: "
            "save the arrays with numpy.save",
        )
    if suffix == ".npy":
        raise InputError(label, "is not a .npy file (it does not start with the NUMPY magic bytes)")
    if suffix == ".npz":
        raise InputError(label, "is not a .npz file (it is not a zip archive)")
    if suffix in TORCH_SUFFIXES[:3]:  # .bin is anyone's
        raise InputError(
            label, "is not a PyTorch file (neither torch.save's zip archive nor its pickle)"
        )
    if suffix in TEXT_SUFFIXES:
        return TEXT_SUFFIXES[suffix]
    if inp.stream is not None:
        return "json" if head.lstrip()[:1] in (b"{", b"[") else "yaml"
    raise InputError(
        label,
        f"unknown format {suffix or '(no extension)'!r}; expected .npy, .npz, .safetensors, .pt, .json, .yaml or .yml",
    )


def load_array(source: str | Source, *, name: str = "value") -> NDArray[Any]:
    """Load one array from ``path``, ``path.npz:name``, ``path.safetensors:name`` or
    ``path.pt:name``.

    ``-`` is standard input (one input of a command; :func:`~sdpa_cli.files.opening.claim_stdin`).
    Arrays come back read into memory (never memory-mapped: a file truncated under the
    run would kill the process) and uncast (bfloat16 and float8 as ``ml_dtypes`` arrays); text files as int, float or
    bool arrays. Shapes and dtypes are judged later, by the spec.

    Raises:
        InputError: naming the file and the problem.
    """
    if isinstance(source, str) and is_url(source):
        return _load_url(source, name)
    src = source if isinstance(source, Source) else Source.parse(source)
    if is_stdin(src.path):
        claim_stdin(name)
    with open_input(src.path, src.label) as inp:  # opened once: sniffed, then read
        fmt = _sniff(inp)
        if fmt == "npy":
            return load_npy(inp, src.label)
        if fmt == "npz":
            return load_npz(inp, src.member, src.label)
        if fmt == "safetensors":
            return load_safetensors(inp, src.member, src.label)
        if fmt == "torch":
            return load_torch(inp, src.member, src.label)
        data = parse_text(inp, fmt, src.label)
    return nested_to_array(data, src.label, name)


def _load_url(text: str, name: str) -> NDArray[Any]:
    """A URL's array (``url``, ``url.npz:name``): its file fetched to a temporary file,
    read as a local one, and copied out of the file's memory map before the file goes."""
    url, member = text, None
    head, sep, tail = text.rpartition(":")
    if sep and head.lower().endswith(MEMBER_SUFFIXES):
        url, member = head, tail
    label = printable(text)
    with fetched(url, label) as path:
        arr = load_array(Source(path=path, member=member, label=label), name=name)
        return np.array(arr) if isinstance(arr, np.memmap) else arr
