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

Backward kernels (`backward_cases`, exports with `backward=True`, named backward/...):
PyTorch's CPU SDPA backward pass, fused and math, float16, bfloat16 and float32 (full,
causal, grouped-query with enable_gqa, a boolean mask; two seeds, the second faithful
only); Hugging Face's eager attention in the tiny Llama (padded, its float mask) and
Mistral (sliding window) and Gemma 2 (softcap, sliding and global layers), the recorded
call run again on Q, K, V leaves and backpropagated from a random dO; `jax.vjp` of JAX's
`dot_product_attention` in bfloat16. Each exports q, k, v,
dout, dq, dk, dv (and its mask) with the forward pass's flags. `inject_backward` puts a
backward kernel's slips into them: dK without the scale, D = rowsum(dO ∘ O) forgotten,
dV from unnormalised weights, the mask left out of the backward (P over every key from
the forward's LSE, or the whole backward unmasked), grouped-query dK and dV not summed
over the group, one head's dQ shifted by c × its RMS error; `backward64` is their float64
reference, `BACKWARD_NAMES` what names each in a report.

`noise_cases` and `randn` are data with nothing wrong, on which sdpa must raise nothing.
Each kernel family is skipped when its library does not import (`cases()` says which).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
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
    sinks: F64 | None = None  # (H,): a logit per head that takes weight and gives no value
    keep: Bool | None = None  # dropout's keep mask (B, H, L, S), replayed
    dropout: float = 0.0  # its probability: kept weights are divided by 1 − p
    descale: tuple[F64, F64, F64] | None = None  # FP8 descales of Q, K, V (B, G): values × them


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
    backward: bool = False  # a backward kernel's export: q, k, v, dout, dq, dk, dv, [mask]

    @property
    def name(self) -> str:
        parts = [self.kernel, self.dtype, self.case, self.bug or "faithful"]
        return "/".join(["backward", *parts] if self.backward else parts)


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
    if ref.descale is not None:  # FP8 values: the real values are them × their descales
        qd, kd, vd = (d[..., None, None] for d in ref.descale)
        q, k, v = q * np.repeat(qd, group, axis=-3), k * kd, v * vd
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
    "sinks": "--sinks",
    "dropout_mask": "--dropout-mask",
    "dout": "--dout",
    "dq": "--expect-dq",
    "dk": "--expect-dk",
    "dv": "--expect-dv",
    "q_descale": "--q-descale",
    "k_descale": "--k-descale",
    "v_descale": "--v-descale",
}
DESCALE_ARRAYS = ("q_descale", "k_descale", "v_descale")  # FP8 descales (B, G), per head
FILE_ARRAYS = frozenset(
    {"mask", "segments", "sinks", "dropout_mask", *DESCALE_ARRAYS}
)  # arrays that describe the computation


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
    """`sdpa`'s arguments: check Q K V [--expect-output OUT] [--expect-weights] [--expect-lse]
    [--mask] [--segment-ids] [--dout DOUT --expect-dq DQ --expect-dk DK --expect-dv DV] FLAGS."""
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
        call = signature.bind(*args, **kwargs)
        bound = call.arguments
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
            "call": (eager, call),  # to run it again with gradients (the backward cases)
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


# ---------------------------------------------------------------------------- backward


