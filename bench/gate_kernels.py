"""Faithful exports from real attention kernels, and the bugs the gate must catch injected into them.

A *case* runs a real kernel on seeded inputs and returns an `Export`: the arrays
`sdpa check` reads (q, k, v, out, and weights, lse, mask and segment ids where the kernel
gives or takes them) and the flags that describe the computation, as a user would write
them. The kernels:

- PyTorch's CPU `scaled_dot_product_attention`, fused (`SDPBackend.FLASH_ATTENTION`, its
  logsumexp from the same aten op) and math (`SDPBackend.MATH`), float16, bfloat16 and
  float32: full, causal, grouped-query, a boolean mask, a decode-like L < S step whose
  causal mask is lower-right (an explicit mask: torch's `is_causal` is upper-left),
  three packed documents (`--segment-ids` beside `--causal`; the kernel gets the causal
  same-document mask) and a temperature (`--temperature 2`; the kernel gets the scale
  (1/√E)/2).
- Hugging Face eager attention in tiny randomly initialised models (never downloaded):
  Llama with right padding (its float mask exported as built), Mistral's sliding window,
  Gemma 2's soft-capped logits on a sliding and a global layer, bfloat16, float16 and
  float32; and, faithful only, the encoders BERT and ModernBERT (its local and global
  layers) at E = 8, L = 9 with batch item 1 padded after 3 tokens, five seeds, float32
  and float16, their weights exported too. Q, K, V after RoPE, the mask, the weights and
  the output before o_proj are recorded by wrapping the model's `eager_attention_forward`
  during one forward pass.
- JAX's `dot_product_attention` (XLA), bfloat16: full, causal grouped-query, a window.

Arrays are saved in sdpa's layout: Q (B, H, L, E), K and V (B, G, S, E), the output
(B, H, L, Ev), the weights (B, H, L, S), the LSE (B, H, L). A `.npy` cannot hold bfloat16:
bfloat16 tensors are saved as float32 (every value exactly representable) and the flags
say `--dtype bfloat16`.

A case also runs its kernel with a bug (`run(bug)`: the scale 1/E, the mask inverted, the
window one key wider, the causal mask upper-left or transposed, the packed documents
leaking, the temperature forgotten) while the flags keep describing the intended
computation; `inject` makes the bugs that live in the export itself (one head's output
shifted, one row rolled, a bfloat16 kernel claimed to be float32, Q, K, V and the output
or the output alone saved (B, L, H, E), the LSE in base 2). `HINT_NAMES` says what a hint
that names each bug holds; `expected_exit` what `sdpa check` must exit with.

`noise_cases` and `randn` are data with nothing wrong, on which sdpa must raise nothing.
Each kernel family is skipped when its library does not import (`cases()` says which).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from numpy.typing import NDArray

Array = NDArray[Any]
F64 = NDArray[np.float64]
Bool = NDArray[np.bool_]

# Bugs that run the kernel differently while the flags still describe the intended run.
SCALE_DK = "scale-dk"  # 1/E instead of 1/√E
MASK_INVERTED = "mask-inverted"  # the kernel got ~mask (True read as "masked")
WINDOW_OFF_BY_ONE = "window-off-by-one"  # one more key to the left than the window says
CAUSAL_FLIPPED = "causal-flipped"  # upper-left (torch's is_causal) where lower-right was meant
CAUSAL_TRANSPOSED = "causal-transposed"  # attn_mask=torch.triu(ones) where --causal (tril) is meant
SEGMENTS_IGNORED = "segments-ignored"  # packed documents run with is_causal alone: they leak
TEMPERATURE_FORGOTTEN = "temperature-forgotten"  # scale 1/√E where (1/√E)/T was meant
# Bugs in the export itself.
SHIFTS = (1, 2, 4, 8)  # one head's output + c × that head's RMS error against float64
ROW_ROLL = "row-roll"  # one query row's output rolled by one column
BF16_AS_F32 = "bf16-as-f32"  # a bfloat16 kernel's export claimed as float32 (no --dtype)
LAYOUT_BSHD = "layout-bshd"  # Q, K, V and the output saved (B, L, H, E), checked as (B, H, L, E)
OUTPUT_BSHD = "output-bshd"  # the output alone saved (B, L, H, E): refused (exit 2)
LSE_BASE2 = "lse-base2"  # the LSE saved as log₂ Σ eˣ (lse / ln 2)


def shift_bug(c: int) -> str:
    return f"head-shift-{c}"


SHIFT_BUGS = tuple(shift_bug(c) for c in SHIFTS)
EXPORT_BUGS = (*SHIFT_BUGS, ROW_ROLL, BF16_AS_F32, LAYOUT_BSHD, OUTPUT_BSHD, LSE_BASE2)
COMPUTED_BUGS = (
    SCALE_DK,
    MASK_INVERTED,
    WINDOW_OFF_BY_ONE,
    CAUSAL_FLIPPED,
    CAUSAL_TRANSPOSED,
    SEGMENTS_IGNORED,
    TEMPERATURE_FORGOTTEN,
)
SHIFTED = (0, 1)  # (batch, head) whose output a head shift moves
ROLLED_HEAD = (0, 0)  # (batch, head) of the rolled row; the row is L // 2

# What a hint that names the bug says (a substring of it). The head shifts and the rolled
# row have no option to name: the report names them when its diagnosis is structural and
# places them (bench_gate.named); bf16-as-f32 is named by a hint that says bfloat16.
HINT_NAMES: dict[str, str] = {
    SCALE_DK: "--scale dk",
    MASK_INVERTED: "--mask-true-means",
    WINDOW_OFF_BY_ONE: "--window",
    CAUSAL_FLIPPED: "--causal-align",
    CAUSAL_TRANSPOSED: "the causal mask transposed",
    SEGMENTS_IGNORED: "leaks across the packed documents",
    TEMPERATURE_FORGOTTEN: "no --temperature",
    BF16_AS_F32: "bfloat16",
    LAYOUT_BSHD: "--layout bshd",
    OUTPUT_BSHD: "--layout bshd",
    LSE_BASE2: "base 2",
}
REFUSED = (OUTPUT_BSHD,)  # bugs sdpa must refuse as bad input (exit 2), naming the fix


def expected_exit(bug: str | None) -> int:
    """`sdpa check`'s right exit code: 0 for a faithful export, 1 for a bug, 2 for a refused one."""
    if bug is None:
        return 0
    return 2 if bug in REFUSED else 1


