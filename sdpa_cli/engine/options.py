"""The options of a computation, parsed and validated apart from any tensor.

Each option is parsed from text (a flag) or data (a case file, a manifest) by one
parser; an error names the flag (``--causal-align``) or the file and key it came from.

Options are kept twice, once each way: as typed (:attr:`Options.typed`: the values
the user gave, parsed, in their own terms: a window in ``--as``'s framework's) and
as resolved (the fields: what the engine computes, after ``--as``'s defaults and
conversions and the working formats' defaults), resolved once, in
:func:`parse_options`. What speaks to the user (a hint, the header, ``--frameworks``)
reads the typed form; the engine reads the resolved one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sdpa_cli.engine import precision
from sdpa_cli.engine.conventions import convention
from sdpa_cli.engine.expressions import parse_mask_mod, parse_score_mod
from sdpa_cli.errors import SpecError
from sdpa_cli.names import (
    ALIGNMENTS,
    FORMATS,
    LAYOUTS,
    MASK_TRUE_MEANS,
    SCALE_NAMES,
    format_name,
)
from sdpa_cli.text import shown

FINFO_MIN = float(np.finfo(np.float64).min)
"""How ``finfo-min`` is stored: resolved against the working format when used."""
MAX_SEED = 2**128 - 1
"""Dropout's Philox key is 128 bits."""


