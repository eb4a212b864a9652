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
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine import masks, precision
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.errors import SpecError

if TYPE_CHECKING:
    from sdpa_cli.engine.stats import Moments, Stats

F64 = NDArray[np.float64]
T = TypeVar("T")

STAGES = ("raw", "scaled", "capped", "biased", "masked", "weights", "dropped", "output")
"""Every stage, in the order of computation."""

BLOCK_ELEMENTS = 1 << 19
"""Scores per block (rows × keys): 4 MiB of float64 (2 MiB of float32) per stage array."""

DENORMAL_FLOOR = {
    np.dtype(dt): math.log(float(np.finfo(dt).tiny)) for dt in (np.float64, np.float32)
}
"""exp(x) is subnormal below log(smallest normal): −708.4 in float64, −87.3 in float32.
Subnormals are 10–30× slower in exp and in the matmul that follows, and a saturated
row (what this tool exists to find) is full of them. Arguments below the floor are
set to −inf, so their weights are 0 rather than a subnormal: a change smaller than
the format's smallest normal number, which no result can resolve after the row is
normalised (every weight is divided by a sum ≥ 1)."""


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


def _part(a: NDArray[Any], rows: slice, keys: slice) -> NDArray[Any]:
    """The block's rows and keys of a (L or 1, S or 1) mask/bias slice."""
    a = a if a.shape[0] == 1 else a[rows]
    return a if a.shape[1] == 1 else a[:, keys]


def full_keys(spec: AttentionSpec) -> slice:
    return slice(0, spec.S)


def key_range(spec: AttentionSpec, lead_index: tuple[int, ...], rows: slice) -> slice:
    """The keys a block must compute: all of them, less those a causal mask, a window
    or key padding hides from every row of the block, when hidden keys weigh nothing
    (the mask value is −inf; a finite one still spreads a fully masked row over them)."""
    o = spec.options
    if not math.isinf(o.effective_mask_value):
        return full_keys(spec)
    n_valid = None
    if o.key_lengths is not None:
        n_valid = o.key_lengths[lead_index[-2] if len(o.key_lengths) > 1 else 0]
    return masks.key_range(
        rows.start,
        rows.stop,
        spec.L,
        spec.S,
        causal=o.causal,
        window=o.window,
        align=o.causal_align,
        n_valid=n_valid,
    )


def visibility(
    spec: AttentionSpec, lead_index: tuple[int, ...], rows: slice, keys: slice | None = None
) -> NDArray[np.bool_] | None:
    """Which keys each query row of the block may attend to: every mask combined, or
    None when no mask applies (every key is visible)."""
    o = spec.options
    keys = keys if keys is not None else full_keys(spec)
    i0, i1 = rows.start, rows.stop
    n_rows, S, L = i1 - i0, spec.S, spec.L
    visible: NDArray[np.bool_] | None = None

    def both(m: NDArray[np.bool_]) -> NDArray[np.bool_]:
        return m if visible is None else visible & m

    if o.causal:
        visible = both(masks.causal(i0, i1, L, S, o.causal_align, keys))
    if o.window is not None:
        visible = both(masks.window(i0, i1, L, S, *o.window, o.causal_align, keys))
    if o.key_lengths is not None:
        b = lead_index[-2] if len(o.key_lengths) > 1 else 0
        visible = both(masks.key_padding(o.key_lengths[b], n_rows, S, keys))
    if spec.mask_is_bool:
        assert spec.mask is not None
        allowed = _part(spec.mask[spec.operand_index("mask", lead_index)], rows, keys)
        visible = both(~allowed if o.mask_true_means == "masked" else allowed)
    if visible is not None:
        visible = np.broadcast_to(visible, (n_rows, keys.stop - keys.start))
    return visible


