"""The computations a kernel may have done instead of the one asked for: the slips a
kernel or a port most often makes, one at a time, each only where it applies. The
options a user may change (the scale, causal or not, the alignment, the mask's
polarity, the padding, the bias, the window by one, the temperature), a kernel's own
bugs (a causal mask transposed or inverted, a square mask transposed, packed
documents leaking), and the tensors read another way (K/V heads tiled, another
layout, an LSE in base 2, a (B, S) mask, the bias inside the softcap).

:mod:`~sdpa_cli.check.hints` tries them on a failed comparison and names the one the
export matches.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.check.exports import EXPORT_STAGES, as_reference, tensor_values
from sdpa_cli.engine import masks, positions
from sdpa_cli.engine.block import dropout_keep, softmax, softmax_lse, visibility
from sdpa_cli.engine.fp8 import descale_slips
from sdpa_cli.engine.options import scale_factor
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.engine.trace import Trace, merge_heads, trace
from sdpa_cli.engine.types import F64, Index
from sdpa_cli.errors import SpecError
from sdpa_cli.text import sig

Values = Callable[[str, bool], "F64 | None"]
"""An alternative's values of an export (``output``, ``weights``, ``lse``; heads merged
or not), in the file's layout; None where the alternative says nothing about it."""


@dataclass(frozen=True)
class Alternative:
    """A computation a kernel may have done instead: ``label`` names the fix in the
    user's terms, ``hint`` is the sentence a failed check gets."""

    label: str
    hint: str
    values: Values
    spec: AttentionSpec | None = None
    """The computation itself, where the slip is one of options or of the kernel (a
    page draws its mask beside the one asked for)."""


def _option(label: str) -> str:
    return f"the export matches the computation with {label}: the kernel and these options disagree on it"


def _traced(
    spec: AttentionSpec,
    ref_format: str,
    view: Callable[[F64], F64] | None = None,
    viewed: str = "output",
    leads: Sequence[Index] | None = None,
) -> Values:
    """The values of ``spec`` in the reference's format, traced on first use of each
    export (``leads``: those slices only, NaN elsewhere), only the stages that export
    reads: an output's alternative holds output-sized arrays, not (L, S) ones (a
    failing (1, 2, 8192, 64) check held 2.4 GiB of score-sized stages for it). With
    ``view``, the export ``viewed`` only (in the engine's layout), read through it (the
    others: None)."""
    runs: dict[tuple[str, ...], Trace] = {}

    def values(name: str, merged: bool) -> F64 | None:
        if view is not None and (name != viewed or merged):
            return None
        stages = EXPORT_STAGES[name]
        run = next((r for s, r in runs.items() if set(stages) <= set(s)), None)
        if run is None:
            reference = as_reference(spec, ref_format)
            run = runs[stages] = trace(reference, stages, gather_stats=False, leads=leads)
        got = tensor_values(run, name, merged)
        return got if view is None else view(got)

    return values


def alternatives(
    spec: AttentionSpec, ref_format: str, leads: Sequence[Index] | None = None
) -> Iterator[Alternative]:
    """The computation under the slips a kernel most often makes, one at a time, each
    only where it applies: the options first, then the tensors read another way.
    With ``leads``, computed on those (batch, head) slices only (a large case), and
    only the alternatives whose slices are the case's own."""
    for label, alt in _option_alternatives(spec):
        yield Alternative(label, _option(label), _traced(alt, ref_format, leads=leads), alt)
    for label, alt in _kernel_slips(spec):
        hint = f"the export matches the computation with {label}: a bug in the kernel"
        yield Alternative(label, hint, _traced(alt, ref_format, leads=leads), alt)
    yield from _tensor_alternatives(spec, ref_format, leads)