@dataclass(frozen=True)
class Reference:
    """The computation, for an independent float64 recomputation (numpy, no sdpa)."""

    scale: float
    softcap: float | None = None
    visible: Bool | None = None  # broadcastable to (B, H, L, S); True: the key is seen
    additive: F64 | None = None  # a float mask added to the logits, broadcastable likewise


@dataclass(frozen=True)
class Export:
    """One kernel run as `sdpa check` reads it."""

    kernel: str  # torch-flash, torch-math, hf-llama, hf-mistral, hf-gemma2, jax-xla
    dtype: str  # the kernel's format: float16, bfloat16 or float32
    case: str
    arrays: Mapping[str, Array]  # q, k, v, out, [lse], [mask], as saved
    flags: tuple[str, ...]
    reference: Reference
    bug: str | None = None

    @property
    def name(self) -> str:
        return "/".join([self.kernel, self.dtype, self.case, self.bug or "faithful"])


@dataclass(frozen=True)
class Case:
    """A kernel on fixed inputs: `run(None)` the faithful export, `run(bug)` a computed bug."""

    kernel: str
    dtype: str
    name: str
    run: Callable[[str | None], Export] = field(repr=False, compare=False)
    bugs: tuple[str, ...]  # the computed bugs this case can run
    inject: bool = True  # whether the export bugs are injected into its faithful export

    @property
    def key(self) -> str:
        return f"{self.kernel}/{self.dtype}/{self.name}"


# ---------------------------------------------------------------------------- arrays


def saved(values: Any, dtype: str) -> Array:
    """A kernel's tensor as a .npy holds it: float16 natively, bfloat16 as float32 values."""
    a = np.asarray(values)
    return a.astype(np.float16) if dtype == "float16" else a.astype(np.float32)


def round_to(values: F64, dtype: str) -> Array:
    """Float64 values rounded to the kernel's format, then stored as `saved` stores it."""
    if dtype in ("float16", "float32"):
        return values.astype(dtype)
    return values.astype(ml_dtypes.bfloat16).astype(np.float32)


def dtype_flags(dtype: str) -> tuple[str, ...]:
    # float16 is read from the files; bfloat16 saved as float32 must be named.
    return ("--dtype", "bfloat16") if dtype == "bfloat16" else ()


def causal_visible(length: int, keys: int, align: str = "upper-left") -> Bool:
    """(L, S): key j visible to query i when j ≤ i (+ S − L when lower-right)."""
    offset = keys - length if align == "lower-right" else 0
    i, j = np.ogrid[:length, :keys]
    return np.asarray(j <= i + offset)


