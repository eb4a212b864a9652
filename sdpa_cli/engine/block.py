"""One block of attention, every stage: the pure numpy computation.

For one position of the leading axes (a (batch, head) slice) and query rows i0..i1:

    raw     = Q Kᵀ                                   (rows, S)
    scaled  = raw · scale / temperature
    capped  = C · tanh(scaled / C)                   only with a softcap C
    biased  = capped + bias + ALiBi                  only with a bias or ALiBi
              (or score_mod(scaled, b, h, i, j)      with --score-mod, in their stead)
    masked  = biased + float mask, hidden keys set to the mask value
    weights = softmax over keys, max-subtracted; zero for a row with no visible key
              (with --sinks: over the keys and the head's sink logit, the sink's
              column then dropped, so a row sums to 1 − p_sink, as gpt-oss)
    dropped = weights · keep / (1 − p)               only with dropout
    output  = weights (or dropped) · V               (rows, Ev)

:func:`attend_block` is the one place this is computed; the block driver
(:mod:`sdpa_cli.engine.driver`) walks the blocks for every command. Blocks are
independent, so any blocking gives the same masks, dropout and numbers to rounding
(BLAS may sum a one-row block in another order: a few ulps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine import expressions, masks, positions, precision
from sdpa_cli.engine.fp8 import attend_fp8, kernel_descales, runs_fp8
from sdpa_cli.engine.positions import common_keys as common_keys
from sdpa_cli.engine.positions import dropout_keep as dropout_keep
from sdpa_cli.engine.positions import full_keys as full_keys
from sdpa_cli.engine.positions import key_range as key_range
from sdpa_cli.engine.softmax import DENORMAL_FLOOR as DENORMAL_FLOOR
from sdpa_cli.engine.softmax import softmax as softmax
from sdpa_cli.engine.softmax import softmax_lse as softmax_lse
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import F64
from sdpa_cli.engine.visible import block_part, seen_keys
from sdpa_cli.engine.visible import sentinel_keys as sentinel_keys
from sdpa_cli.engine.visible import visibility as visibility
from sdpa_cli.engine.visible import visible_keys as visible_keys
from sdpa_cli.names import STAGES


@dataclass(frozen=True)
class Block:
    """Every stage of one block: query rows ``rows`` of the slice at ``lead_index``,
    over the keys ``keys``. Keys outside ``keys`` are hidden from every row of the
    block by a causal mask, a window or key padding (their weight is 0), and the
    output sums over ``keys`` alone. Arrays are float64, or float32 for a run whose
    every format is float32 (the engine then computes in float32 directly)."""

    lead_index: tuple[int, ...]
    rows: slice
    raw: F64
    scaled: F64
    capped: F64 | None
    biased: F64 | None
    masked: F64
    visible: NDArray[np.bool_]
    weights: F64
    dropped: F64 | None
    output: F64
    keys: slice = field(default_factory=lambda: slice(0, None))
    all_visible: bool = False
    """Whether every key of ``keys`` is visible to every row (no mask applied)."""
    sentinel: NDArray[np.bool_] | None = None
    """The keys only a float mask's sentinel hides (≤ −1e4, :data:`masks.HIDES`): not
    ``visible``, yet their logits are the mask added, not the mask value (None: none)."""
    sink: F64 | None = None
    """With ``--sinks``: each row's weight on the sink column, p_sink ``(rows,)``."""
    sink_logit: float | None = None
    """With ``--sinks``: the slice's head's sink logit, as the softmax read it."""

    @property
    def unreplaced(self) -> NDArray[np.bool_]:
        """The keys whose logits no mask replaced by the mask value: the visible ones and
        those a float mask's sentinel hides (it is added to them, as given)."""
        return self.visible if self.sentinel is None else self.visible | self.sentinel

    def logits_before(self, stage: str) -> F64:
        """The logits just before ``stage`` (``capped``, ``biased`` or ``masked``):
        the last of scaled, capped and biased computed ahead of it."""
        order = ("scaled", "capped", "biased")
        stop = order.index(stage) if stage in order else len(order)
        for name in reversed(order[1:stop]):
            values: F64 | None = getattr(self, name)
            if values is not None:
                return values
        return self.scaled

    @property
    def attended(self) -> NDArray[np.bool_]:
        """The keys each row really attends to: ``visible`` less the keys a float mask
        or the bias hid with −inf (finite before them, −inf after)."""
        before = self.capped if self.capped is not None else self.scaled
        with np.errstate(invalid="ignore"):
            return self.visible & ~(np.isneginf(self.masked) & np.isfinite(before))


