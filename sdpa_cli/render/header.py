"""The header panel every command's view opens with: shapes, dims, the scale, and
every option that changed the computation (masks, bias, dropout, emulated dtype)."""

from __future__ import annotations

from rich import box
from rich.console import RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from sdpa_cli.engine.conventions import convention
from sdpa_cli.engine.descales import Descales
from sdpa_cli.engine.fp8 import FP8_OUTPUT, runs_fp8
from sdpa_cli.engine.masks import HIDES
from sdpa_cli.engine.positions import item_offsets
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.names import DESCALES
from sdpa_cli.render.common import THEME
from sdpa_cli.text import plural, shape, sig


def header(spec: AttentionSpec, title: str = "sdpa compute") -> RenderableType:
    """Shapes, the scale and every option that changed the computation."""
    o = spec.options
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style=THEME["label"], no_wrap=True)
    grid.add_column(overflow="fold")
    names = spec.names
    for n in ("q", "k", "v", "bias", "mask"):
        if n not in spec.shapes or (n in ("bias", "mask")):
            continue
        source = names.get(n, "")
        origin = f"  {source}" if source and ": " not in source and source != n.upper() else ""
        grid.add_row(n.upper(), Text(f"{shape(spec.shapes[n])}{origin}"))
    queries = "query" if spec.L == 1 else "queries"
    keys = "key" if spec.S == 1 else "keys"
    dims = f"L = {spec.L} {queries}, S = {spec.S} {keys}, E = {spec.E}, Ev = {spec.Ev}"
    if o.heads is not None:
        dims += f", split into {o.heads} heads"
        if o.kv_heads is not None:
            dims += f" (K and V into {o.kv_heads})"
    if spec.group > 1:
        dims += f", grouped-query: {spec.H} query heads share {spec.H // spec.group} kv heads"
    grid.add_row("dims", Text(dims))
    if spec.qv_width:
        width = spec.E - spec.qv_width
        rule = f"scores Q·Kᵀ + qv·Vᵀ (E = {width} + {spec.qv_width})"
        grid.add_row("qv", Text(f"{spec.names.get('qv', '--qv')}: {rule}"))
    if (paging := spec.paging) is not None:
        pages = f"{plural(paging.num_pages, 'page')} of {plural(paging.page_size, 'key')}"
        shared = f"; {plural(paging.prefix_pages, 'page')} shared as a prefix"
        grid.add_row(
            "paged",
            Text(
                f"K and V gathered from {pages} by the block table {paging.label} "
                f"{shape(paging.table.shape)}" + (shared if paging.prefix_pages else "")
            ),
        )
    if o.framework is not None:
        grid.add_row("as", Text(f"{o.framework} ({convention(o.framework).title})"))
    if o.layout == "bshd":
        grid.add_row(
            "layout",
            Text("bshd: Q, K, V read as (…, L, H, E), the output returned so; scores (…, H, L, S)"),
        )
    grid.add_row(
        "scores", Text(f"{shape(spec.weights_shape)}   output {shape(spec.merged_output_shape)}")
    )
    scale = spec.scale_label
    if o.temperature != 1:
        scale += f", temperature {sig(o.temperature, 6)} (effective {sig(spec.scale / o.temperature, 6)})"
    grid.add_row("scale", Text(scale))
    if o.softcap is not None:
        grid.add_row("softcap", Text(f"{sig(o.softcap, 6)} · tanh(scaled / {sig(o.softcap, 6)})"))
    if o.score_mod is not None:
        grid.add_row("score-mod", Text(f"{o.score_mod} (score: the scaled score)"))
    if spec.bias is not None:
        grid.add_row("bias", Text(f"{names.get('bias', 'bias')} {shape(spec.shapes['bias'])}"))
    if spec.sinks is not None:
        logits = ", ".join(sig(float(x)) for x in spec.sinks[:8]) + (
            ", …" if spec.sinks.size > 8 else ""
        )
        grid.add_row("sinks", Text(f"one softmax column per head (gpt-oss), logits {logits}"))
    if o.alibi:
        shown = spec.alibi_slopes[:8]
        slopes = ", ".join(sig(s) for s in shown) + (", …" if spec.H > 8 else "")
        grid.add_row("ALiBi", Text(f"−slope_h · |i + S − L − j|, slopes {slopes}"))
    for label, text in mask_lines(spec):
        grid.add_row(label, Text(text))
    if o.dropout:
        grid.add_row(
            "dropout",
            Text(
                f"p = {sig(o.dropout, 6)}, "
                + (
                    "keep mask --dropout-mask"
                    if spec.dropout_mask is not None
                    else f"seed {o.seed}"
                )
                + f": kept weights ÷ {sig(1 - o.dropout, 6)}"
            ),
        )
    if spec.descale is not None:
        grid.add_row("descale", Text(descale_line(spec.descale)))
    if o.emulated:
        stored = (
            "every stage stored in " + o.dtype
            if o.logits_dtype == o.dtype
            else f"logits stored in {o.logits_dtype}, weights and output in {o.dtype}"
        )
        how = f"emulated: inputs and {stored}, matmuls accumulated in {o.accumulate}, softmax in {o.softmax_dtype}"
        grid.add_row("dtype", Text(fp8_kernel(spec) if runs_fp8(spec) else how))
    if o.prescale:
        grid.add_row("prescale", Text("Q and K each × √scale before the matmul: raw = scaled"))
    return Panel(grid, title=title, title_align="left", box=box.ROUNDED, expand=False)


