"""Every name sdpa speaks, once: finding kinds (with the unit each counts), severities
and statuses, the stages and their formulas, frameworks, formats, the tensors a run
reads and writes, the model grid's metrics, the error statistics and the choices of
the options. Plain Python, no numpy: the command line reads its choices and help
from here without loading the engine (``sdpa --help`` stays fast), the engine, the
diagnosis and the renderers read the same tuples, and the JSON Schemas' enums are
held to them (``tests/test_schemas.py``).

A new name is added here and nowhere else; what it means lives with the code that
computes it.
"""

from __future__ import annotations

# --- findings ---------------------------------------------------------------------------

KINDS = (
    "nonfinite",
    "page_shared",
    "overflow",
    "fully_masked",
    "mask_suspect",
    "unscaled",
    "collapsed_head",
    "dead_head",
    "saturated",
    "near_uniform",
    "underflow",
)
"""The forward pass's finding kinds, in the order they are listed (causes before
symptoms); ``--fail-on`` gates them."""

GRADIENT_KINDS = (
    "gradient_nonfinite",
    "gradient_range",
    "vanishing_gradient",
    "weak_head_gradient",
    "no_gradient_keys",
)
"""The kinds ``sdpa grad`` adds, listed after the rest."""

ALL_KINDS = KINDS + GRADIENT_KINDS

KIND_UNITS = {
    "fully_masked": "row",
    "saturated": "row",
    "near_uniform": "row",
    "underflow": "row",
    "dead_head": "head",
    "collapsed_head": "head",
    "vanishing_gradient": "row",
    "weak_head_gradient": "head",
    "no_gradient_keys": "head",
}
"""The kinds found once per row or per head, → that unit: listed up to
``--max-findings`` and grouped in tables. Every other finding stands alone."""

SEVERITIES = ("info", "warning", "error")
"""A finding's severity, mildest first."""

STATUSES = ("pass", "warn", "fail")
"""A check's status."""

# --- stages -----------------------------------------------------------------------------

STAGE_TITLES = {
    "raw": "raw scores",
    "scaled": "scaled scores",
    "capped": "soft-capped",
    "biased": "biased",
    "masked": "masked logits",
    "weights": "weights",
    "dropped": "after dropout",
    "output": "output",
}
"""Every forward stage, in the order of computation, → its title."""

STAGES = tuple(STAGE_TITLES)
"""The forward stages, in the order of computation (``--stages``)."""

FORMULAS = {
    "raw": "Q·Kᵀ",
    "scaled": "raw · scale / temperature",
    "capped": "C · tanh(scaled / C)",
    "biased": "+ bias / ALiBi",
    "masked": "hidden keys set to the mask value",
    "weights": "softmax over keys",
    "dropped": "kept weights / (1 − p)",
    "output": "weights · V",
    "d_output": "dO",
    "d_weights": "dA = dO · Vᵀ",
    "d_scores": "dS = A ⊙ (dA − Σ A ⊙ dA)",
    "d_scaled": "dS ⊙ (1 − tanh²(scaled / C))",
    "d_query": "dQ = dS · K · scale",
    "d_key": "dK = dSᵀ · Q · scale",
    "d_value": "dV = Aᵀ · dO",
    "d_bias": "d(bias) = dS",
}
"""Every stage, forward then backward (``explain --backward``'s, in the order the
gradient flows; ``d_scaled`` only with a softcap, ``d_bias`` only with a bias), → its
formula. Their shapes: the forward stages (rows, S) but the output (rows, Ev); dO
(rows, Ev); dA, dS, d_scaled and d(bias) (rows, S); dQ (rows, E); dK (S, E) and dV
(S, Ev), the whole kv head, every row."""

BACKWARD_STAGES = tuple(s for s in FORMULAS if s not in STAGE_TITLES)
"""The backward stages, in the order the gradient flows."""

GRADIENT_STAGE = {"dq": "d_query", "dk": "d_key", "dv": "d_value", "dbias": "d_bias"}
"""A gradient (as ``sdpa grad`` and its findings name it) → its backward stage."""


def gradient_formula(name: str) -> str:
    """The right side of a gradient's formula: ``dS · K · scale`` for ``dq``."""
    return FORMULAS[GRADIENT_STAGE[name]].partition(" = ")[2]


# --- tensors ----------------------------------------------------------------------------

INPUT_TENSORS = (
    "q",
    "k",
    "v",
    "bias",
    "mask",
    "sinks",
    "segment_ids",
    "segment_ids_kv",
    "dropout_mask",
    "block_table",
    "qv",
    "q_descale",
    "k_descale",
    "v_descale",
)
"""The tensors a computation reads (a case file's keys, a manifest's, a flag's name)."""

DESCALES = ("q_descale", "k_descale", "v_descale")
"""FP8 descale factors of Q, K and V (FlashAttention-3's ``q_descale``, ...): each a
positive number, or a tensor ``(B, G)``; a number is a tensor of its own here
(``--q-descale 0.02``), so these are the tensors that may be given as one."""

TENSOR_FLAGS = ("sinks", "segment_ids", "segment_ids_kv", "dropout_mask", "block_table", "qv")
"""Tensors given by a flag ``--NAME FILE`` besides Q, K, V, ``--bias`` and ``--mask``
(``block_table``: K and V are a paged cache, :mod:`sdpa_cli.engine.paged`)."""

FORWARD_EXPORTS = ("output", "weights", "lse")
"""A forward kernel's exports: the output, the attention weights, the logsumexp per row."""

GRADIENTS = ("dq", "dk", "dv", "dbias", "dsinks")
"""What ``sdpa grad`` computes, named as in ``--save``, each shaped as its input: of Q,
K, V, the bias and the sinks; a backward kernel's exports ``sdpa check`` judges (with
``--dout``)."""