def applicable_stages(spec: AttentionSpec) -> tuple[str, ...]:
    """The stages this spec's options bring about, in order."""
    o = spec.options
    skip = set()
    if o.softcap is None:
        skip.add("capped")
    if spec.bias is None and not o.alibi and o.score_mod is None:
        skip.add("biased")
    if o.dropout == 0:
        skip.add("dropped")
    return tuple(s for s in STAGES if s not in skip)


def native_dtype(spec: AttentionSpec, emulate: bool = True) -> np.dtype[Any] | None:
    """The numpy dtype a block is computed in directly: float64, or float32 when every
    format of an emulated run is float32; None when a narrower format must be emulated
    by rounding."""
    o = spec.options
    if not (emulate and o.emulated):
        return np.dtype(np.float64)
    if {o.dtype, o.accumulate, o.softmax_dtype, o.logits_dtype} == {"float32"}:
        return np.dtype(np.float32)
    return None


@dataclass(frozen=True)
class Operands:
    """K and V of one slice in the dtype a block computes in (converted once per slice),
    and which rows (keys) of each are not finite."""

    k: NDArray[Any]
    v: NDArray[Any]
    v_bad: NDArray[np.bool_]
    k_bad: NDArray[np.bool_]
    _moved: dict[Any, Operands] = field(default_factory=dict, compare=False, repr=False)

    def on(self, xp: Any) -> Operands:
        """In namespace ``xp``'s arrays: K and V copied to a torch device once a slice."""
        if xp is not np and xp not in self._moved:
            k, v = xp.asarray(self.k), xp.asarray(self.v)
            self._moved[xp] = Operands(k, v, self.v_bad, self.k_bad)
        return self if xp is np else self._moved[xp]

    @cached_property
    def v_extremes(self) -> tuple[NDArray[Any], NDArray[Any]]:
        """V's smallest and largest value per column over every key (0 with no key)."""
        if not self.v.shape[0]:
            zeros = np.zeros(self.v.shape[1], dtype=self.v.dtype)
            return zeros, zeros
        return self.v.min(axis=0), self.v.max(axis=0)

    @cached_property
    def v_running(self) -> tuple[NDArray[Any], NDArray[Any]]:
        """Running minima and maxima of V down the keys: the range of V over any
        prefix of the keys (the output's bounds under a causal mask or padding)."""
        return np.minimum.accumulate(self.v, axis=0), np.maximum.accumulate(self.v, axis=0)


def operands(spec: AttentionSpec, lead_index: tuple[int, ...], emulate: bool = True) -> Operands:
    """The slice's K and V, read from the (memory-mapped) inputs and converted."""
    native = native_dtype(spec, emulate)
    k = np.asarray(spec.k[spec.operand_index("k", lead_index)], dtype=native or np.float64)
    v = np.asarray(spec.v[spec.operand_index("v", lead_index)], dtype=native or np.float64)
    if native is None:  # a narrower format, emulated: the inputs rounded to it
        if (d := kernel_descales(spec, lead_index, emulate)) is not None:
            k, v = k / d[1], v / d[2]  # the FP8 values: dequantized ones divided back, exactly
        k, v = precision.round_to(k, spec.options.dtype), precision.round_to(v, spec.options.dtype)
    with np.errstate(invalid="ignore"):
        v_bad = ~np.isfinite(v).all(axis=1) if v.size else np.zeros(v.shape[0], np.bool_)
        k_bad = ~np.isfinite(k).all(axis=1) if k.size else np.zeros(k.shape[0], np.bool_)
    return Operands(k, v, v_bad, k_bad)


