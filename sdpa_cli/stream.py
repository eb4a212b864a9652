"""Trace documents written as they are computed: ``sdpa compute --format json|yaml``
and ``--save FILE.npz``, stage by stage and block by block.

:func:`~sdpa_cli.report.payload` builds the document in memory, every number a Python
object (about 90 bytes each). Here the statistics come from a trace that kept nothing
score-sized, and each stage is computed again with the block driver, one sweep per
stage, its rows written as each block comes: memory stays a few blocks, whatever the
output's size. The text is byte for byte ``to_json(payload(...))`` or
``to_yaml(payload(...))``: JSON's rows are ``json.dumps`` of each block; YAML's arrays
are laid out as PyYAML's emitter lays them out (block sequences down to the rows, each
row a flow sequence wrapped past column 100), the head and tail dumped by PyYAML.

The .npz holds what ``np.savez`` writes, one ``.npy`` member per stage: one sweep writes
every stage's blocks into temporary files, then each is copied into its member.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import stat
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from typing import IO, Any, BinaryIO

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.diagnosis.findings import Diagnosis
from sdpa_cli.engine.block import applicable_stages, visible_keys
from sdpa_cli.engine.driver import KeyMode, Place, Progress, sweep
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.trace import Trace
from sdpa_cli.engine.types import Index
from sdpa_cli.errors import InputError
from sdpa_cli.files.writers import write_atomic
from sdpa_cli.report import diagnosis_payload, setup_payload, to_json, to_yaml

Write = Callable[[str], object]
"""Where text goes (``sys.stdout.write``, ``click.echo``...)."""

Rows = tuple[Index, int, NDArray[Any]]
"""Consecutive rows of a stage: the index of their slice in the stage's leading axes,
the first row, and the values ``(rows, last axis)``."""

YAML_WIDTH = 100
"""The ``width`` :func:`~sdpa_cli.report.to_yaml` gives PyYAML: a flow sequence breaks
its line after the first item that ends at or past this column."""

_PIECE = 1 << 16
"""Values formatted at a time from a stage kept whole."""

_BUFFER = 1 << 20
"""Characters gathered before a write: few calls, a few MiB at most in hand."""

# 1e-05 is written 1.0e-05 by PyYAML: a bare exponent is not a YAML 1.1 float. Starting
# with the literal "e" lets the regex engine skip to each one.
_BARE_EXPONENT = re.compile(r"e(?<=[ \[-]\de)")


class _Out:
    """Text gathered into writes of about :data:`_BUFFER` characters."""

    def __init__(self, write: Write) -> None:
        self._write = write
        self._parts: list[str] = []
        self._size = 0

    def __call__(self, text: str) -> None:
        self._parts.append(text)
        self._size += len(text)
        if self._size >= _BUFFER:
            self.flush()

    def flush(self) -> None:
        if self._parts:
            self._write("".join(self._parts))
            self._parts, self._size = [], 0


def write_document(
    trace: Trace,
    stages: tuple[str, ...],
    diagnosis: Diagnosis | None,
    write: Write,
    *,
    fmt: str,
    jobs: int = 1,
    progress: Progress | None = None,
) -> None:
    """Write ``to_json(payload(...)) + "\\n"`` (one line) or ``to_yaml(payload(...))``
    for ``stages``, streamed: the head (setup and stage names), each stage block by
    block, ``visible`` when the masks hide a score, the findings.

    Args:
        trace: the statistics of the run, keeping :func:`trace_stages` (the stages are
            computed again here).
        stages: the stages asked for; those the options do not bring about are left out.
        diagnosis: its findings, written last.
        write: called with consecutive pieces of the text.
        fmt: ``json`` or ``yaml``.
        jobs: threads computing blocks.
        progress: told the scores done, all stages together counting as one sweep.
    """
    for_json = fmt == "json"
    spec = trace.spec
    names = [s for s in applicable_stages(spec) if s in stages]
    scores = any(s != "output" for s in names)
    # The output as trace() computes it when it keeps these stages: beside score-shaped
    # stages, from blocks over every key; alone, the output of the statistics' pass.
    kept = None if scores else trace.merged_output
    keys: KeyMode = "all" if scores else "visible"
    hidden = scores and int(trace.stats.n_visible.sum()) < math.prod(spec.weights_shape)
    arrays = [*names, "visible"] if hidden else names
    head = setup_payload(spec, for_json=for_json)
    head["stages"] = names
    tail = diagnosis_payload(diagnosis, for_json=for_json) if diagnosis else {"findings": []}
    out = _Out(write)
    swept = [
        n for n in arrays if math.prod(_shape(spec, n)) > 0 and (n != "output" or kept is None)
    ]
    tell = _shared(progress, len(swept))
    out(to_json(head)[:-1] if for_json else to_yaml(head))
    for name in arrays:
        shape = _shape(spec, name)
        if name == "output" and kept is not None:
            rows = _pieces(kept)
        else:
            rows = _stage_rows(spec, name, keys=keys, jobs=jobs, progress=tell)
        if for_json:
            out(f", {json.dumps(name)}: ")
            _json_array(shape, rows, out)
        else:
            _yaml_array(name, shape, rows, out)
    out(", " + to_json(tail)[1:] + "\n" if for_json else to_yaml(tail))
    out.flush()


def trace_stages(spec: AttentionSpec, stages: tuple[str, ...]) -> tuple[str, ...]:
    """What the trace given to :func:`write_document` should keep whole for
    ``stages``: the output when it is the only stage written (output-sized: the
    document then holds the output of the pass that gathered the statistics, as a
    trace keeping it would); nothing otherwise, every stage being computed again."""
    names = [s for s in applicable_stages(spec) if s in stages]
    return ("output",) if names == ["output"] else ()


def _shape(spec: AttentionSpec, name: str) -> tuple[int, ...]:
    """A stage's shape as written: the output's as returned (heads merged under
    ``--heads``, ``(..., L, H, Ev)`` under ``--layout bshd``)."""
    return spec.merged_output_shape if name == "output" else spec.weights_shape


def _shared(progress: Progress | None, sweeps: int) -> Progress | None:
    """``progress`` told ``1/sweeps`` of each count: several sweeps make one bar."""
    if progress is None or sweeps <= 1:
        return progress
    done = [0, 0]  # scores swept, scores told

    def tell(n: int) -> None:
        done[0] += n
        now = done[0] // sweeps
        progress(now - done[1])
        done[1] = now

    return tell


# --- one stage, block by block ------------------------------------------------------------


def _stage_rows(
    spec: AttentionSpec, name: str, *, keys: KeyMode, jobs: int, progress: Progress | None
) -> Iterator[Rows]:
    """The rows of stage ``name`` (or ``visible``) in C order, as float64 (bool), a
    block at a time; nothing when the stage is empty. The output comes a slice at a
    time under ``--heads`` and ``--layout bshd``, its heads merged (its rows need
    every head)."""
    if math.prod(_shape(spec, name)) == 0:
        return iter(())

    def visit(place: Place) -> Rows:
        values: NDArray[Any]
        if name == "visible":  # the masks alone: no need to compute the block
            seen = visible_keys(spec, place.lead, place.rows, place.keys)
            n = place.rows.stop - place.rows.start
            values = np.ones((n, spec.S), np.bool_) if seen is None else np.asarray(seen)
        else:
            values = np.asarray(getattr(place.attend(spec), name), dtype=np.float64)
        return place.lead, place.rows.start, values

    rows = sweep(spec, visit, jobs=jobs, keys=keys, progress=progress)
    return rows if name != "output" or not spec.output_rearranged else _merge_heads(spec, rows)


def _pieces(values: NDArray[Any]) -> Iterator[Rows]:
    """A stage kept whole, as rows of about :data:`_PIECE` values at a time."""
    step = max(1, _PIECE // max(values.shape[-1], 1))
    for lead in np.ndindex(*values.shape[:-2]):
        for i0 in range(0, values.shape[-2], step):
            yield lead, i0, values[lead][i0 : i0 + step]


def _merge_heads(spec: AttentionSpec, rows: Iterator[Rows]) -> Iterator[Rows]:
    """The output's rows of each slice of the leading axes but the head's, gathered
    from the blocks of its heads (which come head after head): ``(L, heads · Ev)``
    under ``--heads``; under ``--layout bshd`` the ``(H, Ev)`` of each query row, the
    row index joining the leading axes of ``(..., L, H, Ev)``."""
    heads = spec.lead[-1]
    merged = np.empty((spec.L, heads, spec.Ev))
    for lead, start, values in rows:
        merged[start : start + len(values), lead[-1]] = values
        if lead[-1] == heads - 1 and start + len(values) == spec.L:
            if spec.options.heads is not None:
                yield lead[:-1], 0, merged.reshape(spec.L, heads * spec.Ev)
            else:
                for i in range(spec.L):
                    yield (*lead[:-1], i), 0, merged[i]


def _json_array(shape: tuple[int, ...], rows: Iterator[Rows], out: _Out) -> None:
    """A stage as nested JSON lists, ``(*lead, L, last)``: brackets and commas around
    the rows of each block, as ``json.dumps`` nests them."""
    if math.prod(shape) == 0:
        out(json.dumps(np.zeros(shape).tolist()))
        return
    depth = len(shape) - 2
    out("[" * depth)
    first = True
    for lead, start, values in rows:
        if start > 0:
            out(", ")
        else:  # a new slice: close the previous one up to the axis that moved on
            if not first:
                moved = _trailing_zeros(lead)
                out("]" * (moved + 1) + ", " + "[" * moved)
            out("[")
        out(_json_rows(values))
        first = False
    out("]" * (depth + 1))


def _json_rows(values: NDArray[Any]) -> str:
    """Rows as JSON, ``[...], [...]``, numbers as the report writes them: non-finite
    ones as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``."""
    text = json.dumps(values.tolist())
    if values.dtype != np.bool_ and not np.isfinite(values).all():
        text = text.replace("NaN", '"NaN"').replace("Infinity", '"Infinity"')
        text = text.replace('-"Infinity"', '"-Infinity"')
    return text[1:-1]


def _trailing_zeros(lead: Index) -> int:
    n = 0
    for i in reversed(lead):
        if i != 0:
            break
        n += 1
    return n


def _yaml_array(name: str, shape: tuple[int, ...], rows: Iterator[Rows], out: _Out) -> None:
    """``name:`` and its array as PyYAML writes a top-level key's nested lists: block
    sequences (``- - -`` opening a slice's first row, two spaces per axis), each row a
    flow sequence ``[a, b, ...]`` whose lines wrap at :data:`YAML_WIDTH`."""
    if math.prod(shape) == 0:
        out(to_yaml({name: np.zeros(shape).tolist()}))
        return
    depth = len(shape) - 2
    indent = 2 * (depth + 1)  # the rows' flow sequences: where continued lines start
    later = " " * (2 * depth) + "- "  # every row but a slice's first
    out(f"{name}:\n")
    for lead, start, values in rows:
        lines = []
        for i, row in enumerate(_yaml_rows(values)):
            prefix = later
            if i == 0 and start == 0:  # the slice's first row opens the axes that moved on
                moved = max((d for d, x in enumerate(lead) if x != 0), default=0)
                prefix = " " * (2 * moved) + "- " * (depth + 1 - moved)
            lines.append(prefix + _flow(row, indent))
        out("\n".join(lines) + "\n")


def _yaml_rows(values: NDArray[Any]) -> list[str]:
    """Each row's items joined by ``", "``, as PyYAML's SafeRepresenter writes them:
    ``repr`` of the float (``1.0e-05`` for a bare exponent), ``.nan``, ``.inf``,
    ``-.inf``, ``true``, ``false``."""
    text = json.dumps(values.tolist())
    if values.dtype != np.bool_:
        if not np.isfinite(values).all():
            text = text.replace("NaN", ".nan").replace("Infinity", ".inf")
        if "e" in text:
            text = _BARE_EXPONENT.sub(".0e", text)
    return text[2:-2].split("], [")


def _flow(items: str, indent: int) -> str:
    """``[items]`` wrapped as PyYAML's emitter wraps a flow sequence opened at column
    ``indent``: after an item, a comma, then a line break (and ``indent`` spaces) if
    the comma went past :data:`YAML_WIDTH`, else a space."""
    lines = []
    opening, column = "[", indent + 1  # where the first item starts
    if column > YAML_WIDTH:  # the emitter breaks before the first item too
        opening, column = "[\n" + " " * indent, indent
    start = 0
    while True:
        # The items joined by ", " end where each separator starts: break after the
        # first item whose end reaches the width (its comma then passes it).
        cut = items.find(", ", start + YAML_WIDTH - column)
        if cut < 0:
            lines.append(items[start:])
            break
        lines.append(items[start:cut])
        start, column = cut + 2, indent
    return opening + (",\n" + " " * indent).join(lines) + "]"


# --- --save -------------------------------------------------------------------------------

_MEMBER_BYTES = 512
"""A bound on what a member adds to its values: the .npy header (64-byte aligned), the
zip's local header and central directory entry with their zip64 fields."""

_COPY_BYTES = 1 << 20
"""Bytes copied at a time from a temporary file into the .npz."""


def _npz_members(spec: AttentionSpec) -> list[tuple[str, tuple[int, ...], np.dtype[Any]]]:
    """What ``--save`` writes, in order: every stage the options bring about, then
    ``visible``; each name, shape and dtype."""
    f8, b1 = np.dtype(np.float64), np.dtype(np.bool_)
    stages = [(s, _shape(spec, s), f8) for s in applicable_stages(spec)]
    return [*stages, ("visible", spec.weights_shape, b1)]


def npz_bytes(spec: AttentionSpec) -> int:
    """The size of the ``--save`` file, to a few hundred bytes: 8 bytes per value of
    each stage, 1 per score of ``visible``, and the headers."""
    return sum(
        math.prod(shape) * dt.itemsize + _MEMBER_BYTES for _, shape, dt in _npz_members(spec)
    )


def save_room(spec: AttentionSpec) -> int:
    """The disk ``--save`` needs while it writes: the file, and its largest member
    still in a temporary file (each is freed once copied into the file)."""
    largest = max(math.prod(shape) * dt.itemsize for _, shape, dt in _npz_members(spec))
    return npz_bytes(spec) + largest


def check_room(spec: AttentionSpec, path: str) -> None:
    """Refuse, before computing, an ``--save`` file the disk it goes to cannot hold.

    Raises:
        InputError: naming ``path``, with the size needed and the space free.
    """
    folder = os.path.dirname(os.path.abspath(path))
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return  # a missing folder: the write names it
    need = save_room(spec)
    if need > free:
        gib = 2.0**30
        scores = len(_npz_members(spec)) - 2  # less the output and the visibility
        raise InputError(
            os.fspath(path),
            f"needs {need / gib:.1f} GiB of disk while it is written ({scores} stages of "
            f"{spec.weights_shape} in float64, the output and the visibility, one of them "
            f"twice), but {free / gib:.1f} GiB is free on its disk; save it elsewhere, "
            "or slice the inputs",
        )


DOCUMENT_BYTES_PER_NUMBER = 5
"""The least text a number of a document takes: ``0.0`` and its separator ``, ``."""


def check_document_room(spec: AttentionSpec, stages: tuple[str, ...], fmt: str, fd: int) -> None:
    """Refuse, before computing, a JSON or YAML document that cannot fit on the disk of
    the file ``fd`` (stdout sent to a file): its numbers at
    :data:`DOCUMENT_BYTES_PER_NUMBER` bytes each, a lower bound (about 20 is usual).
    Nothing is refused when ``fd`` is not a regular file (a pipe, a terminal).

    Raises:
        InputError: naming stdout, with the size needed and the space free.
    """
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        disk = os.fstatvfs(fd)
    except OSError:
        return
    free = disk.f_bavail * disk.f_frsize
    names = [s for s in applicable_stages(spec) if s in stages]
    need = DOCUMENT_BYTES_PER_NUMBER * sum(math.prod(_shape(spec, s)) for s in names)
    if need > free:
        gib = 2.0**30
        raise InputError(
            "stdout",
            f"the {fmt.upper()} document needs at least {need / gib:.1f} GiB ({len(names)} "
            f"stage(s) of {spec.weights_shape}), but {free / gib:.1f} GiB is free on the "
            "disk of the file it goes to; ask for fewer --stages, or slice the inputs",
        )


def save_npz(
    spec: AttentionSpec, path: str, *, jobs: int = 1, progress: Progress | None = None
) -> None:
    """Write every stage (full shape) and ``visible`` to ``path``, atomically, as
    :func:`~sdpa_cli.report.save_npz` writes a trace kept whole.

    One sweep computes every stage of each block and writes its rows at their place
    in the stage's temporary file beside ``path`` (anonymous: nothing is left, even
    if the process is killed); the temporary files are then copied, one by one, into
    the .npz's members. Writing twice costs less than computing each stage again.

    Args:
        spec: the computation.
        path: the .npz file; it appears whole or not at all.
        jobs: threads computing blocks.
        progress: told the scores done after each block.
    """
    members = _npz_members(spec)
    folder = os.path.dirname(os.path.abspath(path))

    def write(fh: BinaryIO) -> None:
        with contextlib.ExitStack() as stack:
            temps = {
                name: stack.enter_context(tempfile.TemporaryFile(dir=folder))
                for name, shape, _ in members
                if math.prod(shape) > 0
            }
            _fill(spec, {name: t.fileno() for name, t in temps.items()}, jobs, progress)
            # np.savez's layout: stored (uncompressed) members, zip64 forced on each.
            with zipfile.ZipFile(fh, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
                for name, shape, dt in members:
                    with zf.open(f"{name}.npy", "w", force_zip64=True) as member:
                        header = {"descr": np.lib.format.dtype_to_descr(dt), "fortran_order": False}
                        np.lib.format.write_array_header_1_0(member, {**header, "shape": shape})
                        temp = temps.pop(name, None)
                        if temp is not None:
                            _copy(spec, name, temp, member)
                            temp.close()  # its disk is freed as the .npz grows

    write_atomic(path, write)


def _fill(spec: AttentionSpec, fds: dict[str, int], jobs: int, progress: Progress | None) -> None:
    """One sweep over every key: each block's rows of each stage (and ``visible``) at
    their offset in the file ``fds[name]``, in the engine's layout ``(*lead, L, ...)``.
    The threads write their own blocks, so nothing waits for the order."""
    if not fds:
        return

    def visit(place: Place) -> None:
        block = place.attend(spec)
        first = 0  # the block's first row, counted over every slice before it
        for i, n in zip(place.lead, spec.lead, strict=True):
            first = first * n + i
        first = first * spec.L + place.rows.start
        for name, fd in fds.items():
            values = block.visible if name == "visible" else getattr(block, name)
            dt = np.bool_ if name == "visible" else np.float64
            data: NDArray[Any] = np.ascontiguousarray(values, dtype=dt)
            _pwrite_all(fd, data.data.cast("B"), first * data[0].nbytes)

    for _ in sweep(spec, visit, jobs=jobs, keys="all", progress=progress):
        pass


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _copy(spec: AttentionSpec, name: str, temp: IO[bytes], member: IO[bytes]) -> None:
    """A stage's temporary file into its member; the output with its heads merged,
    ``(..., L, heads · Ev)`` under ``--heads``, ``(..., L, H, Ev)`` under ``--layout
    bshd`` (the same bytes; a slice of the leading axes at a time)."""
    temp.seek(0)
    if name != "output" or not spec.output_rearranged:
        shutil.copyfileobj(temp, member, _COPY_BYTES)
        return
    heads = spec.lead[-1]
    per_slice = heads * spec.L * spec.Ev
    for _ in range(math.prod(spec.lead[:-1])):
        parts = np.frombuffer(temp.read(8 * per_slice), np.float64)
        merged = np.moveaxis(parts.reshape(heads, spec.L, spec.Ev), 0, 1)
        member.write(np.ascontiguousarray(merged).data)
