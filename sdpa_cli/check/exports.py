"""Exported tensors and what they are compared with: the files loaded, the layouts an
export may have and its fitting into the computation's, the export's format, the reference and naive
runs, and a run's value of each export (the LSE read off the softmax)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.check.records import Expected
from sdpa_cli.engine import positions, precision
from sdpa_cli.engine.block import softmax_lse
from sdpa_cli.engine.grad import OPERAND
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.stats import input_dtypes
from sdpa_cli.engine.trace import Trace, merge_heads, split_heads_of_output
from sdpa_cli.engine.types import F64, Index
from sdpa_cli.errors import SpecError
from sdpa_cli.files.loaders import load_array
from sdpa_cli.text import printable

RUN_STAGES = ("masked", "weights", "output")
"""The stages a check compares against: the LSE comes from the masked logits."""

EXPORT_STAGES = {"output": ("output",), "weights": ("weights",), "lse": ("masked", "weights")}
"""The stages :func:`tensor_values` reads for each export."""


# --- files and layouts ------------------------------------------------------------------


def load_expected(paths: Mapping[str, str | None]) -> list[Expected]:
    """``{"output": "out.npy", ...}`` → the exported tensors, loaded (not cast)."""
    return [
        Expected(name, load_array(path, name=name), printable(path))
        for name, path in paths.items()
        if path is not None
    ]


def expected_shapes(spec: AttentionSpec, name: str) -> tuple[tuple[int, ...], ...]:
    """The layouts accepted for an exported ``name``: the computation's, and for the
    output under ``--heads`` the merged ``(..., L, heads·Ev)`` as well; under
    ``--layout bshd`` the output's ``(..., L, H, Ev)`` alone (the weights and the LSE
    keep the scores' layout, as FlashAttention returns them)."""
    if name == "weights":
        return (spec.weights_shape,)
    if name == "lse":
        return ((*spec.lead, spec.L),)
    if spec.options.heads is not None:
        return (spec.merged_output_shape, spec.output_shape)
    return (spec.merged_output_shape,)


