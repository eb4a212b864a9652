"""A frozen :class:`AttentionSpec`: the inputs and options, validated once at the entry.

Axis letters everywhere: B batch, H query heads, G key/value heads, L query length,
S key length, E key dim, Ev value dim. Tensors are read as PyTorch reads them,
Q ``(..., L, E)``, K ``(..., S, E)``, V ``(..., S, Ev)``; the leading axes broadcast,
and the last leading axis is the head axis (H for Q, G for K and V). When G < H and
G divides H, query head h reads key/value head h // (H/G) (grouped-query attention).

Tensors are kept as loaded (memory-mapped, integer, float16, ...) and reshaped only
by views: the engine casts one block at a time to float64.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine import precision
from sdpa_cli.engine.masks import ALIGNMENTS, alibi_slopes
from sdpa_cli.engine.precision import FORMATS
from sdpa_cli.errors import SpecError
from sdpa_cli.text import shown

SCALE_NAMES = ("sqrt-dk", "dk", "none")
FINFO_MIN = float(np.finfo(np.float64).min)
"""How ``finfo-min`` is stored: resolved against the working format when used."""
MASK_TRUE_MEANS = ("attend", "masked")
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
    window: tuple[int, int] | None = None
    mask_value: float = -math.inf
    dropout: float = 0.0
    seed: int = 0
    heads: int | None = None
    dtype: str = "float64"
    accumulate: str = "float32"
    softmax_dtype: str = "float32"
    logits_dtype: str = "same"
    prescale: bool = False

    def __post_init__(self) -> None:
        # Options built directly (the Python API) get the checks parse_options makes.
        _choice(self.dtype, "dtype", FORMATS)
        for name in ("accumulate", "softmax_dtype", "logits_dtype"):
            value = getattr(self, name)
            object.__setattr__(self, name, _working_format(name, value, self.dtype, name))

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


OPTION_NAMES = tuple(Options.__dataclass_fields__)


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
        raise SpecError(where, f"must be ≤ {maximum}, got {shown(value)}")
    return value


def _int_list(value: Any, where: str) -> tuple[int, ...]:
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
    return tuple(_int(p, where) for p in parts)


def _choice(value: Any, where: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise SpecError(where, f"expected one of {', '.join(choices)}, got {shown(value)}")
    return str(value)


def _bool(value: Any, where: str) -> bool:
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
    "alibi": _bool,
    "causal": _bool,
    "causal_align": lambda v, w: _choice(v, w, ALIGNMENTS),
    "mask_true_means": lambda v, w: _choice(v, w, MASK_TRUE_MEANS),
    "key_lengths": _int_list,
    "window": parse_window,
    "mask_value": parse_mask_value,
    "dropout": _dropout,
    "seed": lambda v, w: _int(v, w, maximum=MAX_SEED),
    "heads": lambda v, w: _int(v, w, minimum=1),
    "dtype": lambda v, w: _choice(v, w, FORMATS),
    "accumulate": lambda v, w: _choice(v, w, (*FORMATS, "same")),
    "softmax_dtype": lambda v, w: _choice(v, w, (*FORMATS, "same")),
    "logits_dtype": lambda v, w: _choice(v, w, (*FORMATS, "same")),
    "prescale": _bool,
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
        label = where.get(name, "--" + name.replace("_", "-"))
        values[name] = _PARSERS[name](value, label)
    dtype = values.get("dtype", "float64")
    for name in ("accumulate", "softmax_dtype", "logits_dtype"):
        label = where.get(name, "--" + name.replace("_", "-"))
        values[name] = _working_format(name, values.get(name), dtype, label)
    return Options(**values)


_FORMAT_DEFAULTS = {"accumulate": "float32", "softmax_dtype": "float32", "logits_dtype": "same"}


def _working_format(name: str, chosen: str | None, dtype: str, label: str) -> str:
    """``--accumulate``/``--softmax-dtype``/``--logits-dtype``: float64, float32 or the
    ``--dtype`` format (``same``)."""
    chosen = _FORMAT_DEFAULTS[name] if chosen is None else chosen
    if chosen == "same":
        chosen = dtype
    if chosen not in ("float64", "float32", dtype):
        raise SpecError(
            label, f"must be float64, float32 or the --dtype format ({dtype}), got {shown(chosen)}"
        )
    return chosen


# --- the spec ---


@dataclass(frozen=True)
class AttentionSpec:
    """Validated inputs and options of one attention computation.

    ``q``, ``k``, ``v``, ``bias`` and ``mask`` are views of the loaded arrays with
    ``len(lead) + 2`` dimensions (leading 1s added, heads split when ``--heads`` is
    given); they are not cast, broadcast or copied.

    Attributes:
        lead: the broadcast leading shape of the scores, ``(..., B, H)``.
        L, S, E, Ev: query length, key length, key dim, value dim.
        scale: the effective factor on Q Kᵀ before the temperature.
        group: query heads per key/value head (1 without grouped-query attention).
        names: tensor name → the file (or case-file entry) it came from, for messages.
        shapes: tensor name → the shape as loaded.
    """

    q: NDArray[Any]
    k: NDArray[Any]
    v: NDArray[Any]
    bias: NDArray[Any] | None
    mask: NDArray[Any] | None
    options: Options
    lead: tuple[int, ...]
    L: int
    S: int
    E: int
    Ev: int
    scale: float
    group: int
    names: Mapping[str, str] = field(default_factory=dict)
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def mask_is_bool(self) -> bool:
        return self.mask is not None and self.mask.dtype == np.bool_

    @cached_property
    def alibi_slopes(self) -> NDArray[np.float64]:
        """One ALiBi slope per query head, computed once."""
        return alibi_slopes(self.H)

    @property
    def H(self) -> int:
        """Query heads: the last leading axis (1 when there is none)."""
        return self.lead[-1] if self.lead else 1

    @property
    def weights_shape(self) -> tuple[int, ...]:
        return (*self.lead, self.L, self.S)

    @property
    def output_shape(self) -> tuple[int, ...]:
        return (*self.lead, self.L, self.Ev)

    @property
    def merged_output_shape(self) -> tuple[int, ...]:
        """The output's shape as returned: heads merged back under ``--heads``."""
        if self.options.heads is None:
            return self.output_shape
        return (*self.lead[:-1], self.L, self.options.heads * self.Ev)

    @property
    def scale_label(self) -> str:
        """The scale as a formula: ``1/√8 = 0.353553``."""
        s = self.options.scale
        if s == "sqrt-dk":
            return f"1/√d_k = 1/√{self.E} = {self.scale:.6g}"
        if s == "dk":
            return f"1/d_k = 1/{self.E} = {self.scale:.6g}"
        if s == "none":
            return "none (1)"
        return f"{self.scale:.6g} (given)"

    def with_scale(self, rule: str | float) -> AttentionSpec:
        """The same computation under another ``--scale`` (``sqrt-dk``, ``dk``, ``none``, X)."""
        options = dataclasses.replace(self.options, scale=rule)
        return dataclasses.replace(self, options=options, scale=scale_factor(rule, self.E))

    def as_loaded(self, name: str, values: NDArray[Any] | None = None) -> NDArray[Any]:
        """Operand ``name`` (or ``values`` shaped like it, e.g. its gradient) in the shape
        it was loaded in, so that indices match the file: heads merged back under
        ``--heads``, the leading 1s the spec added dropped."""
        arr = np.asarray(getattr(self, name) if values is None else values)
        if self.options.heads is not None and name in ("q", "k", "v"):
            merged = np.moveaxis(arr, -3, -2)  # (..., L, heads, D/heads), undoing the split
            arr = merged.reshape(*merged.shape[:-2], -1)
        shape = self.shapes.get(name)
        if shape is not None and math.prod(shape) == arr.size:
            return arr.reshape(shape)
        return arr

    def in_float64(self) -> AttentionSpec:
        """The same computation in float64 throughout (``--dtype`` and its formats dropped)."""
        if not self.options.emulated:
            return self
        wide = dataclasses.replace(
            self.options,
            dtype="float64",
            accumulate="float64",
            softmax_dtype="float64",
            logits_dtype="float64",
        )
        return dataclasses.replace(self, options=wide)

    def operand_index(self, name: str, lead_index: tuple[int, ...]) -> tuple[int, ...]:
        """The index into operand ``name`` for one position of the broadcast lead.

        A broadcast axis (size 1) reads index 0; the key/value head axis reads
        h // group (grouped-query attention); any other axis reads the index as is.
        """
        arr = getattr(self, name)
        return tuple(
            0 if d == 1 else m // (D // d)
            for m, d, D in zip(lead_index, arr.shape[:-2], self.lead, strict=True)
        )