# Slips of a backward kernel, put into a faithful backward export: the gradients they
# change computed in float64 from the saved Q, K, V and dO as the slip computes them,
# then rounded to the kernel's format (the others stay the kernel's own).
DK_NO_SCALE = "dk-no-scale"  # dK = dSᵀ·Q without the scale: the kernel's dK × 1/scale
D_FORGOTTEN = "d-forgotten"  # dS = P ⊙ dA, not P ⊙ (dA − D), D = rowsum(dO ∘ O): dQ, dK
DV_UNNORMALISED = "dv-unnormalised"  # dV = exp(S − rowmax)ᵀ·dO: the row sums not divided out
# The mask applied in the forward pass but not in the backward: P recomputed as
# exp(S − LSE) over every key (S before the mask, LSE and D from the masked forward pass),
# as a FlashAttention-style backward reads the forward's LSE: dQ, dK, dV.
MASK_FORGOTTEN = "mask-forgotten-backward"
# The whole backward pass run without the mask (the backward of unmasked attention; the
# forward pass masked): dQ, dK, dV.
BACKWARD_UNMASKED = "backward-unmasked"
# Grouped-query dK and dV not summed over the query heads that share a K/V head: each
# holds the first query head's share alone (a kernel that writes where it should add).
GQA_UNSUMMED = "gqa-unsummed"
# Dropout's mask not replayed in the backward pass: the gradients of attention without
# dropout (a kernel that lost its seed, or never had the mask).
DROPOUT_NOT_REPLAYED = "dropout-not-replayed"
DQ_SHIFTS = (1, 2, 4, 8)  # one head's dQ + c × that head's dQ RMS error against float64


def dq_shift(c: int) -> str:
    return f"dq-head-shift-{c}"


DQ_SHIFT_SLIPS = tuple(dq_shift(c) for c in DQ_SHIFTS)
BACKWARD_SLIPS = (
    DK_NO_SCALE,
    D_FORGOTTEN,
    DV_UNNORMALISED,
    MASK_FORGOTTEN,
    BACKWARD_UNMASKED,
    GQA_UNSUMMED,
    DROPOUT_NOT_REPLAYED,
)
# What names each slip in a failed check's hint or summary (dv.sums says "unnormalised
# weights"); a dK without its scale is also named by a structural diagnosis whose fit
# is the factor 1/scale, a dQ head shift by one that places its slice alone
# (bench_gate.Run.named).
BACKWARD_NAMES: dict[str, str] = {
    DK_NO_SCALE: "misses the scale",
    D_FORGOTTEN: "rowsum(dO",
    DV_UNNORMALISED: "unnormalised",
    MASK_FORGOTTEN: "not in the backward",
    BACKWARD_UNMASKED: "ran without the mask",
    GQA_UNSUMMED: "query head's share",
    DROPOUT_NOT_REPLAYED: "did not replay dropout",
}
GRADIENTS = ("dq", "dk", "dv")


@dataclass(frozen=True)
class BackwardCase:
    """A backward kernel on fixed inputs: `run()` its faithful export (backward=True)."""

    kernel: str
    dtype: str
    name: str
    run: Callable[[], Export] = field(repr=False, compare=False)
    slips: bool = True  # whether the slips are put into it (else faithful only)

    @property
    def key(self) -> str:
        return f"backward/{self.kernel}/{self.dtype}/{self.name}"


