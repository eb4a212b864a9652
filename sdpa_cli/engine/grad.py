"""The backward pass: dQ, dK, dV (and d(bias)) of attention, analytically, block by block.

For the scalar loss ℓ = Σ O ⊙ dO (dO the output's gradient) and one block of query
rows, with A the weights, P the weights after dropout (A · keep / (1 − p)), and the
factor f = scale / temperature:

    dV     += Pᵀ · dO                                   (S, Ev)
    dP      = dO · Vᵀ                                   (rows, S)
    dA      = dP · keep / (1 − p)                       dP without dropout
    dS      = A ⊙ (dA − rowsum(dA ⊙ A))                 the softmax's Jacobian
    dlogits = dS, zero where a mask replaced the logit  (a float mask adds: it passes)
    d(bias) = dlogits                                   summed over broadcast axes
    dscaled = dlogits ⊙ (1 − tanh²(scaled / C))        softcap C's chain rule
    dQ      = dscaled · K · f;  dK += dscaledᵀ · Q · f  GQA: summed over the group

Every block recomputes its weights (as FlashAttention's backward does) rather than
reading stored ones, so nothing score-sized outlives a block; dK, dV and d(bias)
are summed over blocks in block order, so the result does not depend on ``--jobs``.
The backward pass runs in float64 whatever ``--dtype`` says: the format is what
the gradients' range is judged against (:mod:`sdpa_cli.diagnosis.grad`).

Per row the pass keeps what the gradient-health findings read: ‖dA‖, ‖dS‖, the
largest weight and 1 − Σ A², which bounds the softmax Jacobian's norm (the
Jacobian diag(A) − A Aᵀ is positive semi-definite, so its norm is at most its
trace): ‖dS‖ ≤ (1 − Σ A²) · ‖dA‖, and a one-hot row passes back nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine.block import (
    Block,
    Operands,
    attend_block,
    dropout_keep,
    full_keys,
    operands,
)
from sdpa_cli.engine.driver import KeyMode, Place, Progress, sweep
from sdpa_cli.engine.precision import is_float
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.trace import split_heads_of_output
from sdpa_cli.engine.types import F64, Index
from sdpa_cli.errors import SpecError

if TYPE_CHECKING:
    from sdpa_cli.engine.records import Records
    from sdpa_cli.engine.stats import Stats


DOUT_SOURCES = ("ones", "random")
"""``--dout`` values that are not files."""

GRADIENTS = ("dq", "dk", "dv", "dbias")
"""The gradient tensors, named as in ``--save``: of Q, K, V and the bias."""

OPERAND = {"dq": "q", "dk": "k", "dv": "v", "dbias": "bias"}


def random_stream(seed: int, purpose: int) -> np.random.Generator:
    """One independent random stream per use of ``--seed`` (1: a random dO, 2: the
    entries a numeric check samples); dropout draws from its own Philox counter."""
    return np.random.default_rng([seed, purpose])


def make_dout(spec: AttentionSpec, given: str | NDArray[Any], seed: int, where: str) -> F64:
    """The output's gradient dO in the engine's layout ``(*lead, L, Ev)``, float64.

    Args:
        given: ``ones``, ``random`` (standard normal, from ``seed``) or an array
            shaped like the output as returned (leading axes of size 1 may differ).
        where: how to name the source in an error (``--dout`` or the file).

    Raises:
        SpecError: when the array's shape is not the output's, or its values not numbers.
    """
    shape = spec.merged_output_shape
    if isinstance(given, str):
        if given == "ones":
            return np.ones(spec.output_shape)
        if given == "random":
            return split_heads_of_output(spec, random_stream(seed, 1).standard_normal(shape))
        raise SpecError(where, f"expected a file, ones or random, got {given!r}")
    arr = np.asarray(given)
    if arr.dtype.names is not None or not (arr.dtype.kind in "biuf" or is_float(arr.dtype)):
        raise SpecError(where, f"dO has dtype {arr.dtype}; expected numbers")
    if _squeezed(arr.shape) != _squeezed(shape):
        raise SpecError(
            where,
            f"dO should have the output's shape {shape}: but got {tuple(arr.shape)}",
        )
    return split_heads_of_output(spec, np.asarray(arr, dtype=np.float64).reshape(shape))


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape without its leading axes of size 1."""
    i = 0
    while i < len(shape) - 2 and shape[i] == 1:
        i += 1
    return tuple(shape[i:])


