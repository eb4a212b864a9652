"""The pure numpy pipeline: attention computed one block of query rows at a time.

For one position of the leading axes (a (batch, head) slice) and query rows i0..i1:

    raw     = Q Kᵀ                                   (rows, S)
    scaled  = raw · scale / temperature
    capped  = C · tanh(scaled / C)                   only with a softcap C
    biased  = capped + bias + ALiBi                  only with a bias or ALiBi
    masked  = biased + float mask, hidden keys set to the mask value
    weights = softmax over keys, max-subtracted; zero for a row with no visible key
    dropped = weights · keep / (1 − p)               only with dropout
    output  = weights (or dropped) · V               (rows, Ev)

:func:`attend_block` is the one place this is computed; :func:`trace` assembles
blocks into whole arrays, and every command goes through it. Blocks are independent,
so any blocking gives the same masks, dropout and numbers
to rounding (BLAS may sum a one-row block in another order: a few ulps).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli import masks, precision
from sdpa_cli.errors import SpecError
from sdpa_cli.spec import AttentionSpec

if TYPE_CHECKING:
    from sdpa_cli.stats import Stats

F64 = NDArray[np.float64]

STAGES = ("raw", "scaled", "capped", "biased", "masked", "weights", "dropped", "output")
"""Every stage, in the order of computation."""

BLOCK_ELEMENTS = 1 << 18
"""Scores per block (rows × S): 2 MiB of float64 per stage array, cache-friendly."""


@dataclass(frozen=True)
class Block:
    """Every stage of one block: query rows ``rows`` of the slice at ``lead_index``."""

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
    if spec.bias is None and not o.alibi:
        skip.add("biased")
    if o.dropout == 0:
        skip.add("dropped")
    return tuple(s for s in STAGES if s not in skip)


def block_rows(spec: AttentionSpec) -> int:
    """Query rows per block: about :data:`BLOCK_ELEMENTS` scores, at least one row."""
    return max(1, BLOCK_ELEMENTS // max(spec.S, 1))


def iter_blocks(
    spec: AttentionSpec, rows: int | None = None
) -> Iterator[tuple[tuple[int, ...], slice]]:
    """Every (lead index, query-row slice) pair, in C order."""
    step = rows or block_rows(spec)
    for lead_index in np.ndindex(*spec.lead):
        for i0 in range(0, spec.L, step):
            yield tuple(int(x) for x in lead_index), slice(i0, min(i0 + step, spec.L))


def _rows_of(a: NDArray[Any], rows: slice) -> NDArray[Any]:
    """The block's rows of a (L or 1, S or 1) mask/bias slice."""
    return a if a.shape[0] == 1 else a[rows]


def visibility(spec: AttentionSpec, lead_index: tuple[int, ...], rows: slice) -> NDArray[np.bool_]:
    """Which keys each query row of the block may attend to: every mask combined."""
    o = spec.options
    i0, i1 = rows.start, rows.stop
    n_rows, S, L = i1 - i0, spec.S, spec.L
    visible = np.ones((n_rows, S), dtype=np.bool_)
    if o.causal:
        visible &= masks.causal(i0, i1, L, S, o.causal_align)
    if o.window is not None:
        visible &= masks.window(i0, i1, L, S, *o.window, o.causal_align)
    if o.key_lengths is not None:
        b = lead_index[-2] if len(o.key_lengths) > 1 else 0
        visible &= masks.key_padding(o.key_lengths[b], n_rows, S)
    if spec.mask_is_bool:
        assert spec.mask is not None
        allowed = _rows_of(spec.mask[spec.operand_index("mask", lead_index)], rows)
        visible &= ~allowed if o.mask_true_means == "masked" else allowed
    return visible