def strip_ones(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` without its leading 1s (but its last axis)."""
    i = 0
    while i < len(shape) - 1 and shape[i] == 1:
        i += 1
    return shape[i:]


@dataclass(frozen=True)
class Fitted:
    """An export in the computation's layout (in its own dtype)."""

    exp: Expected
    values: F64
    merged: bool
    """An output in the layout it is returned in, other than the engine's: merged
    ``(..., L, heads·Ev)`` under ``--heads``, ``(..., L, H, Ev)`` under ``--layout bshd``."""


def fit_expected(spec: AttentionSpec, exp: Expected) -> Fitted:
    """The export as float64 in one of :func:`expected_shapes` (leading 1s may differ).

    Raises:
        SpecError: naming the file, when no layout fits.
    """
    got = tuple(exp.values.shape)
    for shape in expected_shapes(spec, exp.name):
        if got == shape or strip_ones(got) == strip_ones(shape):
            values = np.asarray(exp.values).reshape(shape)  # read (as float64) chunk by chunk
            merged = (
                exp.name == "output"
                and spec.output_rearranged
                and shape == spec.merged_output_shape
            )
            return Fitted(exp, values, merged)
    want = " or ".join(str(s) for s in expected_shapes(spec, exp.name))
    raise SpecError(
        exp.label,
        f"has shape {got}; the computation's {exp.name} is {want}{layout_hint(spec, exp.name, got)}",
    )


def layout_hint(spec: AttentionSpec, name: str, got: tuple[int, ...]) -> str:
    """Where an export's shape (the output, the LSE, a gradient) is the computation's
    with the head and query axes swapped: the words that say so (a (B, L, H, E) file
    beside (B, H, L, E) inputs, or the other way round), else ``""``."""
    if spec.options.heads is not None:
        return ""
    if OPERAND.get(name) in ("q", "k", "v"):  # a gradient: shaped as its input's file
        shape = tuple(spec.shapes.get(OPERAND[name], ()))
    elif name in ("output", "lse"):
        shape = spec.merged_output_shape if spec.output_rearranged else spec.output_shape
        if name == "lse":
            shape = (*spec.lead, spec.L)
    else:
        return ""
    if len(shape) < 3 or len(got) != len(shape):
        return ""
    axes = (-2, -1) if name == "lse" else (-3, -2)
    swapped = list(shape)
    swapped[axes[0]], swapped[axes[1]] = swapped[axes[1]], swapped[axes[0]]
    if got != tuple(swapped) or got == shape:
        return ""
    if name == "lse":
        return "; it looks saved as (B, L, H): swap its last two axes"
    if spec.options.layout == "bshd":
        return (
            "; it looks saved as (B, H, L, E) while --layout bshd reads Q, K and V as "
            "(B, L, H, E): swap its axes 1 and 2, or give every tensor one layout"
        )
    return (
        "; it looks saved as (B, L, H, E) (FlashAttention's layout): swap its axes 1 "
        "and 2, or, if Q, K and V are so too, pass --layout bshd"
    )


def merged_index(spec: AttentionSpec, at: Index) -> Index:
    """An index into the engine's output ``(..., H, L, Ev)`` as an index into the
    layout the file has: merged ``(..., L, heads·Ev)`` under ``--heads``,
    ``(..., L, H, Ev)`` under ``--layout bshd``."""
    *lead, h, i, c = at
    if spec.options.heads is None:
        return (*lead, i, h, c)
    return (*lead, i, h * spec.Ev + c)


def engine_layout(spec: AttentionSpec, name: str, loaded: NDArray[Any]) -> NDArray[Any]:
    """Operand ``name``'s values (or its gradient's) as loaded, in the engine's layout
    (:meth:`~sdpa_cli.engine.spec.AttentionSpec.as_loaded` undone): the heads split
    again under ``--heads``, ``(..., H, L, E)`` under ``--layout bshd``. A view where
    the file's array is contiguous."""
    arr = np.asarray(loaded)
    if name in ("q", "k", "v") and arr.ndim >= 2:
        if spec.options.heads is not None:
            split = arr.reshape(*arr.shape[:-1], spec.options.heads, -1)
            arr = np.moveaxis(split, -2, -3)
        elif spec.options.layout == "bshd" and arr.ndim >= 3:
            arr = np.swapaxes(arr, -3, -2)
    return arr.reshape(getattr(spec, name).shape)


def loaded_index(spec: AttentionSpec, name: str, at: Index) -> Index:
    """An index into operand ``name`` (or its gradient) in the engine's layout as an
    index into the file's (:func:`engine_layout` undone)."""
    shape = getattr(spec, name).shape
    index, merged = tuple(at), tuple(shape)
    if name in ("q", "k", "v") and len(at) >= 3:
        *lead, h, i, c = at
        *outer, heads, rows, e = shape
        if spec.options.heads is not None:
            index, merged = (*lead, i, h * e + c), (*outer, rows, heads * e)
        elif spec.options.layout == "bshd":
            index, merged = (*lead, i, h, c), (*outer, rows, heads, e)
    loaded = tuple(spec.shapes.get(name, merged))
    if loaded == merged:
        return index
    flat = int(np.ravel_multi_index(index, merged))
    return tuple(int(x) for x in np.unravel_index(flat, loaded))


# --- the runs compared with -------------------------------------------------------------


def output_of(spec: AttentionSpec, expected: Sequence[Expected]) -> F64 | None:
    """The exported output in the computation's layout ``(*lead, L, Ev)`` (heads split
    under ``--heads``), fitted as the check fits it; None without one."""
    found = next((e for e in expected if e.name == "output"), None)
    if found is None:
        return None
    fitted = fit_expected(spec, found)
    return split_heads_of_output(spec, fitted.values) if fitted.merged else fitted.values


def export_dtype(spec: AttentionSpec, expected: list[Expected]) -> str:
    """The format the export was computed in: ``--dtype`` when given, otherwise the
    narrowest of the exported files' and the inputs' dtypes (float64 when all are)."""
    if spec.options.emulated:
        return spec.options.dtype
    names = {str(e.values.dtype) for e in expected} | set(input_dtypes(spec))
    if spec.descale is not None:  # Q, K, V are FP8 values, held dequantized in float64
        names.add(spec.descale.fmt)
    return next((d for d in reversed(precision.FORMATS) if d in names), "float64")


def as_reference(spec: AttentionSpec, fmt: str) -> AttentionSpec:
    """``spec`` with every step in the reference format ``fmt``."""
    options = dataclasses.replace(
        spec.options, dtype=fmt, accumulate=fmt, softmax_dtype=fmt, logits_dtype=fmt
    )
    return dataclasses.replace(spec, options=options)


def as_seen_by_kernel(spec: AttentionSpec, export: str) -> AttentionSpec:
    """``spec`` with Q, K and V rounded to the export's format where they are stored
    wider: a kernel that computed in float16 saw float16 inputs, and a reference
    from the unrounded ones would charge it with their rounding (PyTorch's kernel
    tests build the reference from the low-precision inputs too). A bias and a
    mask keep their own dtype."""
    if spec.descale is not None:  # FP8 values with descales: rounded at the entry already
        return spec
    target = precision.numpy_dtype(export)
    order = precision.FORMATS.index

    def seen(x: NDArray[Any]) -> NDArray[Any]:
        name = str(x.dtype)
        if name not in precision.FORMATS or order(name) >= order(export):
            return x
        with np.errstate(over="ignore", invalid="ignore"):
            return np.asarray(x).astype(target)

    q, k, v = seen(spec.q), seen(spec.k), seen(spec.v)
    if q is spec.q and k is spec.k and v is spec.v:
        return spec
    return dataclasses.replace(spec, q=q, k=k, v=v)


def as_naive(spec: AttentionSpec, dtype: str) -> AttentionSpec:
    """``spec`` run naively in the export's format: the user's ``--accumulate`` and
    friends when ``--dtype`` is that format, a kernel's defaults otherwise."""
    o = spec.options
    if o.dtype == dtype:
        return spec
    options = dataclasses.replace(
        o, dtype=dtype, accumulate="float32", softmax_dtype="float32", logits_dtype=dtype
    )
    return dataclasses.replace(spec, options=options)


# --- a run's values of an export --------------------------------------------------------


def tensor_values(run: Trace, name: str, merged: bool = False) -> F64:
    """What a run computed for the export ``name``: the output (merged under
    ``--heads`` when the file is), the weights, or the LSE of the masked logits."""
    if name == "lse":
        assert run.masked is not None
        assert run.weights is not None
        return softmax_lse(run.masked, run.weights)
    values = run.stage(name)
    assert values is not None
    return merge_heads(run.spec, values) if name == "output" and merged else values


def absent_from_reference(spec: AttentionSpec, fitted: Fitted, reference: F64) -> Fitted:
    """The export with the rows past ``--query-lengths`` taken from the reference: those
    rows are absent, so whatever a kernel leaves there (zeros, padding, NaN) is not
    compared."""
    if spec.options.query_lengths is None:
        return fitted
    absent = positions.absent_rows(spec)  # (*lead, L)
    if fitted.exp.name == "output" and fitted.merged:
        # merged heads (..., L, heads·Ev) or bshd (..., L, H, Ev): one row for every head
        absent = absent[..., 0, :] if spec.options.heads is not None else absent.swapaxes(-1, -2)
    if fitted.exp.name != "lse":
        absent = absent[..., None]
    values = np.where(absent, np.asarray(reference), np.asarray(fitted.values))
    return dataclasses.replace(fitted, values=values)