EXPORTS = (*FORWARD_EXPORTS, *GRADIENTS)
"""What ``sdpa check`` judges: the output, the attention weights, the logsumexp per row,
and the gradients (``--expect-NAME``, a manifest's ``expect-NAME``)."""

DOUT_SOURCES = ("ones", "random")
"""``--dout``'s words (besides a file)."""

# --- formats ----------------------------------------------------------------------------

FORMATS = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
FP8_FORMATS = FORMATS[4:]
"""The 8-bit formats: FP8 kernels' inputs (``--q-descale`` and the others)."""
NUMPYLESS = FORMATS[3:]
"""The formats numpy has no dtype of its own for (ml_dtypes gives them): a torch tensor
in one comes across as float32, its format said beside it."""
"""The number formats a run may compute in or judge (``--dtype``), widest first."""

REFERENCE_FORMATS = ("float32", "float64")
"""Formats a check's reference may be computed in (``--reference``)."""

FORMAT_ALIASES = {
    "fp64": "float64",
    "f64": "float64",
    "double": "float64",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "single": "float32",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8_e4m3fn": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "e4m3fn": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "e5m2": "float8_e5m2",
}
"""The names people type for a format (PyTorch's ``half``, ``float``, ``double``;
``fp16``, ``bf16``...) → its name in :data:`FORMATS`. ``float`` and ``single`` are
float32, as in C and PyTorch (``torch.float``; numpy's ``float`` is Python's, float64,
but that name is not typed for a format). FP8's E4M3 is the ``fn`` one (no inf, max 448)
that NVIDIA's and OCP's "E4M3" name; ml_dtypes' ``float8_e4m3`` (with inf) is another
format, so it is no alias."""


def format_name(value: object) -> str | None:
    """The :data:`FORMATS` name ``value`` means: a format's own name or an alias of
    :data:`FORMAT_ALIASES`, in any case, with PyTorch's ``torch.`` before it or not
    (``str(tensor.dtype)``); None for anything else."""
    if not isinstance(value, str):
        return None
    typed = value.strip().lower().removeprefix("torch.")
    return typed if typed in FORMATS else FORMAT_ALIASES.get(typed)


# --- frameworks -------------------------------------------------------------------------

FRAMEWORKS = ("torch", "flash", "jax", "onnx", "hf")
"""The frameworks whose conventions ``--as`` takes (``engine/conventions.py`` holds
what each does), in the order tables list them."""

FRAMEWORK_DIFFERENCES = ("empty", "alignment", "window")
"""What ``compute --frameworks`` puts a row two frameworks differ on down to: a row
with no visible key, the causal diagonal, the window's counting."""

# --- options ----------------------------------------------------------------------------

SCALE_NAMES = ("sqrt-dk", "dk", "none")
"""``--scale``'s words (besides a number)."""

ALIGNMENTS = ("upper-left", "lower-right", "lower-right-per-item")
"""``--causal-align``: where the causal diagonal and the window sit when L ≠ S: at the
top left (j ≤ i), at the bottom right of the padded shapes (j ≤ i + S − L, every item),
or at the bottom right of each item's own lengths (j ≤ i + S_b − L_b, S_b and L_b its
``--key-lengths`` and ``--query-lengths``: FlashAttention's ``seqused_k`` and
``cache_seqlens``, ONNX's ``nonpad_kv_seqlen``)."""

MASK_TRUE_MEANS = ("attend", "masked")
"""What True means in a boolean mask (``--mask-true-means``)."""

LAYOUTS = ("bhsd", "bshd")
"""How Q, K, V (and the output) lay out their last three axes (``--layout``)."""

BACKENDS = ("numpy", "torch")
"""The array libraries that compute (``--backend``; ``auto`` picks one of them)."""

MASK_VALUE_NAMES = ("-inf", "finfo-min")
"""``--mask-value``'s words (besides a number)."""

# --- sdpa check -------------------------------------------------------------------------

TOLERANCE_RULES = ("kernel", "dtype", "measured")
"""``--tolerance``: each element no worse than the plain computation × the fudge factor
(kernel), PyTorch's fixed tolerances for the dtype, or PyTorch's get_tolerances."""

ERROR_STATS = (
    *(
        f"{kind}_{stat}"
        for kind in ("abs", "rel")
        for stat in ("mean", "median", "p90", "p99", "max")
    ),
    "cosine_min",
)
"""What ``--max-error`` may limit: each at most its value, ``cosine_min`` at least."""

# --- sdpa report model ------------------------------------------------------------------

MODEL_METRICS = (
    "entropy",
    "max_weight",
    "saturated",
    "near_uniform",
    "fully_masked",
    "sink_mass",
    "error",
)
"""The layer × head grid's statistics, in the order ``--metric all`` shows them
(``diagnosis/model.py`` defines each)."""

NOTABLE_HEADS = ("sink", "dead", "saturated")
"""What a notable head of the grid is, in the order listed."""

# --- sdpa diff --------------------------------------------------------------------------

PAIRINGS = ("name", "layer", "order")
"""How ``sdpa diff`` pairs two runs' calls, in the order it tries them."""

COMPARED = ("q", "k", "v", "bias", "output")
"""What ``sdpa diff`` compares of each pair of calls: the inputs, what is added to the
logits (a bias and a float mask's values: ALiBi, relative positions), the output."""

DIVERGENCES = ("upstream", "kernel")
"""Where a call of run B parts from run A's: upstream of attention (Q, K, V, the mask,
a shape, the scale), or in the kernel (an output that fails against its own inputs)."""

DIFF_RUNS = ("a", "b")
"""The two runs ``sdpa diff`` compares: A, the reference, and B, judged against it."""