def backward64(export: Export, slip: str | None = None) -> dict[str, F64]:
    """dQ (B, H, L, E), dK and dV (B, G, S, E) of Σ O ⊙ dO in float64 from the saved Q, K,
    V and dO; with `slip`, as a kernel with that slip computes them.

    S = Q·Kᵀ·scale (soft-capped: C·tanh(S / C)) (+ mask), P = softmax(S), dA = dO·Vᵀ, D = rowsum(P ⊙ dA) = rowsum(dO ⊙ O),
    dS = P ⊙ (dA − D), dQ = dS·K·scale, dK = dSᵀ·Q·scale, dV = Pᵀ·dO, dK and dV summed
    over the query heads that share a K/V head.
    """
    ref = export.reference
    q, k, v, d_o = (np.asarray(export.arrays[n], np.float64) for n in ("q", "k", "v", "dout"))
    group = q.shape[-3] // k.shape[-3]  # query head h reads kv head h // (H / G)
    k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    scaled = np.einsum("BHLE,BHSE->BHLS", q, k) * ref.scale
    if ref.softcap is not None:  # C·tanh(x / C), as Gemma 2
        t = np.tanh(scaled / ref.softcap)
        scaled = ref.softcap * t
    masked = slip != BACKWARD_UNMASKED
    s = scaled if ref.additive is None or not masked else scaled + ref.additive
    if ref.visible is not None and masked:
        s = np.where(ref.visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    if not np.isfinite(m).all():
        raise ValueError(f"{export.name}: a row has no visible key; the cases avoid them")
    sink = None if ref.sinks is None else ref.sinks.reshape(-1, 1, 1)  # (H, 1, 1)
    if sink is not None:
        m = np.maximum(m, sink)
    w = np.exp(s - m)  # max-subtracted: no overflow
    total = w.sum(axis=-1, keepdims=True)
    if sink is not None:  # a sink takes its share of the weight and gives no value
        total = total + np.exp(sink - m)
    p = w / total
    da = np.einsum("BHLE,BHSE->BHLS", d_o, v)
    dropped = ref.keep is not None and slip != DROPOUT_NOT_REPLAYED
    if dropped:  # the weights used are P · keep / (1 − p): dA is taken through the same
        da = da * ref.keep / (1.0 - ref.dropout)
    d = (p * da).sum(axis=-1, keepdims=True)
    if slip == MASK_FORGOTTEN:
        lse = m + np.log(total)  # the forward's, a sink's share in it
        p = np.exp(scaled - lse)  # every key, the mask left out; LSE and D as masked
    ds = p * da if slip == D_FORGOTTEN else p * (da - d)
    if ref.softcap is not None:
        ds = ds * (1.0 - t * t)  # the softcap's chain rule
    weights = w if slip == DV_UNNORMALISED else p
    if dropped:
        weights = weights * ref.keep / (1.0 - ref.dropout)
    dq = np.einsum("BHLS,BHSE->BHLE", ds, k) * ref.scale
    dk = np.einsum("BHLS,BHLE->BHSE", ds, q) * ref.scale
    dv = np.einsum("BHLS,BHLE->BHSE", weights, d_o)

    def per_kv_head(x: F64) -> F64:
        heads = x.reshape(*x.shape[:-3], x.shape[-3] // group, group, *x.shape[-2:])
        return np.asarray(heads[..., 0, :, :] if slip == GQA_UNSUMMED else heads.sum(axis=-3))

    return {"dq": np.asarray(dq), "dk": per_kv_head(dk), "dv": per_kv_head(dv)}


def gradient_head_rms_error(export: Export, exact: Mapping[str, F64], name: str) -> F64:
    """(B, heads): the RMS of the exported gradient − float64 over each head."""
    err = np.asarray(export.arrays[name], np.float64) - exact[name]
    return np.asarray(np.sqrt(np.mean(err * err, axis=(-2, -1))))


def gradient_error(export: Export, exact: Mapping[str, F64]) -> float:
    """The largest head's RMS error of dQ, dK and dV against float64, relative to its RMS."""
    worst = 0.0
    for name in GRADIENTS:
        rms = np.sqrt(np.mean(exact[name] * exact[name], axis=(-2, -1)))
        worst = max(worst, float(np.max(gradient_head_rms_error(export, exact, name) / rms)))
    return worst


def backward_slips(export: Export) -> tuple[str, ...]:
    """The slips that apply to a backward export: the mask's where it has one, the
    group's where K/V heads are shared."""
    found = [DK_NO_SCALE, D_FORGOTTEN, DV_UNNORMALISED]
    ref = export.reference
    if ref.visible is not None or ref.additive is not None:
        found += [MASK_FORGOTTEN, BACKWARD_UNMASKED]
    if export.arrays["q"].shape[-3] > export.arrays["k"].shape[-3]:
        found.append(GQA_UNSUMMED)
    if ref.keep is not None:
        found.append(DROPOUT_NOT_REPLAYED)
    return (*found, *DQ_SHIFT_SLIPS)


def inject_backward(export: Export, slip: str, exact: Mapping[str, F64]) -> Export:
    """A backward slip put into a faithful backward export; `exact`: its backward64."""
    changed: dict[str, F64]
    if slip == DK_NO_SCALE:
        changed = {"dk": np.asarray(export.arrays["dk"], np.float64) / export.reference.scale}
    elif slip in DQ_SHIFT_SLIPS:
        c = int(slip.rsplit("-", 1)[1])
        b, h = SHIFTED
        dq = np.asarray(export.arrays["dq"], np.float64).copy()
        dq[b, h] += c * gradient_head_rms_error(export, exact, "dq")[b, h]
        changed = {"dq": dq}
    elif slip in BACKWARD_SLIPS:
        wrong = backward64(export, slip)
        names = {
            D_FORGOTTEN: ("dq", "dk"),
            DV_UNNORMALISED: ("dv",),
            MASK_FORGOTTEN: GRADIENTS,
            BACKWARD_UNMASKED: GRADIENTS,
            GQA_UNSUMMED: ("dk", "dv"),
            DROPOUT_NOT_REPLAYED: GRADIENTS,
        }[slip]
        changed = {n: wrong[n] for n in names}
    else:
        raise ValueError(f"unknown backward slip {slip!r}")
    rounded = {n: round_to(a, export.dtype) for n, a in changed.items()}
    return replace(export, arrays={**export.arrays, **rounded}, bug=slip)


def _backward_export(forward: Export, grads: Mapping[str, Array]) -> Export:
    """A forward export's inputs, mask and flags with the backward's dO, dQ, dK, dV."""
    arrays = {n: a for n, a in forward.arrays.items() if n not in ("out", "weights", "lse")}
    arrays |= {n: saved(a, forward.dtype) for n, a in grads.items()}
    return replace(forward, arrays=arrays, bug=None, backward=True)


TORCH_BACKWARD_CASES = ("full", "causal", "gqa-causal", "bool-mask")
# torch's inputs from two seeds per case: the slips put into the first's export, the
# second's faithful only (a second draw of rounding, at a sixth of the runs).
BACKWARD_SEEDS = 2


def _run_torch_backward(backend: str, dtype: str, name: str, seed: int) -> Export:
    """PyTorch's CPU SDPA forward and backward pass (`backend`) on seeded Q, K, V and dO."""
    torch = importlib.import_module("torch")
    functional = importlib.import_module("torch.nn.functional")
    attention = importlib.import_module("torch.nn.attention")
    forward = _run_torch(backend, dtype, name, seed, None)  # the inputs, mask and flags
    tdtype = getattr(torch, dtype)
    leaves = [torch.from_numpy(forward.arrays[n]).to(tdtype).requires_grad_(True) for n in "qkv"]
    rng = np.random.default_rng([seed, 1])
    d_o = torch.from_numpy(rng.standard_normal(forward.arrays["out"].shape)).to(tdtype)
    mask = forward.arrays.get("mask")
    attn_mask = None if mask is None else torch.from_numpy(np.asarray(mask))
    h, g = forward.arrays["q"].shape[-3], forward.arrays["k"].shape[-3]
    which = {"flash": attention.SDPBackend.FLASH_ATTENTION, "math": attention.SDPBackend.MATH}
    with attention.sdpa_kernel(which[backend]):
        out = functional.scaled_dot_product_attention(
            *leaves,
            attn_mask=attn_mask,
            is_causal="--causal" in forward.flags,
            scale=forward.reference.scale,
            enable_gqa=g != h,
        )
    out.backward(d_o)
    grads = {"dout": d_o.float().numpy()}
    grads |= {n: x.grad.float().numpy() for n, x in zip(GRADIENTS, leaves, strict=True)}
    return replace(_backward_export(forward, grads), case=f"{name}-seed{seed}")


def _run_hf_backward(family: str, dtype: str, layer: int, seed: int) -> Export:
    """The gradients of Q, K, V of one eager attention call of a model's forward pass:
    the recorded call run again on Q, K, V leaves and backpropagated from a random dO."""
    torch = importlib.import_module("torch")
    rec = _hf_forward(family, dtype, seed, None)[layer]
    forward = _run_hf(family, dtype, layer, seed, None)
    eager, call = rec["call"]
    again = call.signature.bind(*call.args, **call.kwargs)
    leaves = [rec[n].detach().clone().requires_grad_(True) for n in "qkv"]
    for param, leaf in zip(("query", "key", "value"), leaves, strict=True):
        again.arguments[param] = leaf
    generator = torch.Generator().manual_seed(seed)
    d_o = torch.randn(rec["out"].shape, generator=generator).to(getattr(torch, dtype))
    with torch.enable_grad():
        out = eager(*again.args, **again.kwargs)[0].transpose(1, 2)  # (B, L, H, Ev) → BHLE
        if not torch.equal(out, rec["out"]):
            raise AssertionError(f"hf-{family} layer {layer}: the call again gave another output")
        out.backward(d_o)
    grads = {"dout": d_o.float().numpy()}
    grads |= {n: x.grad.float().numpy() for n, x in zip(GRADIENTS, leaves, strict=True)}
    return _backward_export(forward, grads)


EAGER_BACKWARD = ("sinks", "dropout")
EAGER_DROPOUT = 0.1


def _run_eager_backward(dtype: str, name: str, seed: int) -> Export:
    """Attention written out in PyTorch ops, in `dtype`, and its autograd backward: with
    a sink logit per head as gpt-oss's eager attention takes it (the logits concatenated
    with the sinks, softmax, the sinks' column dropped), or with dropout from a keep mask
    that the backward replays (as PyTorch's math kernel drops its weights)."""
    torch = importlib.import_module("torch")
    t = getattr(torch, dtype)
    rng = np.random.default_rng([seed, 3])
    b, h, n, e = 1, 4, 128, 64
    arrays = {x: round_to(rng.standard_normal((b, h, n, e)), dtype) for x in (*"qkv", "dout")}
    scale = 1.0 / math.sqrt(e)
    leaves = [
        torch.from_numpy(np.asarray(arrays[x], np.float32)).to(t).requires_grad_(True)
        for x in "qkv"
    ]
    scores = leaves[0] @ leaves[1].transpose(-1, -2) * scale
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    reference = Reference(scale=scale, visible=np.tril(np.ones((n, n), bool)))
    flags: tuple[str, ...] = ("--causal", *dtype_flags(dtype))
    if name == "sinks":
        sinks = round_to(rng.normal(scale=2.0, size=h), dtype)
        arrays["sinks"] = sinks
        column = torch.from_numpy(np.asarray(sinks, np.float32)).to(t).reshape(1, h, 1, 1)
        logits = torch.cat([scores, column.expand(b, h, n, 1)], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        weights = torch.softmax(logits, dim=-1)[..., :-1]
        reference = replace(reference, sinks=np.asarray(sinks, np.float64))
    else:
        keep = rng.random((b, h, n, n)) >= EAGER_DROPOUT
        arrays["dropout_mask"] = keep
        weights = torch.softmax(scores, dim=-1)
        weights = weights * torch.from_numpy(keep).to(t) / (1.0 - EAGER_DROPOUT)
        reference = replace(reference, keep=keep, dropout=EAGER_DROPOUT)
        flags = (*flags, "--dropout", str(EAGER_DROPOUT))
    out = weights @ leaves[2]
    out.backward(torch.from_numpy(np.asarray(arrays["dout"], np.float32)).to(t))
    arrays |= {
        x: saved(leaf.grad.float().numpy(), dtype)
        for x, leaf in zip(GRADIENTS, leaves, strict=True)
    }
    return Export(
        "torch-eager", dtype, f"{name}-seed{seed}", arrays, flags, reference, backward=True
    )


HF_BACKWARD = ("llama", "mistral", "gemma2")


def _run_jax_backward(name: str, seed: int) -> Export:
    """jax.vjp of `dot_product_attention` (XLA) in bfloat16 on seeded Q, K, V and dO."""
    jax = importlib.import_module("jax")
    jnp = importlib.import_module("jax.numpy")
    forward = _run_jax(name, seed, None)  # the inputs (saved exactly) and flags
    _, causal, windowed = JAX_CASES[name]

    def device(values: Array) -> Any:  # (B, N, T, H) → JAX's (B, T, N, H)
        return jnp.asarray(np.swapaxes(values, 1, 2), jnp.bfloat16)

    q, k, v = (device(forward.arrays[n]) for n in "qkv")

    def attend(q: Any, k: Any, v: Any) -> Any:
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            scale=forward.reference.scale,
            is_causal=causal,
            local_window_size=(JAX_WINDOW, 0) if windowed else None,
            implementation="xla",
        )

    out, vjp = jax.vjp(attend, q, k, v)
    rng = np.random.default_rng([seed, 1])
    d_o = jnp.asarray(rng.standard_normal(out.shape), jnp.bfloat16)
    dq, dk, dv = vjp(d_o)

    def host(x: Any) -> Array:
        return np.swapaxes(np.asarray(x.astype(jnp.float32)), 1, 2)

    grads = {"dout": host(d_o), "dq": host(dq), "dk": host(dk), "dv": host(dv)}
    return _backward_export(forward, grads)


def torch_backward_cases(seed: int = 17) -> list[BackwardCase]:
    return [
        BackwardCase(
            f"torch-{backend}",
            dtype,
            f"{name}-seed{s}",
            functools.partial(_run_torch_backward, backend, dtype, name, s),
            slips=s == first,
        )
        for backend in TORCH_BACKENDS
        for dtype in ("float16", "bfloat16", "float32")
        for i, name in enumerate(TORCH_BACKWARD_CASES)
        for first in (seed + 10 * i,)
        for s in range(first, first + BACKWARD_SEEDS)
    ]


def eager_backward_cases(seed: int = 17) -> list[BackwardCase]:
    return [
        BackwardCase(
            "torch-eager",
            dtype,
            f"{name}-seed{seed}",
            functools.partial(_run_eager_backward, dtype, name, seed),
        )
        for dtype in ("float16", "bfloat16", "float32")
        for name in EAGER_BACKWARD
    ]


def hf_backward_cases(seed: int = 17) -> list[BackwardCase]:
    cases = []
    for family in HF_BACKWARD:
        spec = HF_MODELS[family]
        for dtype in spec.dtypes:
            for layer, name in spec.layers.items():
                run = functools.partial(_run_hf_backward, family, dtype, layer, seed)
                cases.append(BackwardCase(f"hf-{family}", dtype, name, run))
    return cases


def jax_backward_cases(seed: int = 17) -> list[BackwardCase]:
    return [
        BackwardCase(
            "jax-xla", "bfloat16", name, functools.partial(_run_jax_backward, name, seed + i)
        )
        for i, name in enumerate(JAX_CASES)
    ]


# ---------------------------------------------------------------------------- all


FAMILIES: dict[str, tuple[tuple[str, ...], Callable[[], list[Case]]]] = {
    # family: (the modules it needs, its cases)
    "torch": (("torch",), torch_cases),
    "hf": (("torch", "transformers"), hf_cases),
    "jax": (("jax",), jax_cases),
    "fp8": ((), lambda: importlib.import_module("gate_fp8").cases()),  # FlashAttention-3's FP8
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


BACKWARD_FAMILIES: dict[str, tuple[tuple[str, ...], Callable[[], list[BackwardCase]]]] = {
    "torch": (("torch",), torch_backward_cases),
    "torch-eager": (("torch",), eager_backward_cases),
    "hf": (("torch", "transformers"), hf_backward_cases),
    "jax": (("jax",), jax_backward_cases),
}


def backward_cases() -> tuple[list[BackwardCase], list[str]]:
    """Every backward case whose library imports, and a line per family skipped."""
    found: list[BackwardCase] = []
    skipped: list[str] = []
    for family, (modules, make) in BACKWARD_FAMILIES.items():
        absent = missing(modules)
        if absent is not None:
            skipped.append(f"{family} backward: skipped, {absent} does not import")
            continue
        found += make()
    return found, skipped