@dataclass(frozen=True)
class Options:
    """Every computation option, with its default. See the README's order of operations."""

    scale: str | float = "sqrt-dk"
    temperature: float = 1.0
    softcap: float | None = None
    alibi: bool = False
    causal: bool = False
    causal_align: str = "upper-left"
    mask_true_means: str = "attend"
    key_lengths: tuple[int, ...] | None = None
    query_offset: tuple[int, ...] | None = None
    """KV-cache steps: the absolute position of query 0 in each batch item (the cache
    length before the new tokens), or in each packed document; replaces ``causal_align``
    for causal, window, chunks, ALiBi. Negative when an item has more queries than keys
    (its first queries then see no key)."""
    query_lengths: tuple[int, ...] | None = None
    """Valid queries per batch item: later rows are absent (zero output, not judged)."""
    cu_seqlens: tuple[int, ...] | None = None
    """Packed documents (FlashAttention's varlen): cumulative lengths along L; document
    d holds queries cu[d] .. cu[d+1] and sees only its own keys."""
    cu_seqlens_k: tuple[int, ...] | None = None
    """The documents' cumulative lengths along S (default: ``cu_seqlens``)."""
    window: tuple[int, int] | None = None
    attention_chunk: int | None = None
    """Chunked attention (Llama 4's ``attention_chunk_size``, FlashAttention's
    ``attention_chunk``): the query at position p sees only the keys of its own chunk of
    that many positions, p − p mod C ≤ j < p − p mod C + C."""
    mask_mod: str | None = None
    """FlexAttention's mask_mod over b, h, q_idx, kv_idx: False hides the key."""
    score_mod: str | None = None
    """FlexAttention's score_mod over score, b, h, q_idx, kv_idx: replaces the scaled
    scores (before the mask; instead of --softcap, --bias and --alibi)."""
    mask_value: float = -math.inf
    dropout: float = 0.0
    seed: int = 0
    heads: int | None = None
    kv_heads: int | None = None
    layout: str = "bhsd"
    dtype: str = "float64"
    accumulate: str = "float32"
    softmax_dtype: str = "float32"
    logits_dtype: str = "same"
    prescale: bool = False
    framework: str | None = None
    """``--as``: the framework whose conventions set the defaults (recorded; applied by
    :func:`parse_options`, see :mod:`sdpa_cli.engine.conventions`)."""
    typed: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The options as the user gave them (parsed, not resolved), by name: only those
    given. Empty for options built directly, whose fields are what was given."""

    def __post_init__(self) -> None:
        # Options built directly (the Python API) get the checks parse_options makes,
        # and an alias (fp16, bf16) their format's name.
        object.__setattr__(self, "dtype", parse_format(self.dtype, "dtype"))
        _choice(self.layout, "layout", LAYOUTS)
        for name in ("accumulate", "softmax_dtype", "logits_dtype"):
            value = getattr(self, name)
            object.__setattr__(self, name, _working_format(name, value, self.dtype, name))

    def as_typed(self, name: str) -> Any:
        """Option ``name`` as the user gave it, else as resolved (a default)."""
        return self.typed[name] if name in self.typed else getattr(self, name)

    def typed_window(self, window: tuple[int, int]) -> tuple[int, int]:
        """A window in the engine's terms (``--window``'s: the query left out) as the
        user would type it under ``--as`` (Hugging Face's counts the query)."""
        if self.framework is not None and convention(self.framework).window_counts_query:
            return window[0] + 1, window[1]
        return window

    @property
    def window_as_typed(self) -> tuple[int, int] | None:
        """The window as the user gave it (in ``--as``'s terms), or the resolved one in
        those terms when built directly; None without a window."""
        if self.window is None:
            return None
        typed = self.typed.get("window")
        return (typed[0], typed[1]) if typed is not None else self.typed_window(self.window)

    @property
    def placed(self) -> bool:
        """Whether a mask is placed by the queries' positions (a causal mask, a window,
        chunks): what ``--causal-align`` and ``--query-offset`` move."""
        return self.causal or self.window is not None or self.attention_chunk is not None

    @property
    def hides_by_position(self) -> bool:
        """Whether an option hides keys by position: a placed mask, key or query
        lengths, packed documents (the masks that take the mask value, no file's)."""
        lengths = self.key_lengths is not None or self.query_lengths is not None
        return self.placed or lengths or self.cu_seqlens is not None

    @property
    def emulated(self) -> bool:
        """Whether the pipeline runs in a format narrower than float64 (``--dtype``)."""
        return self.dtype != "float64"

    @property
    def mask_value_is_finfo_min(self) -> bool:
        return self.mask_value == FINFO_MIN

    def mask_value_in(self, name: str) -> float:
        """The mask value in the format ``name``: ``finfo-min`` is that format's most
        negative number, as PyTorch's ``torch.finfo(dtype).min``; others are as given."""
        return -precision.fmt(name).max if self.mask_value_is_finfo_min else self.mask_value

    @property
    def effective_mask_value(self) -> float:
        """The hidden logits' value in the working format (float64, or ``--dtype``)."""
        return self.mask_value_in(self.dtype)

    @property
    def mask_value_label(self) -> str:
        """How the mask value reads: ``-inf``, ``finfo-min (float16)`` or the number."""
        if self.mask_value == -math.inf:
            return "-inf"
        if self.mask_value_is_finfo_min:
            return f"finfo-min ({self.dtype}: {self.effective_mask_value:.6g})"
        return f"{self.mask_value:g}"


OPTION_NAMES = tuple(name for name in Options.__dataclass_fields__ if name != "typed")


def per_item(values: tuple[int, ...], n: int) -> tuple[int, ...]:
    """A per-item option's values for ``n`` items (batch items, packed documents): one
    value serves every item."""
    return values if len(values) > 1 else values * n


# --- parsing option values (from the command line as text, or a case file as data) ---


def parse_number(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise SpecError(where, f"expected a number, got {shown(value)}")
    try:
        x = float(value)
    except OverflowError:  # an integer beyond float64's range: as far as a float goes
        x = math.inf if value > 0 else -math.inf
    except (TypeError, ValueError):
        raise SpecError(where, f"expected a number, got {shown(value)}") from None
    if math.isnan(x):
        raise SpecError(where, "expected a number, got NaN")
    return x


def _positive(value: Any, where: str) -> float:
    x = parse_number(value, where)
    if not (math.isfinite(x) and x > 0):
        raise SpecError(where, f"must be a positive finite number, got {shown(value)}")
    return x


def _int(value: Any, where: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    if isinstance(value, bool):
        raise SpecError(where, f"expected an integer, got {shown(value)}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise SpecError(where, f"expected an integer, got {shown(value)}") from None
    if not isinstance(value, int):
        raise SpecError(where, f"expected an integer, got {shown(value)}")
    if value < minimum:
        raise SpecError(where, f"must be ≥ {minimum}, got {shown(value)}")
    if maximum is not None and value > maximum:
        limit = (
            f"{maximum} (2**31 − 1, as kernels hold positions)"
            if maximum == MAX_POSITION
            else maximum
        )
        raise SpecError(where, f"must be ≤ {limit}, got {shown(value)}")
    return value


MAX_POSITION = 2**31 - 1
"""The largest offset, length or window an option may give, as kernels hold them
(FlashAttention's and ONNX's int32 sequence lengths and offsets): a position far inside
int64, where the masks compare them, and whose ALiBi distance keeps a score's digits in
float64 (past 2**63 positions wrapped, and rows that see every key were judged fully
masked; past 2**53 they round)."""


def _int_list(
    value: Any, where: str, *, minimum: int = 0, maximum: int = MAX_POSITION
) -> tuple[int, ...]:
    if isinstance(value, str):
        parts: list[Any] = [p for p in value.split(",")]
        if any(not p.strip() for p in parts):
            raise SpecError(where, f"expected integers separated by commas, got {shown(value)}")
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        parts = [value]
    if not parts:
        raise SpecError(where, "expected at least one integer")
    return tuple(_int(p, where, minimum=minimum, maximum=maximum) for p in parts)


def _choice(value: Any, where: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise SpecError(where, f"expected one of {', '.join(choices)}, got {shown(value)}")
    return str(value)


def parse_format(value: Any, where: str, words: tuple[str, ...] = ()) -> str:
    """A format (:data:`~sdpa_cli.names.FORMATS`) by its name or an alias people type
    (``fp16``, ``half``, ``bf16``, ``fp32``, ``torch.float16``: :data:`~sdpa_cli.names.FORMAT_ALIASES`),
    as its name; or one of ``words`` (``same``). Errors list the names only."""
    if isinstance(value, str) and value.strip().lower() in words:
        return value.strip().lower()
    name = format_name(value)
    if name is None:
        choices = ", ".join((*FORMATS, *words))
        raise SpecError(where, f"expected one of {choices}, got {shown(value)}")
    return name


def parse_bool(value: Any, where: str) -> bool:
    """A true boolean (a YAML or JSON ``true``/``false``); text such as ``"yes"`` is refused."""
    if isinstance(value, bool):
        return value
    raise SpecError(where, f"expected true or false, got {shown(value)}")


def parse_scale(value: Any, where: str = "--scale") -> str | float:
    """``sqrt-dk`` (1/√E), ``dk`` (1/E), ``none`` (1) or a positive number."""
    if isinstance(value, str) and value.strip().lower() in SCALE_NAMES:
        return value.strip().lower()
    try:
        return _positive(value, where)
    except SpecError:
        raise SpecError(
            where, f"expected sqrt-dk, dk, none or a positive number, got {shown(value)}"
        ) from None


def scale_factor(rule: str | float, E: int) -> float:
    """The factor on Q Kᵀ a ``--scale`` rule gives at key dim E (1 for E = 0)."""
    if rule == "sqrt-dk":
        return 1.0 / math.sqrt(E) if E else 1.0
    if rule == "dk":
        return 1.0 / E if E else 1.0
    if rule == "none":
        return 1.0
    return float(rule)


def parse_window(value: Any, where: str = "--window") -> tuple[int, int]:
    """``W`` (left = right = W) or ``LEFT,RIGHT``, each a non-negative integer."""
    sizes = _int_list(value, where)
    if len(sizes) == 1:
        return sizes[0], sizes[0]
    if len(sizes) == 2:
        return sizes[0], sizes[1]
    raise SpecError(where, f"expected W or LEFT,RIGHT, got {shown(value)}")


def parse_mask_value(value: Any, where: str = "--mask-value") -> float:
    """``-inf``, ``finfo-min`` (the working format's most negative number) or a negative number."""
    if isinstance(value, str) and value.strip().lower() == "finfo-min":
        return FINFO_MIN
    x = parse_number(value, where)
    if not x < 0:
        raise SpecError(
            where, f"must be negative (-inf, finfo-min or e.g. -1e9), got {shown(value)}"
        )
    return x


def _dropout(value: Any, where: str) -> float:
    p = parse_number(value, where)
    if not 0.0 <= p < 1.0:
        raise SpecError(where, f"must be in [0, 1), got {shown(value)}")
    return p


_PARSERS: dict[str, Any] = {
    "scale": parse_scale,
    "temperature": _positive,
    "softcap": _positive,
    "alibi": parse_bool,
    "causal": parse_bool,
    "causal_align": lambda v, w: _choice(v, w, ALIGNMENTS),
    "mask_true_means": lambda v, w: _choice(v, w, MASK_TRUE_MEANS),
    "key_lengths": _int_list,
    "query_offset": lambda v, w: _int_list(v, w, minimum=-MAX_POSITION),
    "query_lengths": _int_list,
    "cu_seqlens": _int_list,
    "cu_seqlens_k": _int_list,
    "window": parse_window,
    "attention_chunk": lambda v, w: _int(v, w, minimum=1, maximum=MAX_POSITION),
    "mask_mod": parse_mask_mod,
    "score_mod": parse_score_mod,
    "mask_value": parse_mask_value,
    "dropout": _dropout,
    "seed": lambda v, w: _int(v, w, maximum=MAX_SEED),
    "heads": lambda v, w: _int(v, w, minimum=1),
    "kv_heads": lambda v, w: _int(v, w, minimum=1),
    "layout": lambda v, w: _choice(v, w, LAYOUTS),
    "dtype": parse_format,
    "accumulate": lambda v, w: parse_format(v, w, ("same",)),
    "softmax_dtype": lambda v, w: parse_format(v, w, ("same",)),
    "logits_dtype": lambda v, w: parse_format(v, w, ("same",)),
    "prescale": parse_bool,
    "framework": lambda v, w: convention(v, w).name,
}


def parse_options(raw: Mapping[str, Any], where: Mapping[str, str] | None = None) -> Options:
    """Validate option values given as text or data; ``None`` values keep the default.

    Args:
        raw: option name (``causal_align``) → value as typed or as read from a case file.
        where: option name → how to name it in an error (``--causal-align``, or
            ``case.yaml: causal_align``). Defaults to the flag spelling.
    """
    where = where or {}
    values: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in _PARSERS:
            raise SpecError(where.get(name, name), "is not an option")
        if value is None:
            continue
        label = where.get(name, _flag(name))
        values[name] = _PARSERS[name](value, label)
    typed = {name: values[name] for name in OPTION_NAMES if name in values}  # in one order
    if values.get("framework") is not None:
        _apply_convention(values, where)
    dtype = values.get("dtype", "float64")
    for name in ("accumulate", "softmax_dtype", "logits_dtype"):
        label = where.get(name, "--" + name.replace("_", "-"))
        values[name] = _working_format(name, values.get(name), dtype, label, raw.get(name))
    return Options(**values, typed=typed)


def _flag(name: str) -> str:
    return "--as" if name == "framework" else "--" + name.replace("_", "-")


def _apply_convention(values: dict[str, Any], where: Mapping[str, str]) -> None:
    """``--as``: the framework's causal alignment and mask value where no flag gives
    one, and a given window read in its terms (Hugging Face's counts the query)."""
    conv = convention(values["framework"])
    label = where.get("framework", "--as")
    for name, text in conv.defaults().items():
        # --query-offset places each item's queries itself, in place of an alignment.
        placed = name == "causal_align" and values.get("query_offset") is not None
        if name not in values and not placed:
            values[name] = _PARSERS[name](text, label)
    if values.get("window") is not None:
        values["window"] = conv.window(values["window"], where.get("window", "--window"))


_FORMAT_DEFAULTS = {"accumulate": "float32", "softmax_dtype": "float32", "logits_dtype": "same"}


def _working_format(
    name: str, chosen: str | None, dtype: str, label: str, typed: Any = None
) -> str:
    """``--accumulate``/``--softmax-dtype``/``--logits-dtype``: float64, float32 or the
    ``--dtype`` format (``same``), by name or alias; ``typed``: as the user gave it,
    for the message (default ``chosen``)."""
    given = chosen
    chosen = _FORMAT_DEFAULTS[name] if chosen is None else parse_format(chosen, label, ("same",))
    if chosen == "same":
        chosen = dtype
    if chosen not in ("float64", "float32", dtype):
        shown_as = typed if typed is not None else given
        raise SpecError(
            label,
            f"must be float64, float32 or the --dtype format ({dtype}), got {shown(shown_as)}",
        )
    return chosen