_NUMERIC_KINDS = "biuf"


def _check_numeric(name: str, label: str, a: NDArray[Any]) -> None:
    if a.dtype.names is not None or not (
        a.dtype.kind in _NUMERIC_KINDS or precision.is_float(a.dtype)
    ):
        raise SpecError(label, f"{name} has dtype {a.dtype}; expected numbers (float, int or bool)")


def _split_heads(a: NDArray[Any], n: int, name: str, label: str) -> NDArray[Any]:
    """(..., L, D) → (..., n, L, D/n), as a view."""
    D = a.shape[-1]
    if D % n:
        raise SpecError(
            "--heads", f"{name}'s last axis ({D}, from {label}) is not divisible by {shown(n)}"
        )
    parts = a.reshape(*a.shape[:-1], n, D // n)
    return np.moveaxis(parts, -2, -3)


def _pad(a: NDArray[Any], lead_len: int) -> NDArray[Any]:
    """Add leading axes of size 1 so that ``a`` has ``lead_len + 2`` dimensions."""
    return a.reshape((1,) * (lead_len + 2 - a.ndim) + a.shape)


def build_spec(
    q: NDArray[Any],
    k: NDArray[Any],
    v: NDArray[Any],
    *,
    bias: NDArray[Any] | None = None,
    mask: NDArray[Any] | None = None,
    options: Options | None = None,
    names: Mapping[str, str] | None = None,
) -> AttentionSpec:
    """Check shapes and options once and return the frozen spec.

    Args:
        q, k, v: Q ``(..., L, E)`` (1-D: one query), K ``(..., S, E)``, V ``(..., S, Ev)``.
        bias: additive, broadcastable to the scores ``(..., L, S)``.
        mask: boolean (True = may attend, unless ``mask_true_means='masked'``) or
            numeric (added to the logits), broadcastable to ``(..., L, S)``.
        options: the computation options.
        names: tensor name (``q``, ``k``, ``v``, ``bias``, ``mask``) → source, for messages.

    Raises:
        SpecError: naming the tensor or option, with what was expected and what came.
    """
    opts = options or Options()
    labels = {
        n: (names or {}).get(n, n.upper() if n in "qkv" else f"--{n}")
        for n in ("q", "k", "v", "bias", "mask")
    }
    tensors = {"q": q, "k": k, "v": v}
    shapes = {n: tuple(a.shape) for n, a in tensors.items()}
    for extra, arr in (("bias", bias), ("mask", mask)):
        if arr is not None:
            shapes[extra] = tuple(arr.shape)
    for n, a in {**tensors, "bias": bias, "mask": mask}.items():
        if a is not None:
            _check_numeric(n.upper() if n in "qkv" else n, labels[n], a)

    # A 1-D tensor is one row (one query, one key, one value).
    q, k, v = (a.reshape(1, -1) if a.ndim == 1 else a for a in (q, k, v))
    for n, a in (("Q", q), ("K", k), ("V", v)):
        if a.ndim == 0:
            raise SpecError(
                labels[n.lower()], f"{n} is a scalar; expected a matrix ({n}: (..., rows, dim))"
            )
    if opts.heads is not None:
        q = _split_heads(q, opts.heads, "Q", labels["q"])
        k = _split_heads(k, opts.heads, "K", labels["k"])
        v = _split_heads(v, opts.heads, "V", labels["v"])

    L, E = q.shape[-2:]
    S, Ek = k.shape[-2:]
    Sv, Ev = v.shape[-2:]
    if Ek != E:
        raise SpecError(
            labels["k"],
            f"K's last axis should equal Q's key dim E = {E} (Q {shapes['q']}): but got K {shapes['k']}",
        )
    if Sv != S:
        raise SpecError(
            labels["v"],
            f"V should have as many rows as K has keys, S = {S} (K {shapes['k']}): "
            f"but got V {shapes['v']}",
        )

    # Grouped-query attention: K and V have G heads, a divisor of Q's H heads.
    q_lead, k_lead, v_lead = q.shape[:-2], k.shape[:-2], v.shape[:-2]
    group = 1
    if k_lead and v_lead and k_lead[-1] != v_lead[-1] and 1 not in (k_lead[-1], v_lead[-1]):
        raise SpecError(
            labels["v"],
            f"K has {k_lead[-1]} heads but V has {v_lead[-1]} (K {shapes['k']}, V {shapes['v']})",
        )
    if q_lead and (k_lead or v_lead):
        H = q_lead[-1]
        G = max(k_lead[-1] if k_lead else 1, v_lead[-1] if v_lead else 1)
        if H != 1 and G not in (1, H):  # H = 1: Q broadcasts over the K/V heads
            if H % G:
                raise SpecError(
                    labels["k"],
                    f"grouped-query attention needs K/V's heads to divide Q's: "
                    f"Q has {H} heads (axis -3 of {shapes['q']}), K/V have {G}",
                )
            group = H // G

    # Broadcast with the key/value head axis stretched to H, so only GQA is special.
    def stretched(lead: tuple[int, ...]) -> tuple[int, ...]:
        if group > 1 and lead and lead[-1] > 1:
            return (*lead[:-1], lead[-1] * group)
        return lead

    try:
        lead = np.broadcast_shapes(q_lead, stretched(k_lead), stretched(v_lead))
    except ValueError:
        raise SpecError(
            labels["k"],
            f"the leading axes of Q {shapes['q']}, K {shapes['k']} and V {shapes['v']} "
            "do not broadcast",
        ) from None

    scores_shape = (*lead, L, S)
    extras: dict[str, NDArray[Any] | None] = {"bias": bias, "mask": mask}
    for n, a in extras.items():
        if a is None:
            continue
        a2 = a.reshape(1, -1) if a.ndim == 1 else a
        if a2.ndim == 0:
            a2 = a2.reshape(1, 1)
        extra_axes = a2.shape[: max(a2.ndim - len(scores_shape), 0)]
        if all(d == 1 for d in extra_axes):  # leading 1s beyond the scores' axes
            a2 = a2.reshape(a2.shape[len(extra_axes) :])
        try:
            out = np.broadcast_shapes(a2.shape, scores_shape)
        except ValueError:
            out = None
        if out != scores_shape:
            raise SpecError(
                labels[n],
                f"{n} of shape {tuple(a.shape)} does not broadcast to the scores' shape "
                f"{scores_shape} (..., L, S)",
            )
        extras[n] = _pad(a2, len(lead))
    if opts.mask_true_means == "masked" and mask is not None and mask.dtype != np.bool_:
        raise SpecError(
            "--mask-true-means", "applies to boolean masks only; this mask holds numbers"
        )

    if opts.key_lengths is not None:
        B = lead[-2] if len(lead) >= 2 else None
        n_given = len(opts.key_lengths)
        if n_given != 1 and n_given != B:
            axis = (
                f"the batch axis has {B} items"
                if B is not None
                else (f"the inputs have no batch axis (scores {scores_shape} read as (H, L, S))")
            )
            raise SpecError(
                "--key-lengths",
                f"{n_given} lengths given but {axis}; give one length or one per item",
            )
        too_long = [n for n in opts.key_lengths if n > S]
        if too_long:
            raise SpecError(
                "--key-lengths", f"{shown(too_long[0])} exceeds the number of keys, S = {S}"
            )

    return AttentionSpec(
        q=_pad(q, len(lead)),
        k=_pad(k, len(lead)),
        v=_pad(v, len(lead)),
        bias=extras["bias"],
        mask=extras["mask"],
        options=opts,
        lead=tuple(lead),
        L=int(L),
        S=int(S),
        E=int(E),
        Ev=int(Ev),
        scale=scale_factor(opts.scale, int(E)),
        group=group,
        names={n: labels[n] for n in labels},
        shapes=shapes,
    )


def scale_factor(rule: str | float, E: int) -> float:
    """The factor on Q Kᵀ a ``--scale`` rule gives at key dim E (1 for E = 0)."""
    if rule == "sqrt-dk":
        return 1.0 / math.sqrt(E) if E else 1.0
    if rule == "dk":
        return 1.0 / E if E else 1.0
    if rule == "none":
        return 1.0
    return float(rule)