def _option_alternatives(spec: AttentionSpec) -> Iterator[tuple[str, AttentionSpec]]:
    """The options a kernel most often disagrees with: the scale, causal or not, the
    causal alignment, the mask's polarity, the padding, the bias, the window by one."""
    o = spec.options

    def alt(**changes: Any) -> AttentionSpec:
        return dataclasses.replace(spec, options=dataclasses.replace(o, **changes))

    standard = math.isclose(spec.scale, scale_factor("sqrt-dk", spec.E))
    slips = {"dk": ": 1/√E applied twice", "none": ": the scale omitted"} if standard else {}
    for rule, what in (("dk", "1/E"), ("sqrt-dk", "1/√E"), ("none", "1")):
        if o.scale != rule and not math.isclose(spec.scale, scale_factor(rule, spec.E)):
            yield f"--scale {rule} (scale {what}{slips.get(rule, '')})", spec.with_scale(rule)
    yield ("--no-causal" if o.causal else "--causal"), alt(causal=not o.causal)
    if o.temperature != 1.0:
        t = sig(o.temperature, 6)
        yield f"no --temperature (the scores not divided by {t})", alt(temperature=1.0)
        yield (
            f"--temperature {sig(1.0 / o.temperature, 6)} (the scores multiplied by {t}, not divided)",
            alt(temperature=1.0 / o.temperature),
        )
    if o.placed and o.query_offset is None:
        placed = positions.item_offsets(spec)
        for other in ("upper-left", "lower-right"):
            if other != o.causal_align and positions.item_offsets(spec, other) != placed:
                yield f"--causal-align {other}", alt(causal_align=other)
    yield from _offset_alternatives(spec, alt)
    if o.attention_chunk is not None:
        yield "no --attention-chunk (every chunk's keys seen)", alt(attention_chunk=None)
    if spec.mask_is_bool:
        other = "masked" if o.mask_true_means == "attend" else "attend"
        yield f"--mask-true-means {other}", alt(mask_true_means=other)
    if o.key_lengths is not None:
        yield "no --key-lengths (padding keys attended)", alt(key_lengths=None)
    if spec.bias is not None:
        yield "no --bias (the bias left out)", dataclasses.replace(spec, bias=None)
    if spec.sinks is not None:
        yield (
            "no --sinks (the sinks left out of every row's softmax)",
            dataclasses.replace(spec, sinks=None),
        )
    if o.window is not None:
        for window, why in _windows(*o.window):
            left, right = o.typed_window(window)  # in the terms the user typed it
            yield f"--window {left},{right} ({why})", alt(window=window)


def _kernel_slips(spec: AttentionSpec) -> Iterator[tuple[str, AttentionSpec]]:
    """Computations no option asks for, which a kernel's bug makes: the causal mask
    built the wrong way round, the packed documents' boundaries ignored."""
    yield from _flipped_causal(spec)
    yield from descale_slips(spec)  # an FP8 kernel's descales misapplied
    mask = spec.mask
    if (
        mask is not None
        and mask.ndim >= 2
        and mask.shape[-2:] == (spec.L, spec.L) == (spec.L, spec.S)
    ):
        yield (
            "the mask transposed (mask[..., j, i]: keys and queries swapped)",
            dataclasses.replace(spec, mask=np.swapaxes(mask, -1, -2)),
        )
    if spec.segment_ids is not None:
        yield (
            "the segment ids ignored (attention leaks across the packed documents)",
            dataclasses.replace(spec, segment_ids=None),
        )
    if spec.options.cu_seqlens is not None:
        yield (
            "--cu-seqlens ignored (attention leaks across the packed documents)",
            dataclasses.replace(
                spec,
                options=dataclasses.replace(spec.options, cu_seqlens=None, cu_seqlens_k=None),
            ),
        )


def _flipped_causal(spec: AttentionSpec) -> Iterator[tuple[str, AttentionSpec]]:
    """The causal mask built the wrong way round, as a boolean mask file would carry it
    (only without a mask, a window or a per-item offset of the user's own): transposed
    (``triu`` where ``tril`` was meant: each query sees itself and the keys after it)
    and inverted (``~tril``: the keys after it only)."""
    o = spec.options
    if not o.causal or spec.mask is not None or o.window is not None:
        return
    offsets = positions.item_offsets(spec)
    if o.query_offset is not None or len(set(offsets)) > 1:
        return
    L, S = spec.L, spec.S
    diagonal = offsets[0]
    rows, keys = np.arange(L)[:, None], np.arange(S)[None, :]
    slips = (
        (
            "transposed (torch.triu where torch.tril was meant: each query sees itself and the keys after it)",
            keys >= rows + diagonal,
        ),
        ("inverted (~tril: each query sees only the keys after it)", keys > rows + diagonal),
    )
    for what, visible in slips:
        yield (
            f"the causal mask {what}",
            dataclasses.replace(
                spec,
                mask=visible.reshape((1,) * len(spec.lead) + (L, S)),
                options=dataclasses.replace(o, causal=False, mask_true_means="attend"),
            ),
        )


