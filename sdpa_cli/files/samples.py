"""The samples shipped with sdpa: found, described, copied, and named as ``sample:NAME``.

An installed wheel holds them as package data, ``sdpa_cli/samples/`` (``setup.py``
copies the repository's ``samples/`` there at build time); a source checkout or an
editable install reads the repository's ``samples/`` in place. One entry per case file
(``scorecard``), per set of tensor files (``batched_{q,k,v}.npy``), per other file
(``cross.npz``) and per folder (``check/``); each described by its own ``description:``
or first comment, or else by what it holds (shapes and dtypes, or its few values).
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from sdpa_cli.errors import InputError
from sdpa_cli.files.writers import create_new, temporary_beside

PREFIX = "sample:"
"""A file argument naming a shipped sample: ``sample:scorecard``, ``sample:cross.npz:q``."""

CASE_SUFFIXES = (".yaml", ".yml", ".json")
"""What ``sample:NAME`` tries after ``NAME`` itself, in this order."""

_TRIPLE = re.compile(r"(?P<stem>.+)_(?P<part>q|k|v)\.npy")
_SKIPPED = ("__pycache__",)


@dataclass(frozen=True)
class Sample:
    """One entry of ``sdpa samples``: its ``name``, its ``files`` (paths relative to the
    samples folder, ``/``-separated) and a one-line ``description``."""

    name: str
    files: tuple[str, ...]
    description: str


def samples_dir() -> Path:
    """The folder holding the samples: the package's ``samples/`` in an installed wheel,
    the repository's ``samples/`` in a checkout.

    Raises:
        InputError: when neither is there (a copy of sdpa built without them).
    """
    packaged = files("sdpa_cli").joinpath("samples")
    if isinstance(packaged, Path) and packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parents[2] / "samples"
    if checkout.is_dir():
        return checkout
    raise InputError(
        "samples",
        "not found: this copy of sdpa was installed without them; "
        "install it from a wheel or a clone of the repository",
    )


def sample_files(root: Path | None = None) -> list[str]:
    """Every file under the samples folder, relative and ``/``-separated, sorted."""
    base = samples_dir() if root is None else root
    return sorted(
        p.relative_to(base).as_posix()
        for p in base.rglob("*")
        if p.is_file()
        and not p.name.startswith(".")
        and p.suffix != ".pyc"
        and not any(part in _SKIPPED for part in p.relative_to(base).parts)
    )


def catalog(root: Path | None = None) -> list[Sample]:
    """The samples as ``sdpa samples`` lists them: case files first, then tensor files,
    then folders, each group by name."""
    base = samples_dir() if root is None else root
    every = sample_files(base)
    top = [f for f in every if "/" not in f]
    folders = sorted({f.split("/", 1)[0] for f in every if "/" in f})
    cases = [f for f in top if f.endswith(CASE_SUFFIXES) and _is_mapping(base / f)]
    triples = _triples(top)
    in_triple = {f for files_ in triples.values() for f in files_}
    others = [f for f in top if f not in cases and f not in in_triple]
    stems = [Path(f).stem for f in cases]
    entries = [  # by its stem, unless two case files share it
        Sample(
            Path(f).stem if stems.count(Path(f).stem) == 1 else f, (f,), _describe_text(base / f)
        )
        for f in cases
    ]
    entries += [
        Sample(f"{stem}_{{q,k,v}}.npy", members, _describe_arrays(base, members))
        for stem, members in sorted(triples.items())
    ]
    entries += [Sample(f, (f,), _describe_other(base / f)) for f in others]
    for folder in folders:
        inside = tuple(f for f in every if f.startswith(folder + "/"))
        entries.append(Sample(folder + "/", inside, _describe_folder(base, inside)))
    return entries


def resolve(text: str, root: Path | None = None) -> str:
    """``sample:NAME[:MEMBER]`` → the sample's real path (``:MEMBER`` kept).

    ``NAME`` is a file's path under the samples folder (``cross.npz``,
    ``check/q.npy``) or a case file's name without its suffix (``scorecard`` →
    ``scorecard.yaml``).

    Raises:
        InputError: naming ``text`` and listing the known names, for an unknown one.
    """
    base = samples_dir() if root is None else root
    name, sep, member = text.removeprefix(PREFIX).partition(":")
    known = sample_files(base)
    for candidate in (name, *(name + suffix for suffix in CASE_SUFFIXES)):
        if candidate in known:
            return str(base / candidate) + sep + member
    names = ", ".join(s.name for s in catalog(base))
    raise InputError(
        text, f"no such sample; known: {names} (a path inside a folder too, e.g. check/q.npy)"
    )


def expand(text: str) -> str:
    """``text`` with a ``sample:`` name resolved to its path; any other text as it is."""
    return resolve(text) if text.startswith(PREFIX) else text


def copy_samples(destination: Path, *, force: bool = False) -> tuple[Path, list[Path]]:
    """Copy every sample into ``destination/samples``, keeping the folders; returns that
    folder and the files written. Nothing is written when one file is refused.

    A copy never follows a symbolic link inside ``destination/samples``: a linked
    folder it would write into is refused; a file (or a link where a file goes) is
    replaced by a temporary file renamed over it, never written through.

    Raises:
        InputError: when ``destination`` is a file, a folder the copy writes into is a
            symbolic link, or a sample's file already exists there and ``force`` is off.
    """
    source = samples_dir()
    target = destination / "samples"
    if destination.exists() and not destination.is_dir():
        raise InputError(str(destination), "is a file, not a folder to copy the samples into")
    every = sample_files(source)
    # every folder from destination/samples down to each file's, ancestors included
    folders = sorted({target} | {target / p for f in every for p in Path(f).parents})
    for folder in folders:
        if folder.is_symlink():
            raise InputError(
                str(folder), "is a symbolic link; the samples are copied only into real folders"
            )
    existing = [f for f in every if os.path.lexists(target / f)]
    if existing and not force:
        shown = ", ".join(existing[:3]) + (f" and {len(existing) - 3} more" if existing[3:] else "")
        raise InputError(
            str(target), f"already holds {shown}; --force overwrites the samples' files"
        )
    written = []
    try:
        for f in every:
            path = target / f
            path.parent.mkdir(parents=True, exist_ok=True)
            _copy_into(source / f, path)
            written.append(path)
    except OSError as exc:
        raise InputError(str(target), f"cannot copy the samples: {exc.strerror or exc}") from exc
    return target, written


def _copy_into(source: Path, path: Path) -> None:
    """Copy ``source`` to a temporary file beside ``path``, then rename it over ``path``:
    a symbolic link or a hard link there is replaced, never written through."""
    if path.parent.is_symlink():  # planted since the check: never write through it
        raise OSError(f"{path.parent} is a symbolic link")
    tmp = temporary_beside(path)
    try:
        with os.fdopen(create_new(tmp), "wb") as fh, source.open("rb") as src:
            shutil.copyfileobj(src, fh)
        os.chmod(tmp, 0o666 & ~_umask())  # made 0o600; a sample is no secret
        os.replace(tmp, path)
    except BaseException as exc:  # a Ctrl-C just after the file is made included
        if not isinstance(exc, FileExistsError):  # that one: the name was another's
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _triples(top: list[str]) -> dict[str, tuple[str, ...]]:
    """``NAME_q.npy``, ``NAME_k.npy``, ``NAME_v.npy`` all three there, by ``NAME``."""
    parts: dict[str, dict[str, str]] = {}
    for f in top:
        match = _TRIPLE.fullmatch(f)
        if match:
            parts.setdefault(match["stem"], {})[match["part"]] = f
    return {
        stem: (found["q"], found["k"], found["v"])
        for stem, found in parts.items()
        if len(found) == 3
    }


def _is_mapping(path: Path) -> bool:
    return isinstance(_read_structured(path), dict)


def _read_structured(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError):
        return None


def _first_sentence(text: str) -> str:
    """The first sentence of a paragraph, on one line."""
    flat = " ".join(text.split())
    match = re.search(r"(?<=\.)\s", flat)
    return (flat[: match.start()] if match else flat).rstrip(":;")


def _comment(path: Path) -> str:
    """The first sentence of the comment block that opens ``path``, as one line (a line
    ending in a colon ends it: what follows is a list or a command)."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
        if lines[-1].endswith(":"):
            break
    return _first_sentence(" ".join(lines))


