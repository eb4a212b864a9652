"""One block of the backward pass (:mod:`sdpa_cli.engine.grad` has the formulas):
the per-stage block, every option, and the lean block, which takes the weights from
the lean forward pass (:mod:`sdpa_cli.engine.online`) where that pass applies.

The lean block is what ``sdpa grad`` runs on the common computation: the weights
come from one pass over the block's keys (the scale folded into Q, the statistics
read from the softmax), dS is formed in place, and the per-row records are read
from what the forward pass already knows. Options it does not take run the
per-stage block, which says where; both give the same numbers to rounding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine import online, precision
from sdpa_cli.engine.arrays import scratch
from sdpa_cli.engine.block import (
    Operands,
    attend_block,
    dropout_keep,
    full_keys,
    operands,
    visibility,
)
from sdpa_cli.engine.driver import Place
from sdpa_cli.engine.grad_health import NORM_SLICES as NORM_SLICES
from sdpa_cli.engine.grad_health import HealthBlock, HealthRecords, read_health
from sdpa_cli.engine.grad_health import norm as norm
from sdpa_cli.engine.grad_health import row_norm as row_norm
from sdpa_cli.engine.records import Records
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import F64, Index

if TYPE_CHECKING:
    from sdpa_cli.engine.stats import Stats


@dataclass(frozen=True)
class BlockGrad(HealthRecords):
    """One block's share of the gradients, and its rows' and keys' records.

    ``dk``/``dv`` cover the block's keys ``keys``; ``dbias`` is the block's
    d(logits) summed over the axes the bias broadcasts along (None without a bias).
    """

    lead_index: Index
    rows: slice
    keys: slice
    dq: F64
    dk: F64
    dv: F64
    dbias: F64 | None
    health: Mapping[str, NDArray[Any]]
    """Every record of :data:`~sdpa_cli.engine.grad_health.GRAD_RECORDS`: per row of
    the block, or per key of ``keys``."""
    records: Records | None = None
    """The forward pass's statistics of the block, when asked for."""
    dsinks: F64 | None = None
    """With ``--sinks``: each row's d(sink logit), p_sink · (0 − Σ_j A_j dA_j) ``(rows,)``."""
    steps: Mapping[str, F64] | None = None
    """With ``keep_steps``: ``scaled`` (the forward logits), ``d_weights`` (dA),
    ``d_scores`` (dS) and ``d_scaled`` (dS through the softcap), each ``(rows, keys)``."""


def backward_block(
    spec: AttentionSpec,
    lead_index: Index,
    rows: slice,
    dout: F64,
    *,
    keys: slice | None = None,
    inputs: Operands | None = None,
    stats: Stats | None = None,
    keep_steps: bool = False,
) -> BlockGrad:
    """The gradients of ``Σ O ⊙ dO`` from query rows ``rows`` of one slice, in float64.

    Args:
        dout: dO of the block's rows, ``(rows, Ev)``.
        keys: the keys to compute (default all); hidden keys get no gradient.
        inputs: the slice's K and V in float64 (:func:`~sdpa_cli.engine.block.operands`).
        stats: gathers the forward pass's statistics of the block (for the forward
            findings), as :func:`~sdpa_cli.engine.trace.trace` does.
        keep_steps: also return the intermediate score-shaped steps (``explain``).
    """
    o = spec.options
    keys = keys if keys is not None else full_keys(spec)
    if inputs is None:
        inputs = operands(spec, lead_index, emulate=False)
    block = attend_block(spec, lead_index, rows, emulate=False, keys=keys, inputs=inputs)
    records = stats.measure(block, block) if stats is not None else None
    q = np.asarray(spec.q[spec.operand_index("q", lead_index)][rows], dtype=np.float64)
    k, v = inputs.k[keys], inputs.v[keys]
    a = block.weights
    factor = spec.factor

    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        if o.dropout > 0:
            kept = dropout_keep(spec, lead_index, rows, keys) / (1.0 - o.dropout)
            assert block.dropped is not None
            dv = block.dropped.T @ dout
            da = (dout @ v.T) * kept
        else:
            dv = a.T @ dout
            da = dout @ v.T
        dsinks = None
        if block.sink is None:
            ds, top = softmax_backward(a, da)
        else:
            # The sink is one more column of the softmax, which V does not read (dA = 0).
            ext, _ = softmax_backward(
                np.concatenate([a, block.sink[:, None]], axis=1),
                np.concatenate([da, np.zeros((da.shape[0], 1))], axis=1),
            )
            ds, dsinks = ext[:, :-1], ext[:, -1]
            top = a.argmax(axis=1) if a.shape[1] else np.zeros(a.shape[0], np.intp)
        # The mask value replaced hidden logits (no gradient); a float mask is added.
        dlogits = ds if block.all_visible else np.where(block.unreplaced, ds, 0.0)
        dscaled = dlogits
        if o.softcap is not None:
            t = np.tanh(block.scaled / o.softcap)
            dscaled = dlogits * (1.0 - t * t)
        draw = dscaled * factor
        dq = draw @ k
        dk = draw.T @ q
        dbias = bias_gradient(spec, dlogits)
        attended = None if block.all_visible else block.attended
        health = read_health(HealthBlock(a, top, attended, block.keys.start, da=da, ds=ds))
    return BlockGrad(
        lead_index=lead_index,
        rows=rows,
        keys=keys,
        dq=dq,
        dk=dk,
        dv=dv,
        dbias=dbias,
        health=health,
        records=records,
        dsinks=dsinks,
        steps={"scaled": block.scaled, "d_weights": da, "d_scores": ds, "d_scaled": dscaled}
        if keep_steps
        else None,
    )