@dataclass(frozen=True)
class Arithmetic:
    """How a block computes: natively in ``dtype`` (float64, or float32 for a run whose
    every format is float32), or in float64 rounded after every step to the emulated
    formats: ``fmt`` for inputs, weights and output, ``logits`` for scores and logits,
    ``accumulate`` for the matmuls, ``softmax`` for the softmax."""

    native: bool
    dtype: np.dtype[Any]
    fmt: str
    logits: str
    accumulate: str
    softmax: str

    @classmethod
    def of(cls, spec: AttentionSpec, emulate: bool) -> Arithmetic:
        o = spec.options
        dt = native_dtype(spec, emulate)
        D = o.dtype if emulate else "float64"
        wide = D == "float64"
        return cls(
            native=dt is not None,
            dtype=dt if dt is not None else np.dtype(np.float64),
            fmt=D,
            # the FP8 kernel keeps its scores in float32, never in FP8
            logits="float64" if wide else _logits_format(spec, emulate),
            accumulate="float64" if wide else o.accumulate,
            softmax="float64" if wide else o.softmax_dtype,
        )

    def r(self, x: F64) -> F64:
        """Stored in the format."""
        return x if self.native else precision.round_to(x, self.fmt)

    def rl(self, x: F64) -> F64:
        """Scores and logits: stored in --logits-dtype (the format by default)."""
        return x if self.native else precision.round_to(x, self.logits)

    def mm(self, a: F64, b: F64) -> F64:
        return np.matmul(a, b) if self.native else precision.matmul(a, b, self.accumulate)

    def const(self, x: float) -> Any:
        return self.dtype.type(x)


def _logits_format(spec: AttentionSpec, emulate: bool) -> str:
    """--logits-dtype, but float32 where the FP8 kernel would store its scores in FP8."""
    o = spec.options
    return "float32" if runs_fp8(spec, emulate) and o.logits_dtype == o.dtype else o.logits_dtype


def attend_block(
    spec: AttentionSpec,
    lead_index: tuple[int, ...],
    rows: slice,
    *,
    emulate: bool = True,
    keys: slice | None = None,
    inputs: Operands | None = None,
) -> Block:
    """Compute every stage for query rows ``rows`` of the slice at ``lead_index``.

    In float64, or, with ``--dtype`` (and ``emulate``), as a kernel in that format:
    inputs rounded to it, both matmuls accumulated in ``--accumulate``, scores and
    logits stored in ``--logits-dtype`` (the format, or float32 as fused kernels
    keep them), weights and output stored in the format, the softmax computed in
    ``--softmax-dtype``. A run in float64, or in float32 throughout, computes in that
    dtype directly; narrower formats are rounded to after every step, in float64.

    Args:
        keys: the keys to compute (default all); see :func:`key_range`.
        inputs: the slice's K and V from :func:`operands`, when the caller keeps them.
    """
    o = spec.options
    keys = keys if keys is not None else full_keys(spec)
    ar = Arithmetic.of(spec, emulate)
    ops = inputs or operands(spec, lead_index, emulate)
    q = np.asarray(spec.q[spec.operand_index("q", lead_index)][rows], dtype=ar.dtype)
    d = kernel_descales(spec, lead_index, emulate)  # FP8 with descales: FlashAttention-3's rules
    q = ar.r(q if d is None else q / d[0])  # the FP8 values: dequantized Q divided back, exactly

    # Non-finite inputs are reported by the diagnostics, not warned about by numpy.
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        raw, scaled = _scores(spec, ar, q, ops.k[keys], d)
        capped = None
        if o.softcap is not None:
            # Each step stored in the logits' format, as Gemma 2's eager attention
            # does (÷C, tanh, ×C, each a tensor op in the model's dtype).
            t = ar.rl(np.tanh(ar.rl(scaled / ar.const(o.softcap))))
            capped = ar.rl(o.softcap * t)
        logits = capped if capped is not None else scaled
        biased = _biased(spec, ar, logits, lead_index, rows, keys)
        logits = biased if biased is not None else logits
        visible = visibility(spec, lead_index, rows, keys)
        masked = _masked(spec, ar, logits, visible, lead_index, rows, keys)
        # The findings read a float mask's sentinel as hiding; the logits keep it added.
        sentinel = sentinel_keys(spec, lead_index, rows, keys, visible)
        visible = seen_keys(visible, sentinel)
        dropped = None
        if d is not None:  # FP8 with descales: P in FP8, normalised after P·V (engine/fp8.py)
            logit = sink_logit(spec, lead_index)
            weights, output, sink = attend_fp8(
                masked,
                ops.v[keys],
                d[2],
                logit,
                fmt=ar.fmt,
                softmax=ar.softmax,
                accumulate=ar.accumulate,
            )
        else:
            weights, sink, logit = _weights(spec, ar, masked, lead_index)
            if o.dropout > 0:
                keep = dropout_keep(spec, lead_index, rows, keys)
                dropped = ar.r(np.where(keep, weights / ar.const(1.0 - o.dropout), ar.const(0.0)))
            output = ar.r(ar.mm(weights if dropped is None else dropped, ops.v[keys]))
        output = _poisoned_outside(spec, ar, output, ops, keys)

    all_visible = visible is None
    if visible is None:
        visible = np.ones(masked.shape, dtype=np.bool_)
    return Block(
        lead_index,
        rows,
        raw,
        scaled,
        capped,
        biased,
        masked,
        visible,
        weights,
        dropped,
        output,
        keys,
        all_visible,
        sentinel,
        sink,
        logit,
    )