def _dropout_keep(
    spec: AttentionSpec, lead_index: tuple[int, ...], rows: slice
) -> NDArray[np.bool_]:
    """The dropout keep-mask of a block, drawn by element position.

    Philox is counter-based: the counter of row r of slice n starts at
    (n·L + r) · ⌈S/4⌉, so a row's draws do not depend on how rows are blocked.
    """
    o = spec.options
    words = -(-spec.S // 4)  # Philox4x64 gives 4 words per counter step
    flat = int(np.ravel_multi_index(lead_index, spec.lead)) if spec.lead else 0
    first_row = flat * spec.L + rows.start
    gen = np.random.Philox(key=o.seed, counter=first_row * words)
    n_rows = rows.stop - rows.start
    draws = gen.random_raw(n_rows * words * 4).reshape(n_rows, words * 4)[:, : spec.S]
    uniform = (draws >> np.uint64(11)).astype(np.float64) * 2.0**-53  # 53-bit uniform in [0, 1)
    return uniform >= o.dropout  # type: ignore[no-any-return]


def attend_block(
    spec: AttentionSpec, lead_index: tuple[int, ...], rows: slice, *, emulate: bool = True
) -> Block:
    """Compute every stage for query rows ``rows`` of the slice at ``lead_index``.

    In float64, or, with ``--dtype`` (and ``emulate``), as a kernel in that format:
    inputs rounded to it, both matmuls accumulated in ``--accumulate``, scores and
    logits stored in ``--logits-dtype`` (the format, or float32 as fused kernels
    keep them), weights and output stored in the format, the softmax computed in
    ``--softmax-dtype``. Values are float64
    arrays either way; in float64 every rounding below is the identity.
    """
    o = spec.options
    D = o.dtype if emulate else "float64"
    acc = o.accumulate if D != "float64" else "float64"
    sm = o.softmax_dtype if D != "float64" else "float64"
    LD = o.logits_dtype if D != "float64" else "float64"
    f64 = np.float64

    def r(x: F64) -> F64:
        return precision.round_to(x, D)

    def rl(x: F64) -> F64:  # scores and logits: in --logits-dtype (the format by default)
        return precision.round_to(x, LD)

    q = r(np.asarray(spec.q[spec.operand_index("q", lead_index)][rows], dtype=f64))
    k = r(np.asarray(spec.k[spec.operand_index("k", lead_index)], dtype=f64))
    v = r(np.asarray(spec.v[spec.operand_index("v", lead_index)], dtype=f64))
    factor = spec.scale / o.temperature

    # Non-finite inputs are reported by the diagnostics, not warned about by numpy.
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if o.prescale:
            # Q and K each scaled by √scale first (ONNX's reference does this against
            # overflow): the raw product is already the scaled logits.
            root = math.sqrt(factor)
            raw = rl(precision.matmul(r(q * root), r(k * root).T, acc))
            scaled = raw
        else:
            raw = rl(precision.matmul(q, k.T, acc))
            scaled = rl(raw * factor)
        logits = scaled
        capped = None
        if o.softcap is not None:
            capped = rl(o.softcap * np.tanh(scaled / o.softcap))
            logits = capped
        biased = None
        if spec.bias is not None or o.alibi:
            biased = logits.copy()
            if spec.bias is not None:
                bias = spec.bias[spec.operand_index("bias", lead_index)]
                biased += r(np.asarray(_rows_of(bias, rows), dtype=f64))
            if o.alibi:
                h = lead_index[-1] if lead_index else 0
                slope = float(spec.alibi_slopes[h])
                biased += masks.alibi(rows.start, rows.stop, spec.L, spec.S, slope)
            biased = rl(biased)
            logits = biased

        visible = visibility(spec, lead_index, rows)
        masked = logits.copy()
        if spec.mask is not None and not spec.mask_is_bool:
            additive = spec.mask[spec.operand_index("mask", lead_index)]
            masked = rl(masked + r(np.asarray(_rows_of(additive, rows), dtype=f64)))
        # −1e9 is −inf in float16: the mask value is stored in the format too. float8
        # e4m3fn has no inf (−inf becomes NaN there): its hidden logits stay −inf.
        hidden_value = float(rl(np.asarray(o.effective_mask_value)))
        masked[~visible] = -math.inf if math.isnan(hidden_value) else hidden_value

        weights = r(softmax(masked, sm))
        dropped = None
        if o.dropout > 0:
            keep = _dropout_keep(spec, lead_index, rows)
            dropped = r(np.where(keep, weights / (1.0 - o.dropout), 0.0))
        output = r(precision.matmul(weights if dropped is None else dropped, v, acc))

    return Block(
        lead_index, rows, raw, scaled, capped, biased, masked, visible, weights, dropped, output
    )


def softmax(logits: F64, dtype: str = "float64") -> F64:
    """Row softmax over the last axis, max-subtracted, computed in the format ``dtype``.

    A row whose logits are all −inf (no visible key) gets zero weights, as PyTorch's
    safe softmax, FlashAttention and ONNX return; a finite mask value keeps such a
    row uniform, as kernels that mask with −1e9 or finfo.min do.
    """

    def r(x: F64) -> F64:
        return precision.round_to(x, dtype)

    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        # initial=−inf keeps an empty key axis (S = 0) valid; NaN still propagates.
        m = np.max(logits, axis=-1, keepdims=True, initial=-math.inf)
        # Subtracting the row max keeps exp ≤ 1 (no overflow); an all −inf row subtracts 0.
        e = r(np.exp(r(logits - np.where(m == -math.inf, 0.0, m))))
        total = precision.row_sum(e, dtype)
        return r(e / np.where(total == 0.0, 1.0, total))


@dataclass(frozen=True)
class Trace:
    """Every stage of the computation, as whole arrays.

    Score-shaped stages are ``(*lead, L, S)``, ``output`` is ``(*lead, L, Ev)``.
    Stages that the options do not bring about (``capped``, ``biased``, ``dropped``)
    and stages not asked for are ``None``. With ``--dtype`` the stages are the
    emulated values. ``stats`` holds the per-row and per-stage statistics of every
    block, gathered as it was computed, for the diagnostics.
    """

    spec: AttentionSpec
    raw: F64 | None
    scaled: F64 | None
    capped: F64 | None
    biased: F64 | None
    masked: F64 | None
    visible: NDArray[np.bool_]
    weights: F64 | None
    dropped: F64 | None
    output: F64 | None
    stats: Stats

    def stage(self, name: str) -> F64 | None:
        return getattr(self, name)  # type: ignore[no-any-return]

    @property
    def merged_output(self) -> F64 | None:
        """The output with heads merged back, ``(..., L, heads · Ev)``, under ``--heads``."""
        if self.output is None or self.spec.options.heads is None:
            return self.output
        out = np.moveaxis(self.output, -3, -2)  # (..., L, heads, Ev)
        return out.reshape(self.spec.merged_output_shape)


def available_memory() -> int | None:
    """Bytes of memory available now (Linux's MemAvailable), or None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_fits(spec: AttentionSpec, keep: set[str]) -> None:
    """Refuse, before allocating, a trace that cannot fit in memory (rather than be killed)."""
    scores = math.prod(spec.weights_shape)
    need = scores  # the boolean visibility
    need += sum(8 * (math.prod(spec.output_shape) if s == "output" else scores) for s in keep)
    available = available_memory()
    if available is not None and need > available:
        gib = 2.0**30
        raise SpecError(
            f"scores {spec.weights_shape}",
            f"keeping {len(keep)} stage(s) whole in float64 needs {need / gib:.1f} GiB, "
            f"but {available / gib:.1f} GiB of memory is available; "
            "ask for fewer --stages, or slice the inputs",
        )


def trace(
    spec: AttentionSpec,
    stages: tuple[str, ...] | None = None,
    rows: int | None = None,
    *,
    gather_stats: bool = True,
) -> Trace:
    """Run the engine over every block and keep the stages asked for (default: all).

    Statistics for the diagnostics are gathered from every block as it is computed.
    With ``--dtype`` each block is computed twice, emulated (kept) and in float64
    (compared against, then dropped).

    Args:
        spec: the validated computation.
        stages: names from :data:`STAGES` to keep; the others are not stored.
        rows: query rows per block (default :func:`block_rows`); any value gives the
            same numbers to rounding.
        gather_stats: False for a trace used only for its values (a reference to
            compare against): no statistics, no float64 twin of an emulated block.
    """
    from sdpa_cli.stats import Stats  # stats reads Block: imported here, not at the top

    keep = set(applicable_stages(spec) if stages is None else stages) & set(applicable_stages(spec))
    ws, os_ = spec.weights_shape, spec.output_shape
    _check_fits(spec, keep)
    arrays: dict[str, Any] = {
        s: np.empty(os_ if s == "output" else ws, dtype=np.float64) for s in STAGES if s in keep
    }
    visible = np.empty(ws, dtype=np.bool_)
    stats = Stats.empty(spec)
    for lead_index, r in iter_blocks(spec, rows):
        block = attend_block(spec, lead_index, r)
        if gather_stats:
            reference = (
                attend_block(spec, lead_index, r, emulate=False) if spec.options.emulated else block
            )
            stats.observe(block, reference)
        at: tuple[int | slice, ...] = (*lead_index, r)
        visible[at] = block.visible
        for name, arr in arrays.items():
            arr[at] = getattr(block, name)
    return Trace(spec=spec, visible=visible, stats=stats, **{s: arrays.get(s) for s in STAGES})