def window_visible(length: int, keys: int, left: int, right: int) -> Bool:
    """(L, S): sdpa's `--window LEFT,RIGHT` at offset 0: −LEFT ≤ j − i ≤ RIGHT."""
    i, j = np.ogrid[:length, :keys]
    return np.asarray((j - i >= -left) & (j - i <= right))


def attention64(export: Export) -> F64:
    """softmax(Q·Kᵀ·scale [capped] + mask)·V in float64 from the saved Q, K, V: (B, H, L, Ev)."""
    ref = export.reference
    q, k, v = (np.asarray(export.arrays[n], np.float64) for n in "qkv")
    group = q.shape[-3] // k.shape[-3]  # query head h reads kv head h // (H / G)
    k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    s = np.einsum("BHLE,BHSE->BHLS", q, k) * ref.scale
    if ref.softcap is not None:
        s = ref.softcap * np.tanh(s / ref.softcap)
    if ref.additive is not None:
        s = s + ref.additive
    if ref.visible is not None:
        s = np.where(ref.visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    if not np.isfinite(m).all():
        raise ValueError(f"{export.name}: a row has no visible key; the cases avoid them")
    w = np.exp(s - m)  # max-subtracted: no overflow
    w /= w.sum(axis=-1, keepdims=True)
    return np.asarray(np.einsum("BHLS,BHSE->BHLE", w, v))


def head_rms_error(export: Export, exact: F64) -> F64:
    """(B, H): the RMS of export − float64 over each head's output."""
    err = np.asarray(export.arrays["out"], np.float64) - exact
    return np.asarray(np.sqrt(np.mean(err * err, axis=(-2, -1))))


def relative_error(export: Export, exact: F64) -> float:
    """The largest head's RMS error against float64, relative to the RMS of its output."""
    rms = np.sqrt(np.mean(exact * exact, axis=(-2, -1)))
    return float(np.max(head_rms_error(export, exact) / rms))


# ---------------------------------------------------------------------------- export bugs


def inject(export: Export, bug: str, exact: F64) -> Export:
    """An export bug applied to a faithful export; `exact`: its float64 output (attention64)."""
    out = np.asarray(export.arrays["out"], np.float64)
    flags = export.flags
    if bug in SHIFT_BUGS:
        c = int(bug.rsplit("-", 1)[1])
        b, h = SHIFTED
        out = out.copy()
        out[b, h] += c * head_rms_error(export, exact)[b, h]
    elif bug == ROW_ROLL:
        b, h = ROLLED_HEAD
        out = out.copy()
        row = out.shape[-2] // 2
        out[b, h, row] = np.roll(out[b, h, row], 1)
    elif bug == BF16_AS_F32:
        if export.dtype != "bfloat16":
            raise ValueError(f"{bug} applies to bfloat16 exports, not {export.dtype}")
        # The arrays are already float32 holding bfloat16 values: only the claim changes.
        flags = tuple(_without(flags, "--dtype"))
        return replace(export, flags=flags, bug=bug)
    elif bug == LAYOUT_BSHD:
        # Every tensor (B, L, H, E) as FlashAttention keeps them; the LSE left out.
        arrays = {n: _swap_middle(export.arrays[n]) for n in ("q", "k", "v", "out")}
        return replace(export, arrays=arrays, bug=bug)
    elif bug == OUTPUT_BSHD:
        arrays = {**export.arrays, "out": _swap_middle(export.arrays["out"])}
        return replace(export, arrays=arrays, bug=bug)
    elif bug == LSE_BASE2:
        lse = np.asarray(export.arrays["lse"], np.float64) / np.log(2.0)
        return replace(export, arrays={**export.arrays, "lse": lse.astype(np.float32)}, bug=bug)
    else:
        raise ValueError(f"unknown export bug {bug!r}")
    arrays = {**export.arrays, "out": round_to(out, export.dtype)}
    return replace(export, arrays=arrays, bug=bug)


def export_bugs(export: Export) -> tuple[str, ...]:
    """The export bugs that apply to `export`."""
    return tuple(b for b in EXPORT_BUGS if _applies(b, export))


def _applies(bug: str, export: Export) -> bool:
    a = export.arrays
    if bug == BF16_AS_F32:
        return export.dtype == "bfloat16"
    if bug == LSE_BASE2:
        return "lse" in a
    if bug == LAYOUT_BSHD:
        # Read as (B, H, L, E), a (B, L, H, E) Q has L heads and K L' = S kv heads: a
        # computation sdpa can run (and then fails) only when S divides L, and no mask or
        # segment file has to be read anew.
        n, s = a["q"].shape[-2], a["k"].shape[-2]
        return not FILE_ARRAYS & a.keys() and n == s
    if bug == OUTPUT_BSHD:
        return bool(a["out"].shape[1] != a["out"].shape[2])  # else its shape says nothing
    return True


def _swap_middle(values: Array) -> Array:
    """(B, H, L, E) ↔ (B, L, H, E), contiguous as a kernel writes it."""
    return np.ascontiguousarray(np.swapaxes(values, 1, 2))


def _without(flags: Sequence[str], option: str) -> Iterator[str]:
    """`flags` without `option` and its value."""
    skip = False
    for f in flags:
        if skip:
            skip = False
        elif f == option:
            skip = True
        else:
            yield f


# ---------------------------------------------------------------------------- files


FILE_OPTIONS = {
    "out": "--expect-output",
    "weights": "--expect-weights",
    "lse": "--expect-lse",
    "mask": "--mask",
    "segments": "--segment-ids",
}
FILE_ARRAYS = frozenset({"mask", "segments"})  # arrays that describe the computation


def save(
    export: Export, folder: Path, base: tuple[Export, Mapping[str, Path]] | None = None
) -> dict[str, Path]:
    """Write the export's arrays as .npy under `folder`; return their paths by name.

    With `base` (a faithful export and its paths), arrays that are the base's own objects
    are not written again: their paths are the base's.
    """
    folder.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for name, a in export.arrays.items():
        if base is not None and base[0].arrays.get(name) is a:
            paths[name] = base[1][name]
            continue
        paths[name] = folder / f"{name}.npy"
        np.save(paths[name], a)
    return paths


def check_args(paths: Mapping[str, Path], flags: Sequence[str]) -> list[str]:
    """`sdpa`'s arguments: check Q K V --expect-output OUT [--expect-weights] [--expect-lse]
    [--mask] [--segment-ids] FLAGS."""
    args = ["check", *(str(paths[n]) for n in "qkv")]
    for name, option in FILE_OPTIONS.items():
        if name in paths:
            args += [option, str(paths[name])]
    return [*args, *flags]


# ---------------------------------------------------------------------------- PyTorch


@dataclass(frozen=True)
class TorchShape:
    """Q (B, H, L, E), K and V (B, G, S, E)."""

    batch: int = 1
    heads: int = 4
    kv_heads: int = 4
    length: int = 128
    keys: int = 128
    embed: int = 64


TORCH_CASES: dict[str, tuple[TorchShape, str]] = {
    # name: (shape, masking: "" | "causal" | "bool" | "lower-right" | "segments" | "temperature")
    "full": (TorchShape(), ""),
    "causal": (TorchShape(), "causal"),
    "gqa-causal": (TorchShape(heads=4, kv_heads=2), "causal"),
    "bool-mask": (TorchShape(batch=2), "bool"),
    "decode-lower-right": (TorchShape(length=16, keys=128), "lower-right"),
    "packed-documents": (TorchShape(), "segments"),
    "temperature": (TorchShape(), "temperature"),
}
TORCH_BACKENDS = ("flash", "math")
SEGMENTS = (40, 50, 38)  # the packed documents' lengths: L = S = 128 tokens, ids 0, 1, 2
TEMPERATURE = 2.0  # --temperature T: the scores divided by T, scale (1/√E)/T


def _torch_case(backend: str, dtype: str, name: str, seed: int) -> Case:
    masking = TORCH_CASES[name][1]
    bugs = [SCALE_DK]
    if masking == "bool":
        bugs.append(MASK_INVERTED)
    if masking == "lower-right":
        bugs.append(CAUSAL_FLIPPED)
    if masking == "causal":
        bugs.append(CAUSAL_TRANSPOSED)
    if masking == "segments":
        bugs.append(SEGMENTS_IGNORED)
    if masking == "temperature":
        bugs.append(TEMPERATURE_FORGOTTEN)
    run = functools.partial(_run_torch, backend, dtype, name, seed)
    return Case(f"torch-{backend}", dtype, name, run, tuple(bugs))


def segment_ids(lengths: Sequence[int]) -> NDArray[np.int64]:
    """(L,): document d's id d repeated over its tokens, packed one after another."""
    return np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)


