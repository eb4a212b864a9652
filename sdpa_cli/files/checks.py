"""The checks every reader shares: file-system errors as one line naming the file, a
header's dtype and shape, and the member picked from a file holding several."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from sdpa_cli.errors import InputError
from sdpa_cli.text import echoed, printable, shown

MAX_DEPTH = 32
"""Nesting deeper than any tensor sdpa handles (numpy allows 64 axes)."""
MAX_DIM = int(np.iinfo(np.intp).max)
"""The longest axis numpy can index."""


@contextlib.contextmanager
def reading(label: str) -> Iterator[None]:
    """Errors of the file system, as one line naming the file."""
    try:
        yield
    except FileNotFoundError:
        if not os.path.isabs(label) and working_directory() is None:
            raise InputError(label, GONE) from None
        raise InputError(label, "no such file" + _sample_hint(label)) from None
    except PermissionError:
        raise InputError(label, "permission denied") from None
    except OSError as exc:
        raise InputError(label, f"cannot be read: {exc.strerror or exc}") from None
    except ValueError as exc:  # os.stat and open refuse a path holding a NUL
        if "null" not in str(exc):
            raise
        raise InputError(label, "is not a usable file name: it holds a NUL character") from None


GONE = "cannot be found: the working directory no longer exists; name it by an absolute path"
"""A relative path once the folder it is relative to was deleted under the run."""


def working_directory() -> str | None:
    """The working directory, or None when it was deleted (a run whose every path is
    absolute still runs)."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        return None


def _sample_hint(label: str) -> str:
    """Outside a clone, the examples' ``samples/...`` paths are not there: say how to
    get them. A missing file a sample is named after (``scorecard.yaml``, typed
    without its folder) is named as that sample."""
    path, sep, member = label.replace("\\", "/").partition(":")
    if path.startswith(("samples/", "./samples/")):
        name = path.split("samples/", 1)[1]
        return (
            " (the samples ship with sdpa: sdpa samples --copy . puts them here, or name "
            f"it sample:{_stem(name)})"
        )
    # imported here: only a missing file needs the samples' names
    from sdpa_cli.files.samples import sample_files

    try:
        known = sample_files()
    except InputError:  # a copy of sdpa built without its samples
        return ""
    if path not in known:
        return ""
    return f" (a sample ships with sdpa under that name: sample:{_stem(path)}{sep}{member})"


def _stem(name: str) -> str:
    """A case file's sample name without its suffix (``scorecard``); a tensor file's whole."""
    return name.rsplit(".", 1)[0] if name.endswith((".yaml", ".yml", ".json")) else name


def check_dtype(dtype: np.dtype[Any], label: str) -> None:
    """A header's dtype: plain real numbers (bool, int, uint, float), never objects."""
    if dtype.hasobject:
        raise InputError(label, "holds Python objects (a pickle); sdpa never unpickles")
    if dtype.names is not None:
        raise InputError(label, f"has a structured dtype {dtype}; expected a plain numeric array")
    if dtype.kind not in "biuf":
        kinds = {
            "c": "complex",
            "U": "string",
            "S": "bytes",
            "M": "datetime",
            "m": "timedelta",
            "V": "raw bytes",
        }
        raise InputError(
            label, f"has {kinds.get(dtype.kind, str(dtype))} dtype {dtype}; expected real numbers"
        )


def check_shape(shape: tuple[int, ...], label: str) -> None:
    """A header's shape: at most MAX_DEPTH axes, each 0..MAX_DIM (numpy's header parser
    lets (-1,) and (2**64, 0) through)."""
    if len(shape) > MAX_DEPTH:
        raise InputError(label, f"has {len(shape)} axes; sdpa reads up to {MAX_DEPTH}")
    bad = [n for n in shape if not 0 <= n <= MAX_DIM]
    if bad:
        raise InputError(
            label,
            f"has a corrupt header: shape {shown(shape)} has an axis of {bad[0]}; "
            f"expected 0 to {MAX_DIM}",
        )


def pick_member(label: str, names: list[str], member: str | None, noun: str) -> tuple[str, str]:
    """The member of a file holding several (``file:name``), or its only one; and the
    label naming it (``label`` already ends in ``:member`` when one was given)."""
    if not names:
        raise InputError(label, f"holds no {noun}s")
    # the names are content: not shown for a file the user did not name
    listed = ", ".join(printable(n) for n in names) if echoed() else "not shown"
    if member is None:
        if len(names) != 1:
            raise InputError(
                label,
                f"holds {len(names)} {noun}s; pick one with {label}:NAME (names: {listed})",
            )
        return names[0], f"{label}:{printable(names[0])}"
    if member not in names:
        raise InputError(label, f"has no {noun} {member!r} (names: {listed})")
    return member, label