ROW_RECORDS: dict[str, type[np.generic]] = {
    "da_norm": np.float64,
    "ds_norm": np.float64,
    "gain": np.float64,
    "max_weight": np.float64,
    "rest": np.float64,
    "argmax": np.int64,
    "n_visible": np.int64,
}
"""The per-row records a block gives and :class:`Gradients` keeps ``(*lead, L)``."""


@dataclass(frozen=True)
class BlockGrad:
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
    da_norm: F64
    ds_norm: F64
    gain: F64
    max_weight: F64
    rest: F64
    """The weight on every key but the top one (1 − max weight, without rounding)."""
    argmax: NDArray[np.int64]
    n_visible: NDArray[np.int64]
    key_weight: F64
    """The largest weight each key of ``keys`` gets from the block's rows."""
    key_seen: NDArray[np.bool_]
    """Whether any row of the block may attend to each key of ``keys``."""
    records: Records | None = None
    """The forward pass's statistics of the block, when asked for."""
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
        ds, top = softmax_backward(a, da)
        dlogits = ds if block.all_visible else np.where(block.visible, ds, 0.0)
        dscaled = dlogits
        if o.softcap is not None:
            t = np.tanh(block.scaled / o.softcap)
            dscaled = dlogits * (1.0 - t * t)
        draw = dscaled * factor
        dq = draw @ k
        dk = draw.T @ q
        dbias = _dbias(spec, dlogits)
        health = _row_health(block, a, da, ds, top)
    return BlockGrad(
        lead_index=lead_index,
        rows=rows,
        keys=keys,
        dq=dq,
        dk=dk,
        dv=dv,
        dbias=dbias,
        **health,
        records=records,
        steps={"scaled": block.scaled, "d_weights": da, "d_scores": ds, "d_scaled": dscaled}
        if keep_steps
        else None,
    )


def softmax_backward(a: F64, da: F64) -> tuple[F64, NDArray[np.intp]]:
    """dS from the weights A and dA ``(rows, keys)``, and each row's top key.

    The softmax's Jacobian-vector product dS = A ⊙ (dA − Σ A ⊙ dA), without the
    Jacobian. dA is first centred on the top key's value (exact, as the weights sum
    to 1): a saturated row then gives its tiny dS to full relative precision instead
    of the rounding noise of dA_top − Σ A ⊙ dA.
    """
    n_rows, n_keys = a.shape
    top = a.argmax(axis=1) if n_keys else np.zeros(n_rows, np.int64)
    centre = np.take_along_axis(da, top[:, None], axis=1) if n_keys else np.zeros((n_rows, 1))
    da_c = da - np.where(np.isfinite(centre), centre, 0.0)
    return a * (da_c - np.sum(da_c * a, axis=1, keepdims=True)), top


def _dbias(spec: AttentionSpec, dlogits: F64) -> F64 | None:
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