def _run_torch(backend: str, dtype: str, name: str, seed: int, bug: str | None) -> Export:
    torch = importlib.import_module("torch")
    functional = importlib.import_module("torch.nn.functional")
    attention = importlib.import_module("torch.nn.attention")
    shape, masking = TORCH_CASES[name]
    tdtype = getattr(torch, dtype)
    rng = np.random.default_rng(seed)
    b, h, g, n, s, e = (
        shape.batch,
        shape.heads,
        shape.kv_heads,
        shape.length,
        shape.keys,
        shape.embed,
    )
    q, k, v = (
        torch.from_numpy(rng.standard_normal(dims)).to(tdtype)
        for dims in ((b, h, n, e), (b, g, s, e), (b, g, s, e))
    )
    temperature = TEMPERATURE if masking == "temperature" else 1.0
    scale = e**-0.5 / temperature
    flags: list[str] = []
    files: dict[str, Array] = {}
    mask: Bool | None = None
    visible: Bool | None = None
    if masking == "causal":
        flags.append("--causal")
        visible = causal_visible(n, s)
    elif masking == "bool":
        # Each key kept with probability 0.8: every row keeps many keys, and so does its inverse.
        mask = rng.random((b, 1, n, s)) < 0.8
        files["mask"] = mask
        visible = mask
    elif masking == "lower-right":
        flags += ["--causal", "--causal-align", "lower-right"]
        visible = causal_visible(n, s, "lower-right")
    elif masking == "segments":
        ids = segment_ids(SEGMENTS)
        files["segments"] = ids
        flags.append("--causal")
        visible = causal_visible(n, s) & (ids[:, None] == ids[None, :])
    elif masking == "temperature":
        flags += ["--temperature", f"{TEMPERATURE:g}"]

    kernel_scale = scale
    if bug == SCALE_DK:
        kernel_scale = 1.0 / e / temperature  # 1/√E applied twice, the rest as meant
    elif bug == TEMPERATURE_FORGOTTEN:
        kernel_scale = e**-0.5
    is_causal = masking == "causal"
    kernel_mask: Bool | None = mask
    if bug == MASK_INVERTED:
        kernel_mask = ~mask if mask is not None else None
    if masking == "lower-right":
        if bug == CAUSAL_FLIPPED:
            is_causal = True  # torch's is_causal: upper-left, j ≤ i
        else:
            kernel_mask = visible
    if masking == "segments":
        if bug == SEGMENTS_IGNORED:
            is_causal = True  # the documents' boundaries forgotten
        else:
            kernel_mask = visible
    if bug == CAUSAL_TRANSPOSED:
        # torch.triu where torch.tril was meant: each query sees itself and the keys after it.
        is_causal = False
        kernel_mask = np.triu(np.ones((n, s), dtype=bool))
    attn_mask = None if kernel_mask is None else torch.from_numpy(np.ascontiguousarray(kernel_mask))

    which = {"flash": attention.SDPBackend.FLASH_ATTENTION, "math": attention.SDPBackend.MATH}
    with attention.sdpa_kernel(which[backend]):
        out = functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=kernel_scale, enable_gqa=g != h
        )
    arrays: dict[str, Array] = {
        "q": saved(q.float().numpy(), dtype),
        "k": saved(k.float().numpy(), dtype),
        "v": saved(v.float().numpy(), dtype),
        "out": saved(out.float().numpy(), dtype),
    }
    if backend == "flash":
        lse = _torch_flash_lse(torch, q, k, v, attn_mask, is_causal, kernel_scale, out)
        if lse is not None:
            arrays["lse"] = lse.astype(np.float32)
    return Export(
        f"torch-{backend}",
        dtype,
        name,
        {**arrays, **files},
        (*flags, *dtype_flags(dtype)),
        Reference(scale, visible=visible),
        bug,
    )