def _describe_text(path: Path) -> str:
    data = _read_structured(path)
    if isinstance(data, dict) and isinstance(data.get("description"), str):
        return _first_sentence(data["description"])
    return _comment(path) or "a case file: " + ", ".join(map(str, data))


def _describe_arrays(base: Path, members: tuple[str, ...]) -> str:
    shapes = []
    for f in members:
        arr = np.load(base / f, mmap_mode="r", allow_pickle=False)
        shapes.append(f"{Path(f).stem.rsplit('_', 1)[-1]} {tuple(arr.shape)}")
    dtype = np.load(base / members[0], mmap_mode="r", allow_pickle=False).dtype
    return f"{dtype} tensors: " + ", ".join(shapes)


def _describe_other(path: Path) -> str:
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as npz:
            held = ", ".join(f"{k} {tuple(npz[k].shape)}" for k in npz.files)
        return f"arrays: {held}"
    data = _read_structured(path)
    if isinstance(data, list) and len(data) <= 8:
        return "values " + json.dumps(data)
    return _comment(path) if path.suffix in (".yaml", ".yml") else path.suffix.lstrip(".")


def _describe_folder(base: Path, inside: tuple[str, ...]) -> str:
    """The first comment of the folder's first case file, or its script's docstring."""
    top = [f for f in inside if f.count("/") == 1]
    for f in top:
        if f.endswith((".yaml", ".yml")) and _comment(base / f):
            return _comment(base / f)
    for f in top:
        if f.endswith(".py"):
            doc = ast.get_docstring(ast.parse((base / f).read_text(encoding="utf-8")))
            if doc:
                return _first_sentence(doc.split("\n\n")[0])
    return f"{len(inside)} files"