def sink_head(spec: AttentionSpec, lead_index: tuple[int, ...]) -> int:
    """Which of ``--sinks``' logits the slice reads: its query head's (the last
    leading axis), or the one logit every head shares."""
    assert spec.sinks is not None
    return lead_index[-1] if lead_index and spec.sinks.shape[0] > 1 else 0


def sink_logit(spec: AttentionSpec, lead_index: tuple[int, ...]) -> float | None:
    """The sink logit of the slice's query head (None without ``--sinks``)."""
    if spec.sinks is None:
        return None
    return float(spec.sinks[sink_head(spec, lead_index)])


def _weights(
    spec: AttentionSpec, ar: Arithmetic, masked: F64, lead_index: tuple[int, ...]
) -> tuple[F64, F64 | None, float | None]:
    """The softmax of the masked logits; with sinks, over the logits and the head's
    sink as one more column (the row max taken over both, as gpt-oss's eager
    attention), that column split off: the weights, p_sink per row, the sink logit."""
    logit = sink_logit(spec, lead_index)
    if logit is None:
        return ar.r(softmax(masked, ar.softmax, native=ar.native)), None, None
    sink = ar.rl(np.asarray(logit, dtype=ar.dtype))
    column = np.broadcast_to(sink, (masked.shape[0], 1))
    both = ar.r(softmax(np.concatenate([masked, column], axis=-1), ar.softmax, native=ar.native))
    return np.ascontiguousarray(both[:, :-1]), both[:, -1].copy(), float(sink)


def _scores(
    spec: AttentionSpec, ar: Arithmetic, q: F64, k: F64, d: tuple[float, ...] | None = None
) -> tuple[F64, F64]:
    """The raw scores Q Kᵀ and the scaled scores (raw · scale / temperature); with the
    FP8 kernel's descales ``d``, its float32 product of the FP8 values scaled by
    scale · q_descale · k_descale, raw reported as the real values' product."""
    factor = spec.factor
    if spec.options.prescale:
        # Q and K each scaled by √scale first (ONNX's reference does this against
        # overflow): the raw product is already the scaled logits.
        root = ar.const(math.sqrt(factor))
        raw = ar.rl(ar.mm(ar.r(q * root), ar.r(k * root).T))
        return raw, raw
    raw = ar.rl(ar.mm(q, k.T))
    if d is not None:
        return raw * (d[0] * d[1]), ar.rl(raw * ar.const(factor * d[0] * d[1]))
    return raw, ar.rl(raw * ar.const(factor))