def _torch_flash_lse(
    torch: Any, q: Any, k: Any, v: Any, attn_mask: Any, is_causal: bool, scale: float, out: Any
) -> Array | None:
    """The fused CPU kernel's logsumexp, from its aten op; None unless its output is `out`."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if attn_mask is not None:  # the op takes a float mask in Q's dtype, as sdpa converts it
        zero = torch.zeros((), dtype=q.dtype)
        attn_mask = torch.where(attn_mask, zero, torch.tensor(-torch.inf, dtype=q.dtype))
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    same, lse = op(q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[:2]
    return np.asarray(lse.numpy()) if torch.equal(same, out) else None


def torch_cases(seed: int = 17) -> list[Case]:
    return [
        _torch_case(backend, dtype, name, seed + i)
        for backend in TORCH_BACKENDS
        for dtype in ("float16", "bfloat16", "float32")
        for i, name in enumerate(TORCH_CASES)
    ]


# ---------------------------------------------------------------------------- Hugging Face


HF_SIZES = {
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 256,
    # Q and K entries of order 1 (the default 0.02 gives near-uniform weights, which hide
    # most bugs: no check could tell a scale bug from rounding there).
    "initializer_range": 0.1,
}


@dataclass(frozen=True)
class HFModel:
    """A tiny randomly initialised model: config class, model class, module, extra config."""

    config: str
    model: str
    module: str
    extra: Mapping[str, Any]
    layers: Mapping[int, str]  # layer index → case name
    padded: bool  # right padding on batch item 1: the mask is exported as the model built it
    sizes: Mapping[str, Any] = field(default_factory=lambda: HF_SIZES)
    tokens: tuple[int, int, int] = (2, 64, 16)  # batch, length, padding tokens of item 1
    dtypes: tuple[str, ...] = ("bfloat16", "float16", "float32")
    seeds: int = 1  # models built, each from its own seed (the case names number them)
    weights: bool = False  # the attention weights exported too (--expect-weights)
    bugs: bool = True  # its exports also run with bugs (else faithful only)


SLIDING_WINDOW = 16  # HF's sliding_window w: a query sees itself and the w − 1 keys before it
# Encoders as small as they come: E = 8, L = 9, the default initialisation (0.02: near-
# uniform weights, the case where rounding and a real error are hardest to tell apart).
ENCODER_SIZES = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
}
ENCODER_TOKENS = (2, 9, 6)  # batch item 1 holds 3 tokens, then 6 of padding
ENCODER_SEEDS = 5
HF_MODELS: dict[str, HFModel] = {
    "llama": HFModel(
        "LlamaConfig", "LlamaForCausalLM", "llama", {}, {0: "layer0-padded-float-mask"}, True
    ),
    "mistral": HFModel(
        "MistralConfig",
        "MistralForCausalLM",
        "mistral",
        {"sliding_window": SLIDING_WINDOW},
        {0: "layer0-sliding"},
        False,
    ),
    "gemma2": HFModel(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        "gemma2",
        {
            "sliding_window": SLIDING_WINDOW,
            # Layer 0 slides, layer 1 attends globally, as Gemma 2 alternates them.
            "layer_types": ["sliding_attention", "full_attention"],
            # 1/√64 = 1/8 where 1/√E = 1/√32: a scale the flags must name, as Gemma 2's
            # query_pre_attn_scalar differs from head_dim in its larger sizes.
            "query_pre_attn_scalar": 64,
            # Small enough to bite on a tiny model's logits (Gemma 2 uses 50.0 on larger ones).
            "attn_logit_softcapping": 5.0,
            "initializer_range": 0.2,
        },
        {0: "layer0-sliding-softcap", 1: "layer1-global-softcap"},
        False,
    ),
    "bert": HFModel(
        "BertConfig",
        "BertModel",
        "bert",
        {},
        {0: "layer0-padded", 1: "layer1-padded"},
        True,
        ENCODER_SIZES,
        ENCODER_TOKENS,
        ("float32", "float16"),
        ENCODER_SEEDS,
        weights=True,
        bugs=False,
    ),
    "modernbert": HFModel(
        "ModernBertConfig",
        "ModernBertModel",
        "modernbert",
        {
            # Layer 0 global, layer 1 local: a window of 4 (2 keys either side), which
            # its float mask carries with the padding.
            "global_attn_every_n_layers": 2,
            "local_attention": 4,
            # Special tokens inside the tiny vocabulary (the defaults are past 50,000).
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "cls_token_id": 1,
            "sep_token_id": 2,
        },
        {0: "layer0-global-padded", 1: "layer1-local-padded"},
        True,
        ENCODER_SIZES,
        ENCODER_TOKENS,
        ("float32", "float16"),
        ENCODER_SEEDS,
        weights=True,
        bugs=False,
    ),
}


@functools.cache
def _hf_forward(family: str, dtype: str, seed: int, bug: str | None) -> dict[int, dict[str, Any]]:
    """One forward pass; per layer, what its eager attention got and returned."""
    torch = importlib.import_module("torch")
    transformers = importlib.import_module("transformers")
    spec = HF_MODELS[family]
    modeling = importlib.import_module(f"transformers.models.{spec.module}.modeling_{spec.module}")
    extra = dict(spec.extra)
    if bug == WINDOW_OFF_BY_ONE:
        extra["sliding_window"] += 1
    config = getattr(transformers, spec.config)(
        **{**spec.sizes, **extra}, attn_implementation="eager"
    )
    torch.manual_seed(seed)
    model = getattr(transformers, spec.model)(config).to(getattr(torch, dtype)).eval()
    if bug == SCALE_DK:
        for module in model.modules():
            if hasattr(module, "scaling") and hasattr(module, "head_dim"):
                module.scaling = 1.0 / module.head_dim

    records: dict[int, dict[str, Any]] = {}
    eager = modeling.eager_attention_forward
    # Its parameters by name: ModernBERT's takes `scaling` as a required parameter, which a
    # caller may pass by position; Llama's and BERT's default it.
    signature = inspect.signature(eager)

    def recording(*args: Any, **kwargs: Any) -> Any:
        out, weights = eager(*args, **kwargs)
        bound = signature.bind(*args, **kwargs).arguments
        module, query = bound["module"], bound["query"]
        options = {**bound.get("kwargs", {}), **bound}
        scaling = options.get("scaling")
        if scaling is None:  # the function's own default
            scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
        records[module.layer_idx] = {
            "q": query,
            "k": bound["key"],
            "v": bound["value"],
            "mask": bound["attention_mask"],
            "out": out.transpose(1, 2),  # eager returns (B, L, H, Ev)
            "weights": weights,
            "scaling": scaling,
            "softcap": options.get("softcap"),
            "sliding_window": options.get("sliding_window"),
        }
        return out, weights

    batch, length, padded = spec.tokens
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec.sizes["vocab_size"], (batch, length), generator=generator)
    padding = torch.ones_like(ids)
    if spec.padded:
        padding[1, length - padded :] = 0
    # The attention modules look the function up in their module's globals at each call.
    vars(modeling)["eager_attention_forward"] = recording
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=padding)
    finally:
        vars(modeling)["eager_attention_forward"] = eager
    return records


def _run_hf(family: str, dtype: str, layer: int, seed: int, bug: str | None) -> Export:
    spec = HF_MODELS[family]
    rec = _hf_forward(family, dtype, seed, bug)[layer]
    faithful = _hf_forward(family, dtype, seed, None)[layer]  # what the flags describe
    names = ("q", "k", "v", "out", "weights") if spec.weights else ("q", "k", "v", "out")
    arrays = {n: saved(rec[n].float().numpy(), dtype) for n in names}
    n, e = arrays["q"].shape[-2:]
    s = arrays["k"].shape[-2]
    scale = float(faithful["scaling"])
    flags: list[str] = []
    if not np.isclose(scale, e**-0.5, rtol=1e-12, atol=0.0):
        flags += ["--scale", repr(scale)]
    softcap = faithful["softcap"]
    if softcap is not None:
        flags += ["--softcap", repr(float(softcap))]
    built = faithful["mask"].float().numpy().astype(np.float64)  # (B, 1, L, S)
    visible: Bool | None = None
    additive: F64 | None = None
    if spec.padded:
        # The float mask as the model built it (0 or the dtype's most negative number).
        arrays["mask"] = saved(rec["mask"].float().numpy(), dtype)
        additive = built
    else:
        flags.append("--causal")
        visible = causal_visible(n, s)
        window = faithful["sliding_window"]
        if window is not None:
            # HF: key j is seen when j > i − w (and j ≤ i): sdpa's --window w−1,0.
            flags += ["--window", f"{window - 1},0"]
            visible = visible & window_visible(n, s, window - 1, 0)
        if not np.array_equal(np.broadcast_to(visible, built.shape), built == 0):
            raise AssertionError(f"hf-{family} layer {layer}: the flags {flags} miss its mask")
    reference = Reference(scale, None if softcap is None else float(softcap), visible, additive)
    return Export(
        f"hf-{family}",
        dtype,
        _hf_name(spec, layer, seed),
        arrays,
        (*flags, *dtype_flags(dtype)),
        reference,
        bug,
    )


def _hf_name(spec: HFModel, layer: int, seed: int) -> str:
    """The layer's case name, and the seed's number where the model is built from several."""
    return spec.layers[layer] + (f"-seed{seed}" if spec.seeds > 1 else "")


def hf_cases(seed: int = 17) -> list[Case]:
    cases = []
    for family, spec in HF_MODELS.items():
        for dtype in spec.dtypes:
            for model_seed in range(seed, seed + spec.seeds):
                for layer, name in spec.layers.items():
                    bugs = [SCALE_DK] if spec.bugs else []
                    if "sliding_window" in spec.extra and "sliding" in name:
                        bugs.append(WINDOW_OFF_BY_ONE)
                    run = functools.partial(_run_hf, family, dtype, layer, model_seed)
                    key = _hf_name(spec, layer, model_seed)
                    cases.append(
                        Case(f"hf-{family}", dtype, key, run, tuple(bugs), inject=spec.bugs)
                    )
    return cases


# ---------------------------------------------------------------------------- JAX


JAX_WINDOW = 15  # left keys: local_window_size=(15, 0) is sdpa's --window 15,0
JAX_CASES: dict[str, tuple[int, bool, bool]] = {
    # name: (kv heads of 4, causal, window)
    "full": (4, False, False),
    "gqa-causal": (2, True, False),
    "causal-window": (4, True, True),
}


def _run_jax(name: str, seed: int, bug: str | None) -> Export:
    jax = importlib.import_module("jax")
    jnp = importlib.import_module("jax.numpy")
    g, causal, windowed = JAX_CASES[name]
    b, h, n, e = 1, 4, 128, 64
    rng = np.random.default_rng(seed)
    # JAX's layout is (B, T, N, H): sequence before heads.
    q, k, v = (
        jnp.asarray(rng.standard_normal(dims), jnp.bfloat16)
        for dims in ((b, n, h, e), (b, n, g, e), (b, n, g, e))
    )
    scale = e**-0.5
    window = JAX_WINDOW + (1 if bug == WINDOW_OFF_BY_ONE else 0)
    out, lse = jax.nn.dot_product_attention(
        q,
        k,
        v,
        scale=1.0 / e if bug == SCALE_DK else scale,
        is_causal=causal,
        local_window_size=(window, 0) if windowed else None,
        implementation="xla",
        return_residual=True,
    )

    def host(x: Any, axes: tuple[int, ...]) -> Array:
        return saved(np.asarray(x.astype(jnp.float32)).transpose(axes), "bfloat16")

    arrays = {
        "q": host(q, (0, 2, 1, 3)),
        "k": host(k, (0, 2, 1, 3)),
        "v": host(v, (0, 2, 1, 3)),
        "out": host(out, (0, 2, 1, 3)),
        "lse": host(lse, (0, 2, 1)),  # (B, T, N) → (B, N, T)
    }
    flags: list[str] = []
    visible: Bool | None = None
    if causal:
        flags.append("--causal")
        visible = causal_visible(n, n)
    if windowed:
        flags += ["--window", f"{JAX_WINDOW},0"]
        visible = window_visible(n, n, JAX_WINDOW, 0) & (True if visible is None else visible)
    return Export(
        "jax-xla",
        "bfloat16",
        name,
        arrays,
        (*flags, *dtype_flags("bfloat16")),
        Reference(scale, visible=visible),
        bug,
    )


def jax_cases(seed: int = 17) -> list[Case]:
    cases = []
    for i, name in enumerate(JAX_CASES):
        bugs = (SCALE_DK, WINDOW_OFF_BY_ONE) if JAX_CASES[name][2] else (SCALE_DK,)
        run = functools.partial(_run_jax, name, seed + i)
        cases.append(Case("jax-xla", "bfloat16", name, run, bugs))
    return cases


# ---------------------------------------------------------------------------- all


FAMILIES: dict[str, tuple[tuple[str, ...], Callable[[], list[Case]]]] = {
    # family: (the modules it needs, its cases)
    "torch": (("torch",), torch_cases),
    "hf": (("torch", "transformers"), hf_cases),
    "jax": (("jax",), jax_cases),
}


def missing(modules: Sequence[str]) -> str | None:
    """The first of `modules` that does not import, or None."""
    for m in modules:
        try:
            importlib.import_module(m)
        except ImportError:
            return m
    return None


NOISE_SEEDS = 4


def noise_cases(seed: int = 101) -> list[Case]:
    """Causal random data through PyTorch's fused kernel, float16 and float32, a few seeds:
    faithful exports whose check must raise nothing at all (no finding, not even an info)."""
    return [
        Case("torch-flash", dtype, f"causal-seed{s}", functools.partial(_run_noise, dtype, s), ())
        for dtype in ("float16", "float32")
        for s in range(seed, seed + NOISE_SEEDS)
    ]


def _run_noise(dtype: str, seed: int, bug: str | None) -> Export:
    return replace(_run_torch("flash", dtype, "causal", seed, bug), case=f"causal-seed{seed}")


def randn(seed: int, dtype: str = "float16") -> Array:
    """Standard normal data (1, 4, 128, 64) in `dtype`: what `sdpa inspect` must find nothing in."""
    return np.random.default_rng(seed).standard_normal((1, 4, 128, 64)).astype(dtype)


def cases() -> tuple[list[Case], list[str]]:
    """Every case whose library imports, and a line per family skipped."""
    found: list[Case] = []
    skipped: list[str] = []
    for family, (modules, make) in FAMILIES.items():
        absent = missing(modules)
        if absent is not None:
            skipped.append(f"{family}: skipped, {absent} does not import")
            continue
        found += make()
    return found, skipped