def _row_health(
    block: Block, a: F64, da: F64, ds: F64, top: NDArray[np.intp]
) -> dict[str, NDArray[Any]]:
    """The per-row and per-key records of :class:`BlockGrad`: norms of dA and dS,
    the top weight and what the rest of the row holds, the gain 1 − Σ w², the
    attended keys."""
    n_rows, n_keys = a.shape
    attended = block.attended
    # Norms over the keys a row attends to: a finite mask value gives a fully masked
    # row uniform weights, yet its logits were replaced and pass nothing back.
    da_seen = da if block.all_visible else np.where(attended, da, 0.0)
    ds_seen = ds if block.all_visible else np.where(attended, ds, 0.0)
    max_weight = a.max(axis=1) if n_keys else np.zeros(n_rows)
    rest, gain = _off_top(a, top, max_weight)
    n_visible = attended.sum(axis=1)
    argmax = np.where(n_visible > 0, top + block.keys.start, -1)  # −1: no key to name
    a_seen = a if block.all_visible else np.where(attended, a, 0.0)
    return {
        "da_norm": norm(da_seen, axis=1),
        "ds_norm": norm(ds_seen, axis=1),
        "gain": np.where(n_visible > 0, gain, 0.0),
        "max_weight": max_weight,
        "rest": rest,
        "argmax": argmax.astype(np.int64),
        "n_visible": n_visible.astype(np.int64),
        "key_weight": a_seen.max(axis=0) if n_rows else np.zeros(n_keys),
        "key_seen": np.asarray(attended.any(axis=0), dtype=np.bool_),
    }


PRECISE_BELOW = 1e-4
"""Rows whose 1 − Σ A² falls below this are recomputed without the cancellation."""


def _off_top(a: F64, top: NDArray[np.intp], max_weight: F64) -> tuple[F64, F64]:
    """Per row: the weight off the top key, and 1 − Σ A² (the Jacobian's norm bound).

    1 − Σ A² = Σ A (1 − A); for a nearly one-hot row the top key's 1 − A_top is taken
    as the weight on the other keys, since 1 − 0.99999999 keeps only rounding. The
    cheap forms serve every other row.
    """
    rest = 1.0 - max_weight
    gain = 1.0 - np.einsum("ij,ij->i", a, a)
    with np.errstate(invalid="ignore"):
        close = np.flatnonzero(gain < PRECISE_BELOW)
    if close.size and a.shape[1]:
        others = a[close]
        others[np.arange(close.size), top[close]] = 0.0
        rest[close] = others.sum(axis=1)
        gain[close] = max_weight[close] * rest[close] + np.sum(others * (1.0 - others), axis=1)
    return rest, gain


def norm(x: NDArray[Any], axis: int | tuple[int, ...] | None = None) -> Any:
    """The 2-norm along ``axis``, scaled by the largest magnitude first: the squares of
    a vanishing row's dS (~1e-200) would underflow to 0 and hide it."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        mags = np.abs(x)
        top = np.max(mags, axis=axis, keepdims=True, initial=0.0)
        safe = np.where((top > 0) & np.isfinite(top), top, 1.0)
        total = np.sqrt(np.sum(np.square(mags / safe), axis=axis, keepdims=True)) * safe
        total = np.where(np.isfinite(top), total, top)  # inf stays inf, NaN NaN
        return np.squeeze(total, axis=axis) if axis is not None else total.reshape(())[()]


@dataclass(frozen=True)
class Gradients:
    """The gradients of ``Σ O ⊙ dO`` and what the health findings read.

    ``dq``, ``dk``, ``dv`` and ``dbias`` are float64 and shaped like ``spec.q``,
    ``spec.k``, ``spec.v`` and ``spec.bias`` (the engine's layout; see
    :meth:`loaded`). Row records are ``(*lead, L)``; key records ``(*lead, S)``.
    """

    spec: AttentionSpec
    dout: F64
    dq: F64
    dk: F64
    dv: F64
    dbias: F64 | None
    da_norm: F64
    ds_norm: F64
    gain: F64
    max_weight: F64
    rest: F64
    argmax: NDArray[np.int64]
    n_visible: NDArray[np.int64]
    key_weight: F64
    key_seen: NDArray[np.bool_]

    def vanishing(self, threshold: float) -> NDArray[np.bool_]:
        """``(*lead, L)``: the rows whose softmax passes back less than ``threshold`` of
        their gradient (1 − Σ w²), among those that see two keys or more (one key always
        gets weight 1)."""
        with np.errstate(invalid="ignore"):
            return (self.n_visible >= 2) & np.isfinite(self.gain) & (self.gain < threshold)

    def tensor(self, name: str) -> F64 | None:
        """``dq``, ``dk``, ``dv`` or ``dbias`` in the engine's layout."""
        return getattr(self, name)  # type: ignore[no-any-return]

    def loaded(self, name: str) -> F64 | None:
        """A gradient in the shape its operand was loaded in (heads merged back)."""
        values = self.tensor(name)
        return None if values is None else self.spec.as_loaded(OPERAND[name], values)

    def present(self) -> tuple[str, ...]:
        """The gradients this computation has (``dbias`` only with a bias)."""
        return tuple(n for n in GRADIENTS if self.tensor(n) is not None)


