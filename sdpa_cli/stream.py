"""Documents written as they are computed: ``sdpa compute --format json|yaml`` stage
by stage and block by block, and ``sdpa grad``'s with its gradients a piece at a time.

:func:`~sdpa_cli.report.payload` builds the document in memory, every number a Python
object (about 90 bytes each). Here the statistics come from a trace that kept nothing
score-sized, and each stage is computed again with the block driver, one sweep per
stage, its rows written as each block comes: memory stays a few blocks, whatever the
output's size. The text is byte for byte ``to_json(payload(...))`` or
``to_yaml(payload(...))``: JSON's rows are ``json.dumps`` of each block; YAML's arrays
are laid out as PyYAML's emitter lays them out (block sequences down to the rows, each
row a flow sequence wrapped past column 100), the head and tail dumped by PyYAML.
``--save`` is :mod:`sdpa_cli.stream_save`'s.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.diagnosis.findings import Diagnosis
from sdpa_cli.engine.block import applicable_stages, visible_keys
from sdpa_cli.engine.driver import KeyMode, Place, Progress, sweep
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.trace import Trace
from sdpa_cli.engine.types import Index
from sdpa_cli.errors import InputError
from sdpa_cli.report import diagnosis_payload, setup_payload, to_json, to_yaml
from sdpa_cli.stream_save import stage_shape

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
        n for n in arrays if math.prod(stage_shape(spec, n)) > 0 and (n != "output" or kept is None)
    ]
    tell = _shared(progress, len(swept))
    out(to_json(head)[:-1] if for_json else to_yaml(head))
    for name in arrays:
        shape = stage_shape(spec, name)
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


def write_with_arrays(
    data: dict[str, Any],
    key: str,
    arrays: dict[str, NDArray[Any]],
    write: Write,
    *,
    fmt: str,
) -> None:
    """Write ``data`` with ``data[key]`` set to ``arrays`` (name → array), as
    ``to_json(...) + "\n"`` or ``to_yaml(...)`` would, the arrays' rows formatted a
    piece at a time: a few MiB of text in hand, where nested lists of Python floats
    cost about 80 bytes a number for JSON and 400 for PyYAML.

    ``data`` holds the other keys (``data[key]`` itself is not read).
    """
    names = list(data)
    at = names.index(key)
    head = {n: data[n] for n in names[:at]}
    tail = {n: data[n] for n in names[at + 1 :]}
    out = _Out(write)
    if fmt == "json":
        out(to_json(head)[:-1] + ", " if head else "{")
        out(f"{json.dumps(key)}: {{")
        for i, (name, values) in enumerate(arrays.items()):
            out(f"{', ' if i else ''}{json.dumps(name)}: ")
            if values.ndim < 2:  # one row: [...], non-finite numbers as strings
                out(_json_rows(values.reshape(1, -1)))
            else:
                _json_array(values.shape, _pieces(values), out)
        out("}" + (", " + to_json(tail)[1:] if tail else "}") + "\n")
    else:
        # dumped beside a stand-in for the arrays: a mapping of scalars alone would
        # be written in flow style, {a: 1}, where the whole document's is block
        stand_in = f"{key}:\n- [0]\n"
        text = to_yaml({**head, key: [[0]]})
        assert text.endswith(stand_in)
        out(text[: -len(stand_in)] + f"{key}:\n")
        for name, values in arrays.items():
            if values.ndim < 2:
                out(_indented(to_yaml({name: values.tolist()}), 2))
            else:
                _yaml_array(name, values.shape, _pieces(values), out, margin=2)
        text = to_yaml({key: [[0]], **tail})
        assert text.startswith(stand_in)
        out(text[len(stand_in) :])
    out.flush()


def _indented(text: str, margin: int) -> str:
    """Every line of ``text`` moved ``margin`` columns right."""
    pad = " " * margin
    return "".join(pad + line for line in text.splitlines(keepends=True))


def trace_stages(spec: AttentionSpec, stages: tuple[str, ...]) -> tuple[str, ...]:
    """What the trace given to :func:`write_document` should keep whole for
    ``stages``: the output when it is the only stage written (output-sized: the
    document then holds the output of the pass that gathered the statistics, as a
    trace keeping it would); nothing otherwise, every stage being computed again."""
    names = [s for s in applicable_stages(spec) if s in stages]
    return ("output",) if names == ["output"] else ()


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
    if math.prod(stage_shape(spec, name)) == 0:
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


def _yaml_array(
    name: str, shape: tuple[int, ...], rows: Iterator[Rows], out: _Out, *, margin: int = 0
) -> None:
    """``name:`` and its array as PyYAML writes a key's nested lists: block sequences
    (``- - -`` opening a slice's first row, two spaces per axis), each row a flow
    sequence ``[a, b, ...]`` whose lines wrap at :data:`YAML_WIDTH`; ``margin`` columns
    to the right for a key of a nested mapping."""
    if math.prod(shape) == 0:
        out(_indented(to_yaml({name: np.zeros(shape).tolist()}), margin))
        return
    depth = len(shape) - 2
    indent = margin + 2 * (depth + 1)  # the rows' flow sequences: where lines go on
    pad = " " * margin
    later = pad + " " * (2 * depth) + "- "  # every row but a slice's first
    out(f"{pad}{name}:\n")
    for lead, start, values in rows:
        lines = []
        for i, row in enumerate(_yaml_rows(values)):
            prefix = later
            if i == 0 and start == 0:  # the slice's first row opens the axes that moved on
                moved = max((d for d, x in enumerate(lead) if x != 0), default=0)
                prefix = pad + " " * (2 * moved) + "- " * (depth + 1 - moved)
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
    need = DOCUMENT_BYTES_PER_NUMBER * sum(math.prod(stage_shape(spec, s)) for s in names)
    if need > free:
        gib = 2.0**30
        raise InputError(
            "stdout",
            f"the {fmt.upper()} document needs at least {need / gib:.1f} GiB ({len(names)} "
            f"stage(s) of {spec.weights_shape}), but {free / gib:.1f} GiB is free on the "
            "disk of the file it goes to; ask for fewer --stages, or slice the inputs",
        )