def lean_backward_block(
    spec: AttentionSpec, place: Place, dout: F64, inputs: Operands, stats: Stats | None
) -> BlockGrad | None:
    """:func:`backward_block` over ``place``'s rows and keys from the lean forward
    pass, or None where it does not apply (then the per-stage block runs).

    The pass gives the weights (hidden keys 0), the top key, the largest weight
    (1/ℓ) and the forward statistics; ``stats`` are written the rows' own."""
    if not online.applies(spec) or not np.isfinite(dout).all():
        return None
    records = (
        Records.empty(stats.spec, stats.checked, stats.narrow)
        if stats is not None
        else Records.empty(spec, precision.CHECKED, ("float16",))
    )
    found = online.attend_online(
        spec, place.lead, place.rows, place.keys, inputs, records, keep_weights=True
    )
    if found is None or found.weights is None:
        return None
    if stats is not None:
        stats.write_rows(place.at, found.rows)
    a, keys = found.weights, place.keys
    q = np.asarray(spec.q[spec.operand_index("q", place.lead)][place.rows], dtype=np.float64)
    top = np.clip(found.rows.argmax - keys.start, 0, None).astype(np.intp)
    vis = visibility(spec, place.lead, place.rows, keys)
    dout = np.asarray(dout, dtype=np.float64)  # a float16 dO read once, as float64
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        # Products over the block's rows are taken as (small · big)ᵀ: BLAS runs them a
        # quarter faster with the long axis last (dV = (dOᵀ · A)ᵀ, dK = (Qᵀ · dS)ᵀ).
        dv = (dout.T @ a).T
        # the forward pass's logits are spent: dA and dS take their scratch array
        da = scratch("x", np.dtype(np.float64), a.size).reshape(a.shape)
        np.matmul(dout, inputs.v[keys].T, out=da)
        reads = HealthBlock(a, top, vis, keys.start, max_weight=found.rows.max_weight, da=da)
        health = read_health(reads, reads_da=True)  # dS is formed over dA below
        ds, _ = softmax_backward(a, da, top, in_place=True)  # hidden keys: A = 0, so dS = 0
        reads.da, reads.ds = None, ds
        health |= read_health(reads, reads_da=False)
        dq = ds @ inputs.k[keys]
        dq *= spec.factor
        dk = q.T @ ds
        dk *= spec.factor
    return BlockGrad(
        lead_index=place.lead,
        rows=place.rows,
        keys=keys,
        dq=dq,
        dk=dk.T,
        dv=dv,
        dbias=None,
        health=health,
        records=records,
        steps=None,
    )


CENTRE_ABOVE = 0.5
"""Rows whose top weight is above this have dA centred on the top key's value."""


def softmax_backward(
    a: F64, da: F64, top: NDArray[np.intp] | None = None, *, in_place: bool = False
) -> tuple[F64, NDArray[np.intp]]:
    """dS from the weights A and dA ``(rows, keys)``, and each row's top key (given,
    or A's argmax). dS is written over ``da`` with ``in_place`` (a block-sized array
    saved), else ``da`` is left as it was.

    The softmax's Jacobian-vector product dS = A ⊙ (dA − Σ A ⊙ dA), without the
    Jacobian. A row whose top weight is above :data:`CENTRE_ABOVE` has dA first
    centred on the top key's value (exact, as the weights sum to 1): a saturated row
    then gives its tiny dS to full relative precision instead of the rounding noise
    of dA_top − Σ A ⊙ dA. Below it nothing cancels, and the pass is saved.
    """
    n_rows, n_keys = a.shape
    if top is None:
        top = a.argmax(axis=1) if n_keys else np.zeros(n_rows, np.intp)
    if not n_keys:
        return np.zeros_like(a), top
    at = (np.arange(n_rows), top)
    centre = da[at]
    with np.errstate(invalid="ignore"):
        centred = (a[at] > CENTRE_ABOVE) & np.isfinite(centre)
    out = da if in_place else None
    if centred.any():
        ds = np.subtract(da, np.where(centred, centre, 0.0)[:, None], out=out)
    else:
        ds = da if in_place else da.copy()
    ds -= np.einsum("ij,ij->i", ds, a)[:, None]
    ds *= a
    return ds, top


def add_bias_gradient(
    spec: AttentionSpec, dbias: NDArray[Any], lead: Index, rows: slice, keys: slice, part: F64
) -> None:
    """Add a block's d(bias) (:func:`bias_gradient`: summed over the axes the bias
    broadcasts along) at its place in ``dbias``, shaped like ``spec.bias``."""
    target = dbias[spec.operand_index("bias", lead)]
    at_rows = rows if target.shape[0] > 1 else slice(0, 1)
    at_keys = keys if target.shape[1] > 1 else slice(0, 1)
    target[at_rows, at_keys] += part


def bias_gradient(spec: AttentionSpec, dlogits: F64) -> F64 | None:
    """d(bias): dS summed over the axes the bias broadcasts along."""
    if spec.bias is None:
        return None
    lb, sb = spec.bias.shape[-2:]
    dbias = dlogits
    if lb == 1:
        dbias = dbias.sum(axis=0, keepdims=True)
    if sb == 1:
        dbias = dbias.sum(axis=1, keepdims=True)
    return dbias
