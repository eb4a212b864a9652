"""The computation options every command that computes attention shares: the scale,
masks, dropout, heads, layouts, formats and framework conventions (``--as``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from sdpa_cli.cli.completion import files, words
from sdpa_cli.engine.conventions import CONVENTIONS
from sdpa_cli.names import (
    ALIGNMENTS,
    FORMATS,
    FRAMEWORKS,
    LAYOUTS,
    MASK_TRUE_MEANS,
    MASK_VALUE_NAMES,
    SCALE_NAMES,
)

F = TypeVar("F", bound=Callable[..., Any])


def _conventions_help() -> str:
    """``--as``'s help, read off the conventions: who aligns the causal diagonal where,
    who masks with what, whose window counts the query."""

    def who(names: list[str]) -> str:
        return ", ".join(names)

    aligned = "; ".join(
        f"{who([n for n, c in CONVENTIONS.items() if c.causal_align == a])} {a}" for a in ALIGNMENTS
    )
    finite = [c for c in CONVENTIONS.values() if c.mask_value != "-inf"]
    values = ", ".join(f"{c.name} {c.mask_label}" for c in finite)
    counting = who([n for n, c in CONVENTIONS.items() if c.window_counts_query])
    return (
        "Use a framework's conventions, as defaults flags override: causal alignment "
        f"when L ≠ S ({aligned}), the mask value ({values}, else -inf: a row with no "
        f"visible key gives the mean of V or zeros), --window's LEFT read as {counting}'s "
        "sliding_window (counting the query)."
    )


ATTENTION_OPTIONS: list[Callable[[F], F]] = [
    click.option(
        "--scale",
        metavar="sqrt-dk|dk|none|X",
        shell_complete=words(*SCALE_NAMES),
        help="Factor on Q·Kᵀ: 1/√E (sqrt-dk, default), 1/E (dk), 1 (none) or a number.",
    ),
    click.option("--temperature", metavar="T", help="Divide the scaled scores by T (default 1)."),
    click.option(
        "--softcap",
        metavar="C",
        help="Soft-cap the logits: C·tanh(x/C), as Gemma 2 and FlashAttention.",
    ),
    click.option(
        "--bias",
        "bias_path",
        metavar="FILE",
        shell_complete=files,
        help="Additive bias, broadcastable to (..., L, S).",
    ),
    click.option(
        "--sinks",
        "sinks_path",
        metavar="FILE",
        shell_complete=files,
        help="Attention sinks (gpt-oss): one logit per query head, (H,) or (1,), joining every row's softmax as an extra column that V does not read.",
    ),
    click.option(
        "--qv",
        "qv_path",
        metavar="FILE",
        shell_complete=files,
        help="FlashAttention's qv term (absorbed MLA): Q's shape with V's width; qv·Vᵀ joins the scores, and the default scale is 1/√(E + Ev).",
    ),
    click.option(
        "--segment-ids",
        "segment_ids_path",
        metavar="FILE",
        shell_complete=files,
        help="Segment (document) ids, integers (L,) or (B, L), as JAX's: a query sees only keys of its own id; they serve the keys too unless --segment-ids-kv.",
    ),
    click.option(
        "--segment-ids-kv",
        "segment_ids_kv_path",
        metavar="FILE",
        shell_complete=files,
        help="The keys' segment ids, (S,) or (B, S) (default: --segment-ids).",
    ),
    click.option("--alibi/--no-alibi", default=None, help="Add ALiBi: −slope_h·|i + S − L − j|."),
    click.option("--causal/--no-causal", default=None, help="Hide future keys."),
    click.option(
        "--causal-align",
        type=click.Choice(ALIGNMENTS),
        help="Diagonal of the causal mask, window and chunks when L ≠ S: upper-left (default, as PyTorch is_causal), lower-right (j ≤ i + S − L, every item) or lower-right-per-item (each item's own --key-lengths less --query-lengths, as FlashAttention's seqused_k and ONNX's nonpad_kv_seqlen).",
    ),
    click.option(
        "--mask",
        "mask_path",
        metavar="FILE",
        shell_complete=files,
        help="Boolean mask (True = may attend) or float mask (added to the logits; an integer one is added too, never read as boolean), broadcastable to (..., L, S).",
    ),
    click.option(
        "--mask-true-means",
        type=click.Choice(MASK_TRUE_MEANS),
        help="What True means in a boolean mask (default attend, as PyTorch).",
    ),
    click.option(
        "--key-lengths",
        metavar="N[,N...]",
        help="Valid keys per batch item (the rest is padding), or per packed document (FlashAttention's seqused_k); one number for all.",
    ),
    click.option(
        "--block-table",
        "block_table_path",
        metavar="FILE",
        shell_complete=files,
        help="K and V are a paged cache (vLLM, FlashAttention's flash_attn_with_kvcache): pages (num_pages, page_size, G, E) and this block table (B, max_pages) of page indices; key j of item b is page table[b, j // page_size], slot j % page_size. --key-lengths are the cache_seqlens (default: every page of the table).",
    ),
    click.option(
        "--query-offset",
        metavar="N[,N...]",
        help="KV-cache step: position of query 0 per batch item (the cache length before the new tokens), or per packed document; causal, window, chunks and ALiBi see query i at N + i. Negative when an item has more queries than keys. One number for all.",
    ),
    click.option(
        "--query-lengths",
        metavar="N[,N...]",
        help="Valid queries per batch item; later rows are absent: zero output, not judged, not compared. One number for all.",
    ),
    click.option(
        "--cu-seqlens",
        metavar="0,N1,...,L",
        help="Packed documents (FlashAttention's varlen): cumulative lengths along L; a query sees only its document's keys. Batch of 1.",
    ),
    click.option(
        "--cu-seqlens-k",
        metavar="0,N1,...,S",
        help="The documents' cumulative lengths along S (default: --cu-seqlens).",
    ),
    click.option(
        "--window",
        metavar="W|LEFT,RIGHT",
        help="Sliding window: key j visible to query i when −LEFT ≤ j − i − offset ≤ RIGHT.",
    ),
    click.option(
        "--attention-chunk",
        metavar="C",
        help="Chunked attention (Llama 4's attention_chunk_size, FlashAttention's attention_chunk): a query sees only the keys of its own chunk of C positions.",
    ),
    click.option(
        "--mask-mod",
        metavar="EXPR",
        help='FlexAttention\'s mask_mod: an expression over b, h, q_idx, kv_idx; where it is false the key is hidden, e.g. "q_idx >= kv_idx and q_idx - kv_idx < 256".',
    ),
    click.option(
        "--score-mod",
        metavar="EXPR",
        help='FlexAttention\'s score_mod: an expression over score (the scaled score), b, h, q_idx, kv_idx giving the logit before the mask, e.g. "score + 0.1 * (kv_idx - q_idx)". Numbers, + - * / // % **, comparisons, and/or/not, where, abs, tanh, exp, log, sqrt, minimum, maximum.',
    ),
    click.option(
        "--mask-value",
        metavar="-inf|finfo-min|X",
        shell_complete=words(*MASK_VALUE_NAMES),
        help="Value of hidden logits (default -inf; e.g. -1e9 as many kernels use).",
    ),
    click.option(
        "--dropout", metavar="P", help="Inverted dropout on the weights with probability P."
    ),
    click.option(
        "--seed",
        metavar="N",
        help="Seed of the dropout mask, and in sdpa grad of --dout random and --samples "
        "(default 0).",
    ),
    click.option(
        "--dropout-mask",
        "dropout_mask_path",
        metavar="FILE",
        shell_complete=files,
        help="Dropout's keep mask (bool or 0/1, broadcastable to (..., L, S)) replayed in place of the drawn one; needs --dropout.",
    ),
    click.option(
        "--heads",
        metavar="N",
        help="Split (..., L, d_model) inputs into N heads; the output is merged back.",
    ),
    click.option(
        "--kv-heads",
        metavar="G",
        help="With --heads: K and V hold G heads (d_model_kv = G·E), as ONNX's 3-D Attention inputs (grouped-query attention).",
    ),
    click.option(
        "--layout",
        type=click.Choice(LAYOUTS),
        help="Axes of Q, K, V and the output: bhsd (B, H, L, E), default, as PyTorch; bshd (B, L, H, E), as FlashAttention and xformers (read through a transposing view; the output is returned so).",
    ),
    click.option(
        "--dtype",
        metavar="FORMAT",
        shell_complete=words(*FORMATS),
        help="Run as a kernel in FORMAT: float64 (default, exact), float32, float16, bfloat16, float8_e4m3fn, float8_e5m2; reports the error against float64.",
    ),
    click.option(
        "--q-descale",
        "q_descale_path",
        metavar="X|FILE",
        shell_complete=files,
        help="FP8 inputs with descales (FlashAttention-3's q_descale): Q holds FP8 values whose real values are Q · X; X a positive number, or a file of shape (B, G) (batch, kv heads; each group's query heads read theirs). With an FP8 --dtype the run is FlashAttention-3's FP8 kernel: P rounded to FP8 before P·V, the output in bfloat16.",
    ),
    click.option(
        "--k-descale",
        "k_descale_path",
        metavar="X|FILE",
        shell_complete=files,
        help="K's descale (FlashAttention-3's k_descale): a positive number or a file (B, G), as --q-descale.",
    ),
    click.option(
        "--v-descale",
        "v_descale_path",
        metavar="X|FILE",
        shell_complete=files,
        help="V's descale (FlashAttention-3's v_descale): a positive number or a file (B, G), as --q-descale.",
    ),
    click.option(
        "--accumulate",
        metavar="FORMAT",
        shell_complete=words(*FORMATS, "same"),
        help="Accumulator of both matmuls under --dtype: float32 (default, as tensor cores), float64, or the --dtype format (same).",
    ),
    click.option(
        "--softmax-dtype",
        metavar="FORMAT",
        shell_complete=words(*FORMATS, "same"),
        help="Format the softmax runs in under --dtype: float32 (default), float64, or the --dtype format (same).",
    ),
    click.option(
        "--logits-dtype",
        metavar="FORMAT",
        shell_complete=words("same", *FORMATS),
        help="Format scores and logits are stored in under --dtype: the --dtype format (same, default, as PyTorch's unfused path) or float32 (as fused kernels).",
    ),
    click.option(
        "--prescale/--no-prescale",
        default=None,
        help="Scale Q and K by √scale before the matmul (ONNX's guard against overflow).",
    ),
    click.option(
        "--as",
        "framework",
        type=click.Choice(FRAMEWORKS),
        help=_conventions_help(),
    ),
]