def backward(
    spec: AttentionSpec,
    dout: F64,
    *,
    rows: int | None = None,
    jobs: int = 1,
    progress: Progress | None = None,
    stats: Stats | None = None,
) -> Gradients:
    """dQ, dK, dV and d(bias) of ``Σ O ⊙ dO``, over every block of the computation.

    Args:
        spec: the validated computation.
        dout: dO in the engine's layout, from :func:`make_dout`.
        rows: query rows per block (default as the forward pass).
        jobs: threads computing blocks.
        progress: told the scores done after each block.
        stats: gathers the forward pass's statistics (``Stats.empty(spec)``), so that
            one pass gives the forward findings too; ``spec`` must then be float64.
    """
    dq = np.zeros(spec.q.shape)
    dk = np.zeros(spec.k.shape)
    dv = np.zeros(spec.v.shape)
    dbias = np.zeros(spec.bias.shape) if spec.bias is not None else None
    per_row = {n: np.zeros((*spec.lead, spec.L), dt) for n, dt in ROW_RECORDS.items()}
    key_weight = np.zeros((*spec.lead, spec.S))
    key_seen = np.zeros((*spec.lead, spec.S), np.bool_)

    def visit(place: Place) -> BlockGrad:
        inputs = place.inputs.get(spec, place.lead, emulate=False)
        g = dout[place.at]
        return backward_block(
            spec, place.lead, place.rows, g, keys=place.keys, inputs=inputs, stats=stats
        )

    # NaN or inf in V outside a block's keys would poison a dense kernel's dS through
    # 0 · NaN: such blocks compute every key.
    sweep_keys: KeyMode = "all-if-v-nonfinite"
    for g in sweep(spec, visit, jobs=jobs, rows=rows, keys=sweep_keys, progress=progress):
        li, r, ks = g.lead_index, g.rows, g.keys
        if stats is not None and g.records is not None:
            stats.merge(g.records)
        dq[spec.operand_index("q", li)][r] += g.dq
        dk[spec.operand_index("k", li)][ks] += g.dk
        dv[spec.operand_index("v", li)][ks] += g.dv
        if dbias is not None and g.dbias is not None:
            target = dbias[spec.operand_index("bias", li)]
            at_rows = r if target.shape[0] > 1 else slice(0, 1)
            at_keys = ks if target.shape[1] > 1 else slice(0, 1)
            target[at_rows, at_keys] += g.dbias
        at: tuple[int | slice, ...] = (*li, r)
        for name, values in per_row.items():
            values[at] = getattr(g, name)
        np.maximum(key_weight[li][ks], g.key_weight, out=key_weight[li][ks])
        key_seen[li][ks] |= g.key_seen
    if stats is not None:
        stats.add_all_moments()
    return Gradients(
        spec=spec,
        dout=dout,
        dq=dq,
        dk=dk,
        dv=dv,
        dbias=dbias,
        key_weight=key_weight,
        key_seen=key_seen,
        **per_row,
    )
