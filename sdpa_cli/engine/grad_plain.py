"""The backward pass as a kernel in a narrow format computes it plainly: the yardstick of
exported gradients, as the plain forward computation is the output's.

With the spec's ``--dtype`` D (float16, bfloat16, float32): the forward block as the
emulation computes it (:func:`~sdpa_cli.engine.block.attend_block`: inputs, logits
and weights stored in D, the softmax in float32), dO rounded to D, then each product
of the backward pass accumulated in ``--accumulate`` (float32) and stored in D, as
PyTorch's math backward (autograd over its eager ops) does:

    dV = round(Pᵀ · dO)            dA = round(dO · Vᵀ)
    dS = round(P ⊙ (dA − rowsum(dA ⊙ P)))       in --softmax-dtype, then stored in D
    dQ = round(dS · K · f)         dK = round(dSᵀ · Q · f)

dK, dV, d(bias) and d(sinks) are summed over the row blocks (and a group's query heads)
in the accumulator before they are stored. Pure numpy; a slice at a time, rows in blocks,
so nothing score-sized outlives a block.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine import precision
from sdpa_cli.engine.block import Arithmetic, attend_block, dropout_keep, operands, sink_head
from sdpa_cli.engine.driver import block_rows
from sdpa_cli.engine.fp8 import runs_fp8
from sdpa_cli.engine.grad import OPERAND
from sdpa_cli.engine.grad_block import add_bias_gradient, bias_gradient
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import F64, Index
from sdpa_cli.errors import SpecError


class PlainSlice(NamedTuple):
    """One finished slice of a gradient of :func:`plain_slices`: its name, its index in
    the operand's leading axes (``()`` for d(bias) and d(sinks), handed over whole),
    its values in the format, and the magnitudes of the terms each value is summed
    from (dQ's: Σ_j |dS_ij| · |K_j| · f with |dS| bounded by P ⊙ (|dA| + |D|), so that
    dS's own cancellation counts; dV's: Σ_i P_ij · |dO_i|): the scale of the rounding
    any order of the sums makes, which cancellation hides from the value itself."""

    name: str
    at: Index
    values: NDArray[np.floating[Any]]
    terms: NDArray[np.float32]


def plain_backward(spec: AttentionSpec, dout: F64) -> dict[str, NDArray[np.floating[Any]]]:
    """dQ, dK and dV (the engine's layout: shaped like ``spec.q``, ``spec.k``,
    ``spec.v``), and d(bias) and d(sinks) when the computation has them, of
    ``Σ O ⊙ dO`` as a kernel in ``spec.options.dtype`` computes them plainly
    (:func:`plain_slices`, gathered whole), by name."""
    values: dict[str, NDArray[np.floating[Any]]] = {}
    shapes = {n: getattr(spec, OPERAND[n]).shape for n in ("dq", "dk", "dv")}
    for part in plain_slices(spec, dout):
        if part.name not in shapes:  # d(bias), d(sinks): whole
            values[part.name] = part.values
            continue
        if part.name not in values:
            values[part.name] = np.zeros(shapes[part.name], part.values.dtype)
        values[part.name][part.at] = part.values
    return values


def plain_slices(
    spec: AttentionSpec, dout: F64, *, leads: Sequence[Index] | None = None
) -> Iterator[PlainSlice]:
    """The plain backward pass over the query slices ``leads`` (positions of
    ``spec.lead``, in order; None: all of them), each slice of dQ, dK and dV handed over when it is
    finished (after the last query slice that reads it: a K/V head after its group's
    last query head), then d(bias) and d(sinks) whole; ``dout`` in the engine's layout
    ``(*lead, L, Ev)``. A softcap's chain rule stores dS · (1 − tanh²) in the format; a
    sink's d(logit) is −p_sink · Σ_j P_j dA_j. Nothing the size of a gradient is kept
    but d(bias).

    Raises:
        SpecError: for --score-mod, whose derivative would need autodiff.
    """
    o = spec.options
    if o.score_mod is not None:
        raise SpecError("--score-mod", "has no backward pass here; use it with compute")
    if runs_fp8(spec):  # FlashAttention-3's FP8 kernels are forward only
        raise SpecError(
            "--dtype",
            "FP8 with descales has no backward kernel to emulate; judge gradients with "
            "--dtype bfloat16 or wider (the descales still dequantize)",
        )
    ar = Arithmetic.of(spec, emulate=True)
    acc = ar.accumulate
    # Held in the accumulator's format when it is float32 (every value of the sums and
    # of the format is one): half the memory of float64, the same numbers.
    held = np.float32 if acc == "float32" else np.float64
    leads = list(leads) if leads is not None else list(_all_leads(spec))
    last = _last_readers(spec, leads)
    # the accumulator's running sums of the slices being summed, stored in the format
    # when finished; with their terms' magnitudes (float32 is precision enough)
    open_: dict[tuple[str, Index], tuple[NDArray[Any], NDArray[np.float32]]] = {}
    whole: dict[str, NDArray[Any]] = {}
    if spec.bias is not None:
        whole["dbias"] = np.zeros(spec.bias.shape, held)
        whole["dbias terms"] = np.zeros(spec.bias.shape, np.float32)
    if spec.sinks is not None:
        whole["dsinks"] = np.zeros(spec.sinks.shape, held)
        whole["dsinks terms"] = np.zeros(spec.sinks.shape, np.float32)
    f = spec.factor
    for at in leads:
        ops = operands(spec, at, emulate=True)
        q_all = ar.r(np.asarray(spec.q[spec.operand_index("q", at)], dtype=np.float64))
        sums = {}
        for name in ("dq", "dk", "dv"):
            key = (name, spec.operand_index(OPERAND[name], at))
            if key not in open_:
                shape = getattr(spec, OPERAND[name]).shape[-2:]
                open_[key] = (np.zeros(shape, held), np.zeros(shape, np.float32))
            sums[name] = open_[key]
        for rows in _row_blocks(spec):
            block = attend_block(spec, at, rows, emulate=True, inputs=ops)
            p = np.asarray(block.weights, np.float64)
            d_o = ar.r(np.asarray(dout[at][rows], np.float64))
            with np.errstate(over="ignore", invalid="ignore", under="ignore"):
                if o.dropout > 0:
                    keep = dropout_keep(spec, at, rows, block.keys) / (1.0 - o.dropout)
                    p_used = ar.r(p * keep)
                    da = ar.r(precision.matmul(d_o, ops.v.T, acc) * keep)
                else:
                    p_used = p
                    da = ar.r(precision.matmul(d_o, ops.v.T, acc))
                sums["dv"][0][...] += precision.matmul(p_used.T, d_o, acc)
                sums["dv"][1][...] += np.abs(p_used).T @ np.abs(d_o)
                total = np.einsum("ij,ij->i", p, da)  # Σ P ⊙ dA per row: D
                ds = ar.r(_softmax_backward(p, da, total, ar.softmax))
                # |dS| bounded over its own cancellation: P ⊙ (|dA| + |D|)
                ds_terms = np.abs(p) * (np.abs(da) + np.abs(total)[:, None])
                if not block.all_visible:
                    ds = np.where(block.unreplaced, ds, 0.0)
                if "dsinks" in whole and block.sink is not None:
                    sink = np.asarray(block.sink)
                    whole["dsinks"][sink_head(spec, at)] -= float(np.sum(sink * total))
                    magnitude = np.abs(sink) * np.abs(p * da).sum(axis=1)  # D's terms
                    whole["dsinks terms"][sink_head(spec, at)] += float(np.sum(magnitude))
                if "dbias" in whole:
                    keys = slice(0, spec.S)
                    for into, part in (("dbias", ds), ("dbias terms", ds_terms)):
                        summed = bias_gradient(spec, part)
                        assert summed is not None  # the computation has a bias
                        add_bias_gradient(spec, whole[into], at, rows, keys, summed)
                dscaled = ds
                if o.softcap is not None:
                    t = np.tanh(np.asarray(block.scaled, np.float64) / o.softcap)
                    dscaled = ar.r(ds * (1.0 - t * t))
                    ds_terms = ds_terms * (1.0 - t * t)
                sums["dq"][0][rows] += precision.matmul(dscaled, ops.k, acc) * f
                sums["dk"][0][...] += precision.matmul(dscaled.T, q_all[rows], acc) * f
                sums["dq"][1][rows] += ds_terms @ np.abs(ops.k) * f
                sums["dk"][1][...] += ds_terms.T @ np.abs(q_all[rows]) * f
            if held is np.float64:  # float32 holds its sums rounded already
                for values, _ in sums.values():
                    values[...] = precision.round_to(values, acc)
                for name in ("dbias", "dsinks"):
                    if name in whole:
                        whole[name] = precision.round_to(whole[name], acc)
        for name in ("dq", "dk", "dv"):
            key = (name, spec.operand_index(OPERAND[name], at))
            if last[key] == at:
                values, terms = open_.pop(key)
                yield PlainSlice(name, key[1], np.asarray(ar.r(values), held), terms)
    for name in ("dbias", "dsinks"):
        if name in whole:
            values = np.asarray(ar.r(whole[name]), held)
            yield PlainSlice(name, (), values, whole[f"{name} terms"])


def _all_leads(spec: AttentionSpec) -> Iterator[Index]:
    for lead in np.ndindex(*spec.lead):
        yield tuple(int(i) for i in lead)


def _last_readers(spec: AttentionSpec, leads: Sequence[Index]) -> dict[tuple[str, Index], Index]:
    """For each slice of dQ, dK and dV, the last of ``leads`` that reads it."""
    last: dict[tuple[str, Index], Index] = {}
    for at in leads:
        for name in ("dq", "dk", "dv"):
            last[(name, spec.operand_index(OPERAND[name], at))] = at
    return last


PLAIN_ELEMENTS = 1 << 18
"""Scores per block of the plain backward: the emulated block keeps about ten
score-sized float64 arrays (its stages, dA, dS and their magnitudes), 2 MiB each."""


def _row_blocks(spec: AttentionSpec) -> Iterator[slice]:
    step = block_rows(spec, PLAIN_ELEMENTS)
    for i0 in range(0, spec.L, step):
        yield slice(i0, min(i0 + step, spec.L))


def _softmax_backward(p: F64, da: F64, total: F64, softmax: str) -> F64:
    """P ⊙ (dA − D), D = ``total`` = rowsum(dA ⊙ P), in the format ``softmax``
    (float32: the row sum accumulated and the result stored in it)."""
    d = precision.round_to(total, softmax)
    return precision.round_to(p * precision.round_to(da - d[:, None], softmax), softmax)