def descale_line(descales: Descales) -> str:
    """The descales as given (a number, or a file and its shape) and what they mean."""
    parts = []
    for name in DESCALES:
        given = descales.given.get(name)
        if given is None:
            parts.append(f"{name} 1")
        elif given.size == 1:
            parts.append(f"{name} {sig(float(given.reshape(())), 6)}")
        else:
            parts.append(f"{name} {descales.labels[name]} {shape(given.shape)}")
    return f"{', '.join(parts)}: Q, K, V hold {descales.fmt} values, the real ones × these"


def fp8_kernel(spec: AttentionSpec) -> str:
    """How the FP8 kernel computes (engine/fp8.py), in one line."""
    o = spec.options
    return (
        f"FlashAttention-3's FP8 forward: Q·Kᵀ of the {o.dtype} values accumulated in "
        f"{o.accumulate}, × scale · q_descale · k_descale; softmax in {o.softmax_dtype}; "
        f"P = exp(S − max) rounded to {o.dtype} before P·V, the row sums the unrounded P's; "
        f"O = P·V ÷ row sum × v_descale, stored in {FP8_OUTPUT}"
    )


_RULES = {
    "upper-left": "j ≤ i",
    "lower-right": "j ≤ i + S − L",
    "lower-right-per-item": "j ≤ i + S_b − L_b",
}


def mask_lines(spec: AttentionSpec) -> list[tuple[str, str]]:
    """One line per mask, plus the alignment and mask value when they matter."""
    o = spec.options
    lines: list[tuple[str, str]] = []
    aligned = o.placed
    if o.causal:
        rule = _RULES[o.causal_align]
        if o.query_offset is not None:
            lines.append(("causal", "j ≤ i + N (N: the query offset)"))
        elif o.cu_seqlens is not None:
            lines.append(("causal", f"{o.causal_align}, within each document"))
        else:
            lines.append(("causal", f"{o.causal_align} ({rule})"))
    typed = o.window_as_typed
    if o.window is not None and typed is not None:
        left, right = o.window
        rule = f"{left} left, {right} right (−{left} ≤ j − i − offset ≤ {right})"
        if typed != (left, right):  # --as hf: its window counts the query
            rule = f"{typed[0]},{typed[1]} as {o.framework} counts it (with the query): {rule}"
        lines.append(("window", rule))
    if o.mask_mod is not None:
        lines.append(("mask-mod", f"{o.mask_mod} (False hides the key)"))
    if o.query_offset is not None and (aligned or o.alibi):
        per = "per batch item" if len(o.query_offset) > 1 else "every item"
        offsets = ", ".join(str(n) for n in o.query_offset)
        lines.append(("query offset", f"query 0 at position {offsets} ({per}; query i at N + i)"))
    elif aligned and o.cu_seqlens is None and (spec.L != spec.S or any(item_offsets(spec))):
        placed = item_offsets(spec)
        one = len(set(placed)) == 1
        shown_offsets = str(placed[0]) if one else ", ".join(str(n) for n in placed)
        where = "L ≠ S: " if spec.L != spec.S else ""
        offset = "diagonal offset" if one else "offsets per item"
        lines.append(("alignment", f"{where}{o.causal_align}, {offset} {shown_offsets}"))
    if o.attention_chunk is not None:
        size = o.attention_chunk
        lines.append(("chunks", f"of {size} positions: a query sees only its own chunk's keys"))
    if o.cu_seqlens is not None:
        cu = ",".join(str(n) for n in o.cu_seqlens)
        docs = f"{len(o.cu_seqlens) - 1} packed, cu_seqlens {cu}"
        if o.cu_seqlens_k is not None:
            docs += f", keys {','.join(str(n) for n in o.cu_seqlens_k)}"
        lines.append(("documents", docs + " (a query sees its own document's keys)"))
    if spec.segment_ids is not None:
        ids = sorted({int(n) for part in spec.segment_ids for n in part.ravel()})
        shown_ids = ", ".join(str(n) for n in ids[:8]) + (", …" if len(ids) > 8 else "")
        lines.append(("segments", f"ids {shown_ids} (a query sees its own segment's keys)"))
    if o.query_lengths is not None:
        per = "per batch item" if len(o.query_lengths) > 1 else "every item"
        lengths = ", ".join(str(n) for n in o.query_lengths)
        lines.append(("query lengths", f"first {lengths} queries valid ({per}; later rows zero)"))
    if o.key_lengths is not None:
        per = "per batch item" if len(o.key_lengths) > 1 else "every item"
        lengths = ", ".join(str(n) for n in o.key_lengths)
        lines.append(("key lengths", f"first {lengths} keys valid ({per}; the rest is padding)"))
    if spec.mask is not None:
        kind = "boolean, True = " + ("masked" if o.mask_true_means == "masked" else "may attend")
        if spec.mask_kind == "float":
            kind = "float, added to the logits"
        elif spec.mask_kind == "integer":
            kind = (
                f"integer ({spec.mask.dtype}), its numbers added to the logits, not read as boolean"
            )
        lines.append(
            ("mask", f"{spec.names.get('mask', 'mask')} {shape(spec.shapes['mask'])}, {kind}")
        )
        if spec.sentinels and spec.sentinels.values:
            hiding = f"{spec.sentinels.label()} read as hiding (any value ≤ {HIDES:g})"
            lines.append((f"{spec.mask_kind} mask", hiding))
    if lines:
        lines.append(("mask value", o.mask_value_label))
    return lines