def _offset_alternatives(
    spec: AttentionSpec, alt: Callable[..., AttentionSpec]
) -> Iterator[tuple[str, AttentionSpec]]:
    """A KV-cache step placed by the global alignment instead of each item's cache
    length, or the other way: with padded keys, each item's new queries most often
    end at its key length (offset = key length − L: ``lower-right-per-item``)."""
    o = spec.options
    if not (o.placed or o.alibi):
        return
    if o.query_offset is not None:
        yield (
            "no --query-offset (--causal-align lower-right: offset S − L for every item)",
            alt(query_offset=None, causal_align="lower-right"),
        )
        return
    per_item = "lower-right-per-item"
    if o.causal_align == per_item or (o.key_lengths is None and o.query_lengths is None):
        return
    offsets = positions.item_offsets(spec, per_item)
    if offsets != positions.item_offsets(spec):
        shown_offsets = ",".join(str(n) for n in offsets)
        yield (
            f"--causal-align {per_item} (each item's queries end at its key length: "
            f"--query-offset {shown_offsets})",
            alt(causal_align=per_item),
        )


def _windows(left: int, right: int) -> Iterator[tuple[tuple[int, int], str]]:
    """A window one key narrower or wider on each side (the right side only when it
    has keys): the off-by-one of ports between libraries that count it differently."""
    if left > 0:
        yield (
            (left - 1, right),
            "one key fewer on the left: Hugging Face's sliding_window counts the query itself",
        )
    yield (
        (left + 1, right),
        "one key more on the left: FlashAttention's window_size leaves the query itself out",
    )
    if right > 0:
        yield (left, right - 1), "one key fewer on the right"
        yield (left, right + 1), "one key more on the right"


def _tensor_alternatives(
    spec: AttentionSpec, ref_format: str, leads: Sequence[Index] | None = None
) -> Iterator[Alternative]:
    """The tensors read another way: K/V heads tiled, (B, L, H, E) read as (B, H, L, E),
    an LSE in base 2, a (B, S) mask read as (L, S), the bias added before the softcap.
    With ``leads``, those whose slices are the case's own, on those slices."""
    if spec.group > 1:
        label = "K/V heads tiled (head h uses K/V head h mod G) instead of interleaved (h div r)"
        hint = (
            f"the export matches the computation with {label}: the kernel expands K and V "
            "with repeat (tiling); sdpa, like PyTorch's enable_gqa, with repeat_interleave"
        )
        yield Alternative(label, hint, _traced(_tiled_heads(spec), ref_format, leads=leads))
    label = "the LSE is in base 2 (log₂ Σ eˣ, as FlashAttention's kernels keep it inside): multiply it by ln 2"
    hint = f"{label}; the export matches the natural-log LSE divided by ln 2"
    yield Alternative(label, hint, _traced(spec, ref_format, _base_two, "lse", leads))
    if leads is not None:
        return
    transposed = _transposed(spec)
    if transposed is not None:
        label = (
            "Q, K, V and the output look like (B, L, H, E) (FlashAttention's layout): "
            "pass --layout bshd"
        )
        hint = f"{label}; the export matches the computation on them transposed"
        yield Alternative(label, hint, _traced(transposed, ref_format, _swap_middle))
    padding = _key_padding_mask(spec)
    if padding is not None:
        label = "the mask is a (B, S) key-padding mask: give it as (B, 1, 1, S)"
        hint = f"{label}; the export matches the computation with it so"
        yield Alternative(label, hint, _traced(padding, ref_format))
    if spec.options.softcap is not None and spec.bias is not None:
        label = (
            "the bias was added before the softcap (softcap(QKᵀ·scale + bias)); sdpa adds it after"
        )
        hint = f"{label}: the export matches the computation in that order"
        yield Alternative(label, hint, _bias_before_softcap(spec))


def _base_two(lse: F64) -> F64:
    """A natural-log LSE as log₂: ``lse / ln 2``."""
    out: F64 = lse / math.log(2.0)
    return out


def _swap_middle(values: F64) -> F64:
    """(B, H, L, Ev) ↔ (B, L, H, Ev)."""
    return np.swapaxes(values, 1, 2)