def dropout_keep(
    spec: AttentionSpec, lead_index: tuple[int, ...], rows: slice, keys: slice
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
    draws = gen.random_raw(n_rows * words * 4).reshape(n_rows, words * 4)[:, keys]
    uniform = (draws >> np.uint64(11)).astype(np.float64) * 2.0**-53  # 53-bit uniform in [0, 1)
    return uniform >= o.dropout  # type: ignore[no-any-return]


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
    and which rows of V are not finite."""

    k: NDArray[Any]
    v: NDArray[Any]
    v_bad: NDArray[np.bool_]

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
        k, v = precision.round_to(k, spec.options.dtype), precision.round_to(v, spec.options.dtype)
    with np.errstate(invalid="ignore"):
        v_bad = ~np.isfinite(v).all(axis=1) if v.size else np.zeros(v.shape[0], np.bool_)
    return Operands(k, v, v_bad)


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
    dt = native_dtype(spec, emulate)
    native = dt is not None
    wd = dt if dt is not None else np.dtype(np.float64)
    D = o.dtype if emulate else "float64"
    acc = o.accumulate if D != "float64" else "float64"
    sm = o.softmax_dtype if D != "float64" else "float64"
    LD = o.logits_dtype if D != "float64" else "float64"

    def r(x: F64) -> F64:
        return x if native else precision.round_to(x, D)

    def rl(x: F64) -> F64:  # scores and logits: in --logits-dtype (the format by default)
        return x if native else precision.round_to(x, LD)

    def mm(a: F64, b: F64) -> F64:
        return np.matmul(a, b) if native else precision.matmul(a, b, acc)

    ops = inputs or operands(spec, lead_index, emulate)
    q = r(np.asarray(spec.q[spec.operand_index("q", lead_index)][rows], dtype=wd))
    k, v = ops.k[keys], ops.v[keys]
    factor = spec.scale / o.temperature

    # Non-finite inputs are reported by the diagnostics, not warned about by numpy.
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        if o.prescale:
            # Q and K each scaled by √scale first (ONNX's reference does this against
            # overflow): the raw product is already the scaled logits.
            root = math.sqrt(factor)
            raw = rl(mm(r(q * wd.type(root)), r(k * wd.type(root)).T))
            scaled = raw
        else:
            raw = rl(mm(q, k.T))
            scaled = rl(raw * wd.type(factor))
        logits = scaled
        capped = None
        if o.softcap is not None:
            capped = rl(o.softcap * np.tanh(scaled / wd.type(o.softcap)))
            logits = capped
        biased = None
        if spec.bias is not None or o.alibi:
            biased = logits.copy()
            if spec.bias is not None:
                bias = spec.bias[spec.operand_index("bias", lead_index)]
                biased += r(np.asarray(_part(bias, rows, keys), dtype=wd))
            if o.alibi:
                h = lead_index[-1] if lead_index else 0
                slope = float(spec.alibi_slopes[h])
                biased += masks.alibi(rows.start, rows.stop, spec.L, spec.S, slope, keys).astype(wd)
            biased = rl(biased)
            logits = biased

        visible = visibility(spec, lead_index, rows, keys)
        masked = logits
        if spec.mask is not None and not spec.mask_is_bool:
            additive = spec.mask[spec.operand_index("mask", lead_index)]
            masked = rl(masked + r(np.asarray(_part(additive, rows, keys), dtype=wd)))
        if visible is not None:
            # −1e9 is −inf in float16: the mask value is stored in the format too. float8
            # e4m3fn has no inf (−inf becomes NaN there): its hidden logits stay −inf.
            hidden_value = float(rl(np.asarray(o.effective_mask_value)))
            masked = masked.copy() if masked is logits else masked
            masked[~visible] = -math.inf if math.isnan(hidden_value) else hidden_value

        weights = r(softmax(masked, sm, native=native))
        dropped = None
        if o.dropout > 0:
            keep = dropout_keep(spec, lead_index, rows, keys)
            dropped = r(np.where(keep, weights / wd.type(1.0 - o.dropout), wd.type(0.0)))
        output = r(mm(weights if dropped is None else dropped, v))
        if keys.stop - keys.start < spec.S and ops.v_bad.any():
            # A dense kernel multiplies the keys this block skips by their zero weight:
            # 0 · NaN (or inf) in V is NaN, and the output shows it.
            outside = ops.v_bad.copy()
            outside[keys] = False
            if outside.any():
                output = output + wd.type(0.0) * ops.v[outside].sum(axis=0)

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
    )


def softmax(logits: F64, dtype: str = "float64", *, native: bool = False) -> F64:
    """Row softmax over the last axis, max-subtracted, computed in the format ``dtype``
    (``native``: in the dtype of ``logits`` itself, float64 or float32).

    A row whose logits are all −inf (no visible key) gets zero weights, as PyTorch's
    safe softmax, FlashAttention and ONNX return; a finite mask value keeps such a
    row uniform, as kernels that mask with −1e9 or finfo.min do.
    """

    def r(x: F64) -> F64:
        return x if native else precision.round_to(x, dtype)

    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        # initial=−inf keeps an empty key axis (S = 0) valid; NaN still propagates.
        m = np.max(logits, axis=-1, keepdims=True, initial=-math.inf)
        # Subtracting the row max keeps exp ≤ 1 (no overflow); an all −inf row subtracts 0.
        x = r(logits - np.where(m == -math.inf, 0.0, m).astype(logits.dtype))
        floor = DENORMAL_FLOOR.get(x.dtype)
        if floor is not None and x.size and np.min(x) < floor:
            np.copyto(x, -math.inf, where=x < floor)  # see DENORMAL_FLOOR
        e = r(np.exp(x, out=x))
        total = e.sum(axis=-1, keepdims=True) if native else precision.row_sum(e, dtype)
        total = np.where(total == 0.0, 1.0, total).astype(e.dtype)
        return r(np.divide(e, total, out=e))


@dataclass(frozen=True)
class Trace:
    """Every stage of the computation, as whole arrays.

    Score-shaped stages are ``(*lead, L, S)``, ``output`` is ``(*lead, L, Ev)``.
    Stages that the options do not bring about (``capped``, ``biased``, ``dropped``)
    and stages not asked for are ``None``. With ``--dtype`` the stages are the
    emulated values. ``visible`` (which keys each row may see) is kept beside
    score-shaped stages only. ``stats`` holds the per-row and per-stage statistics of
    every block, gathered as it was computed, for the diagnostics.
    """

    spec: AttentionSpec
    raw: F64 | None
    scaled: F64 | None
    capped: F64 | None
    biased: F64 | None
    masked: F64 | None
    visible: NDArray[np.bool_] | None
    weights: F64 | None
    dropped: F64 | None
    output: F64 | None
    stats: Stats
    summaries: Mapping[str, Moments] = field(default_factory=dict)
    """Per stage asked to be summarised: range, mean and non-finite count of its
    visible values over the whole tensor (gathered block by block)."""

    def stage(self, name: str) -> F64 | None:
        return getattr(self, name)  # type: ignore[no-any-return]

    @property
    def merged_output(self) -> F64 | None:
        """The output with heads merged back, ``(..., L, heads · Ev)``, under ``--heads``."""
        return None if self.output is None else merge_heads(self.spec, self.output)


def merge_heads(spec: AttentionSpec, output: F64) -> F64:
    """An output ``(..., heads, L, Ev)`` as returned, ``(..., L, heads · Ev)``, under
    ``--heads`` (as it is otherwise)."""
    if spec.options.heads is None:
        return output
    return np.moveaxis(output, -3, -2).reshape(spec.merged_output_shape)


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


ROW_STATS_BYTES = 64
"""What the statistics keep per query row (a few float64 and int64 arrays)."""


def _check_fits(spec: AttentionSpec, keep: set[str]) -> None:
    """Refuse, before allocating, a trace that cannot fit in memory (rather than be killed)."""
    scores = math.prod(spec.weights_shape)
    need = scores if keep - {"output"} else 0  # the boolean visibility
    need += ROW_STATS_BYTES * math.prod((*spec.lead, spec.L))  # always gathered
    need += sum(8 * (math.prod(spec.output_shape) if s == "output" else scores) for s in keep)
    available = available_memory()
    if available is not None and need > available:
        gib = 2.0**30
        raise SpecError(
            f"scores {spec.weights_shape}",
            f"keeping {len(keep)} stage(s) whole in float64, with the per-row statistics, "
            f"needs {need / gib:.1f} GiB, but {available / gib:.1f} GiB of memory is "
            "available; ask for fewer --stages, or slice the inputs",
        )


class SliceInputs:
    """K and V per slice, converted once and shared by the blocks (and threads) that
    need them; only the most recent few slices are kept."""

    def __init__(self, keep: int = 2) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[Any, ...], Operands] = OrderedDict()

    def get(self, spec: AttentionSpec, lead: tuple[int, ...], emulate: bool = True) -> Operands:
        key = (id(spec), spec.operand_index("k", lead), spec.operand_index("v", lead), emulate)
        with self._lock:
            found = self._cache.get(key)
            if found is None:
                found = operands(spec, lead, emulate)
                self._cache[key] = found
                while len(self._cache) > self._keep:
                    self._cache.popitem(last=False)
            return found


def float64_twin(spec: AttentionSpec, block: Block, cache: SliceInputs) -> Block:
    """The float64 block an emulated block's statistics are read against: what *would*
    overflow or flush comes from exact values (the block itself when not emulated)."""
    if not spec.options.emulated:
        return block
    lead = block.lead_index
    inputs = cache.get(spec, lead, emulate=False)
    return attend_block(spec, lead, block.rows, emulate=False, keys=block.keys, inputs=inputs)


Progress = Callable[[int], None]
"""Told the number of scores done after each block."""


def sweep(
    spec: AttentionSpec,
    visit: Callable[[tuple[int, ...], slice], T],
    *,
    jobs: int = 1,
    rows: int | None = None,
    progress: Progress | None = None,
) -> Iterator[T]:
    """``visit(lead, rows)`` for every block, on ``jobs`` threads, results in block order.

    numpy releases the GIL in matmuls and ufuncs, so threads share the work; at most
    two blocks per thread are in flight, which bounds the memory. With ``jobs`` = 1
    everything runs in the calling thread.
    """

    def done(r: slice, result: T) -> T:
        if progress is not None:
            progress((r.stop - r.start) * max(spec.S, 1))
        return result

    if jobs <= 1:
        for lead, r in iter_blocks(spec, rows):
            yield done(r, visit(lead, r))
        return
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="sdpa") as pool:
        pending: deque[tuple[slice, Future[T]]] = deque()
        try:
            for lead, r in iter_blocks(spec, rows):
                pending.append((r, pool.submit(visit, lead, r)))
                if len(pending) >= 2 * jobs:
                    r0, future = pending.popleft()
                    yield done(r0, future.result())
            while pending:
                r0, future = pending.popleft()
                yield done(r0, future.result())
        finally:
            for _, future in pending:
                future.cancel()


def trace(
    spec: AttentionSpec,
    stages: tuple[str, ...] | None = None,
    rows: int | None = None,
    *,
    gather_stats: bool = True,
    summarize: tuple[str, ...] = (),
    jobs: int = 1,
    progress: Progress | None = None,
) -> Trace:
    """Run the engine over every block and keep the stages asked for (default: all).

    Statistics for the diagnostics are gathered from every block as it is computed.
    With ``--dtype`` each block is computed twice, emulated (kept) and in float64
    (compared against, then dropped). With no stage kept, nothing score-sized
    outlives its block, and keys hidden from a whole block (causal, window,
    padding) are not computed at all.

    Args:
        spec: the validated computation.
        stages: names from :data:`STAGES` to keep; the others are not stored.
        rows: query rows per block (default :func:`block_rows`); any value gives the
            same numbers to rounding.
        gather_stats: False for a trace used only for its values (a reference to
            compare against): no statistics, no float64 twin of an emulated block.
        summarize: stages whose whole-tensor range is gathered (kept or not).
        jobs: threads computing blocks.
        progress: told the scores done after each block.
    """
    from sdpa_cli.engine.stats import (  # they read Block: imported here, not at the top
        Moments,
        Stats,
    )

    keep = set(applicable_stages(spec) if stages is None else stages) & set(applicable_stages(spec))
    ws, os_ = spec.weights_shape, spec.output_shape
    _check_fits(spec, keep)
    arrays: dict[str, Any] = {
        s: np.empty(os_ if s == "output" else ws, dtype=np.float64) for s in STAGES if s in keep
    }
    visible = np.empty(ws, dtype=np.bool_) if keep - {"output"} else None
    stats = Stats.empty(spec)
    cache = SliceInputs(keep=jobs + 1)

    summaries = {s: Moments() for s in summarize if s in applicable_stages(spec)}

    def visit(lead_index: tuple[int, ...], r: slice) -> Any:
        # Score-shaped stages are kept whole, every key of them; otherwise only the
        # keys a block can see are computed (the output is the same either way).
        keys = None if visible is not None else key_range(spec, lead_index, r)
        block = attend_block(spec, lead_index, r, keys=keys, inputs=cache.get(spec, lead_index))
        records = None
        if gather_stats:
            records = stats.measure(block, float64_twin(spec, block, cache))
        seen = {s: Moments() for s in summaries}
        for name, moments in seen.items():
            moments.add(getattr(block, name), None if name == "output" else block.visible)
        at: tuple[int | slice, ...] = (*lead_index, r)
        if visible is not None:
            visible[at] = block.visible
        for name, arr in arrays.items():
            arr[at] = getattr(block, name)
        return records, seen

    for records, seen in sweep(spec, visit, jobs=jobs, rows=rows, progress=progress):
        if records is not None:
            stats.merge(records)
        for name, moments in seen.items():
            summaries[name].merge(moments)
    if gather_stats:
        stats.add_all_moments()
    return Trace(
        spec=spec,
        visible=visible,
        stats=stats,
        summaries=summaries,
        **{s: arrays.get(s) for s in STAGES},
    )


def shown_blocks(
    spec: AttentionSpec, positions: list[tuple[int, ...]], rows: range
) -> dict[tuple[int, ...], Block]:
    """What a table shows: query rows ``rows`` of each slice at ``positions``, every key."""
    return {lead: attend_block(spec, lead, slice(rows.start, rows.stop)) for lead in positions}
