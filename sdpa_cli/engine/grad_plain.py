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

dK and dV are summed over the row blocks (and a group's query heads) in the
accumulator before they are stored. Pure numpy; a slice at a time, rows in blocks,
so nothing score-sized outlives a block.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from sdpa_cli.engine import precision
from sdpa_cli.engine.block import Arithmetic, attend_block, dropout_keep, operands
from sdpa_cli.engine.driver import block_rows
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import F64, Index
from sdpa_cli.errors import SpecError


def plain_backward(spec: AttentionSpec, dout: F64) -> dict[str, F64]:
    """dQ, dK and dV (the engine's layout: shaped like ``spec.q``, ``spec.k``,
    ``spec.v``) of ``Σ O ⊙ dO`` as a kernel in ``spec.options.dtype`` computes them
    plainly; ``dout`` in the engine's layout ``(*lead, L, Ev)``.

    Raises:
        SpecError: for the options whose plain backward is not written here (a
            softcap, sinks, a bias's gradient, --score-mod).
    """
    o = spec.options
    for given, flag in (
        (o.softcap, "--softcap"),
        (spec.sinks, "--sinks"),
        (o.score_mod, "--score-mod"),
    ):
        if given is not None:
            raise SpecError(flag, "has no plain backward computation here yet")
    ar = Arithmetic.of(spec, emulate=True)
    acc = ar.accumulate
    dq = np.zeros(spec.q.shape)
    dk_sum = np.zeros(spec.k.shape)  # the accumulator's running sums, stored in D at the end
    dv_sum = np.zeros(spec.v.shape)
    for lead in np.ndindex(*spec.lead):
        at: Index = tuple(int(i) for i in lead)
        ops = operands(spec, at, emulate=True)
        q_all = ar.r(np.asarray(spec.q[spec.operand_index("q", at)], dtype=np.float64))
        k_at, v_at = spec.operand_index("k", at), spec.operand_index("v", at)
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
                dv_sum[v_at] += precision.matmul(p_used.T, d_o, acc)
                ds = ar.r(_softmax_backward(p, da, ar.softmax))
                if not block.all_visible:
                    ds = np.where(block.unreplaced, ds, 0.0)
                f = spec.factor
                dq[spec.operand_index("q", at)][rows] = ar.r(
                    precision.round_to(precision.matmul(ds, ops.k, acc) * f, acc)
                )
                dk_sum[k_at] += precision.matmul(ds.T, q_all[rows], acc) * f
            dk_sum[k_at] = precision.round_to(dk_sum[k_at], acc)
            dv_sum[v_at] = precision.round_to(dv_sum[v_at], acc)
    return {"dq": dq, "dk": ar.r(dk_sum), "dv": ar.r(dv_sum)}


def _row_blocks(spec: AttentionSpec) -> Iterator[slice]:
    step = block_rows(spec)
    for i0 in range(0, spec.L, step):
        yield slice(i0, min(i0 + step, spec.L))


def _softmax_backward(p: F64, da: F64, softmax: str) -> F64:
    """P ⊙ (dA − rowsum(dA ⊙ P)) in the format ``softmax`` (float32: the row sum
    accumulated and the result stored in it)."""
    total = precision.round_to(np.einsum("ij,ij->i", da, p), softmax)
    return precision.round_to(p * precision.round_to(da - total[:, None], softmax), softmax)