def _tiled_heads(spec: AttentionSpec) -> AttentionSpec:
    """K and V expanded to the H query heads, head h taking K/V head h mod G (torch's
    ``k.repeat(1, r, 1, 1)``), where the engine reads head h // r (``repeat_interleave``)."""
    G = spec.H // spec.group
    heads = np.arange(spec.H) % G

    def tiled(a: NDArray[Any]) -> NDArray[Any]:
        return a if a.shape[-3] == 1 else np.take(a, heads, axis=-3)

    return dataclasses.replace(spec, k=tiled(spec.k), v=tiled(spec.v), group=1)


def _transposed(spec: AttentionSpec) -> AttentionSpec | None:
    """The computation on Q, K and V with axes 1 and 2 swapped, when all three were
    given 4-D, without --heads, a bias or a mask (whose axes would need reading
    anew), and the swapped computation has the output's shape swapped."""
    o = spec.options
    if o.heads is not None or spec.bias is not None or spec.mask is not None:
        return None
    if o.layout != "bhsd" or any(len(spec.shapes.get(n, ())) != 4 for n in ("q", "k", "v")):
        return None
    try:
        swapped = build_spec(
            *(np.swapaxes(a, 1, 2) for a in (spec.q, spec.k, spec.v)),
            options=o,
            names=spec.names,
        )
    except SpecError:  # the shapes do not fit that reading: no hint
        return None
    B, H, L, Ev = swapped.output_shape
    return swapped if (B, L, H, Ev) == spec.output_shape else None


def _key_padding_mask(spec: AttentionSpec) -> AttentionSpec | None:
    """A 2-D mask (boolean or additive) given as (B, S), which broadcasting read as
    (L, S) (L = B), as the key-padding mask (B, 1, 1, S) it is."""
    if spec.mask is None or len(spec.lead) < 2:
        return None
    B, S = spec.lead[-2], spec.S
    if B < 2 or spec.shapes.get("mask") != (B, S):
        return None
    shape = (1,) * (len(spec.lead) - 2) + (B, 1, 1, S)
    return dataclasses.replace(spec, mask=spec.mask.reshape(shape))


def _bias_before_softcap(spec: AttentionSpec) -> Values:
    """softmax(C·tanh((Q Kᵀ·scale + bias) / C) + ALiBi + masks)·V in float64, the
    bias inside the softcap: straight numpy, slice by slice (a hint's case is small)."""
    found: dict[str, F64] = {}

    def values(name: str, merged: bool) -> F64 | None:
        if not found:
            found.update(_capped_bias_run(spec))
        got = found[name]
        return merge_heads(spec, got) if name == "output" and merged else got

    return values


def _capped_bias_run(spec: AttentionSpec) -> dict[str, F64]:
    """:func:`_bias_before_softcap`'s output, weights and LSE, every slice."""
    o = spec.options
    assert o.softcap is not None
    assert spec.bias is not None
    L, S = spec.L, spec.S
    rows, keys = slice(0, L), slice(0, S)
    output = np.empty(spec.output_shape)
    weights = np.empty(spec.weights_shape)
    lse = np.empty((*spec.lead, L))

    def part(name: str, at: tuple[int, ...]) -> F64:
        a = getattr(spec, name)
        return np.asarray(a[spec.operand_index(name, at)], dtype=np.float64)

    # Non-finite inputs are the findings' business; numpy need not warn of them here.
    with np.errstate(all="ignore"):
        for at in np.ndindex(*spec.lead):
            q, k, v = part("q", at), part("k", at), part("v", at)
            logits = (q @ k.T) * spec.factor + part("bias", at)
            logits = o.softcap * np.tanh(logits / o.softcap)
            if o.alibi:
                slope = float(spec.alibi_slopes[at[-1] if at else 0])
                offset = positions.alibi_offset(spec, at)
                logits = logits + masks.alibi(0, L, L, S, slope, offset=offset)
            if spec.mask is not None and not spec.mask_is_bool:
                logits = logits + part("mask", at)
            logits = np.broadcast_to(logits, (L, S))
            visible = visibility(spec, at, rows, keys)
            if visible is not None:
                logits = np.where(visible, logits, o.mask_value_in("float64"))
            w = softmax(np.array(logits), native=True)
            weights[at], lse[at] = w, softmax_lse(logits, w)
            if o.dropout > 0:
                keep = dropout_keep(spec, at, rows, keys)
                w = np.where(keep, w / (1.0 - o.dropout), 0.0)
            output[at] = w @ v
    return {"output": output, "weights": weights, "lse": lse}