def _biased(
    spec: AttentionSpec,
    ar: Arithmetic,
    logits: F64,
    lead_index: tuple[int, ...],
    rows: slice,
    keys: slice,
) -> F64 | None:
    """The logits plus the bias and ALiBi (or through --score-mod), or None."""
    if spec.options.score_mod is not None:
        mod = expressions.score_mod(spec.options.score_mod, logits, lead_index, rows, keys)
        return ar.rl(mod.astype(ar.dtype))
    if spec.bias is None and not spec.options.alibi:
        return None
    biased = logits.copy()
    if spec.bias is not None:
        bias = spec.bias[spec.operand_index("bias", lead_index)]
        # The bias in its own dtype (a float32 bias stays float32 under --dtype
        # bfloat16, as JAX keeps it); the sum is stored in the logits' format.
        biased += np.asarray(block_part(bias, rows, keys), dtype=ar.dtype)
    if spec.options.alibi:
        h = lead_index[-1] if lead_index else 0
        slope = float(spec.alibi_slopes[h])
        offset = positions.alibi_offset(spec, lead_index)
        bias_a = masks.alibi(rows.start, rows.stop, spec.L, spec.S, slope, keys, offset=offset)
        biased += bias_a.astype(ar.dtype)
    return ar.rl(biased)


def _masked(
    spec: AttentionSpec,
    ar: Arithmetic,
    logits: F64,
    visible: NDArray[np.bool_] | None,
    lead_index: tuple[int, ...],
    rows: slice,
    keys: slice,
) -> F64:
    """The logits plus a float mask, with hidden keys set to the mask value."""
    masked = logits
    if spec.mask is not None and not spec.mask_is_bool:
        additive = spec.mask[spec.operand_index("mask", lead_index)]
        masked = ar.rl(masked + ar.r(np.asarray(block_part(additive, rows, keys), dtype=ar.dtype)))
    if visible is not None:
        # −1e9 is −inf in float16: the mask value is stored in the format too. float8
        # e4m3fn has no inf (−inf becomes NaN there): its hidden logits stay −inf.
        hidden_value = float(ar.rl(np.asarray(spec.options.effective_mask_value)))
        masked = masked.copy() if masked is logits else masked
        masked[~visible] = -math.inf if math.isnan(hidden_value) else hidden_value
    absent = rows.stop - positions.valid_queries(spec, lead_index)
    if absent > 0:  # rows past --query-lengths: −inf whatever the mask value (zeros)
        masked = masked.copy() if masked is logits else masked
        masked[max(0, rows.stop - rows.start - absent) :] = -math.inf
    return masked


def _poisoned_outside(
    spec: AttentionSpec, ar: Arithmetic, output: F64, ops: Operands, keys: slice
) -> F64:
    """A dense kernel multiplies the keys this block skips by their zero weight:
    0 · NaN (or inf) in V is NaN, and the output shows it."""
    if keys.stop - keys.start < spec.S and ops.v_bad.any():
        outside = ops.v_bad.copy()
        outside[keys] = False
        if outside.any():
            return output + ar.const(0.0) * ops.v[outside].sum(axis=0)  # type: ignore[no-any-return]
    return output


def block_lse(block: Block) -> F64:
    """Each row's logsumexp of a block's masked logits (:func:`softmax_lse`), the
    sink's logit included with ``--sinks`` (the normaliser of the weights)."""
    if block.sink is None or block.sink_logit is None:
        return softmax_lse(block.masked, block.weights)
    column = np.full((block.masked.shape[0], 1), block.sink_logit)
    logits = np.concatenate([block.masked.astype(np.float64), column], axis=-1)
    return softmax_lse(logits, np.concatenate([block.weights, block.sink[:, None]], axis=-1))
