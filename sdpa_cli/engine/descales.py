"""FP8 descale factors: Q, K and V stored in FP8 with a scale each, as FlashAttention-3's
and PyTorch's FP8 attention take them (``q_descale``, ``k_descale``, ``v_descale``).

The real values are ``q_fp8 · q_descale`` (and K's, V's). A descale is a positive number
(per tensor) or a tensor of shape ``(B, G)`` (per batch item and key/value head, as
FlashAttention-3's ``(batch, nheads_kv)``; query head h reads its group's, h // (H/G)), or
``(G,)`` or ``(1,)``; one not given is 1.

Descales are float32, as the kernels hold them. An FP8 value has 4 significant bits
(e4m3; 3 for e5m2) and a float32 descale 24, so their product is exact in float64, and
so is that product divided by the descale again. The spec therefore keeps Q, K and V
dequantized (what the float64 reference, the findings and the gradients read: the real
values), and the FP8 kernel's emulation divides them back to the FP8 values exactly
(:mod:`sdpa_cli.engine.fp8`). Knows nothing of the spec: arrays and shapes in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine import precision
from sdpa_cli.engine.types import F64, Index
from sdpa_cli.errors import SpecError
from sdpa_cli.names import FP8_FORMATS
from sdpa_cli.text import format_index, shape, shown

F32 = NDArray[np.float32]


@dataclass(frozen=True)
class Descales:
    """The descales of one computation, each float32 and broadcast to ``(B, G)`` (1 for
    one not given), and the FP8 format Q, K and V are stored in.

    Attributes:
        q, k, v: ``(B, G)`` descales (B: the batch axis of the lead, 1 without one).
        fmt: ``float8_e4m3fn`` or ``float8_e5m2``.
        given: each descale given, float32 in the shape it came in (``()``: a number).
        labels: where each came from (``--q-descale``, a file, a case file's entry).
    """

    q: F32
    k: F32
    v: F32
    fmt: str
    given: Mapping[str, F32]
    labels: Mapping[str, str]

    def at(self, lead: Index, group: int) -> tuple[float, float, float]:
        """The descales of Q, K and V that the slice at ``lead`` reads: its batch item's
        (the lead's second-last axis) and its key/value head's (the last, ÷ group)."""
        b = lead[-2] if len(lead) >= 2 and self.q.shape[0] > 1 else 0
        g = lead[-1] // group if lead and self.q.shape[1] > 1 else 0
        return float(self.q[b, g]), float(self.k[b, g]), float(self.v[b, g])

    def payload(self) -> dict[str, Any]:
        """The descales as given (a number, or nested lists; None: not given) and the FP8
        format: a report's setup."""
        values: dict[str, Any] = {"format": self.fmt}
        for name in ("q_descale", "k_descale", "v_descale"):
            given = self.given.get(name)
            values[name] = None if given is None else np.asarray(given, np.float64).tolist()
        return values


def check_descale(name: str, values: NDArray[Any], label: str, B: int, G: int) -> F32:
    """A descale validated: numbers of a shape that broadcasts to ``(B, G)`` (``()``,
    ``(1,)``, ``(G,)``, ``(B, G)``, ...), each positive and finite in float32 (the
    kernels' format); returned float32, in its own shape.

    Raises:
        SpecError: naming ``label`` (the flag, or the file), what was expected and what came.
    """
    if values.dtype == np.bool_ or not (
        values.dtype.kind in "iuf" or precision.is_float(values.dtype)
    ):
        raise SpecError(label, f"{name} has dtype {values.dtype}; expected positive numbers")
    shapes = "a number, (G,)" + f" = ({G},) or (B, G) = ({B}, {G}) (batch, kv heads)"
    try:
        fits = values.ndim <= 2 and np.broadcast_shapes(values.shape, (B, G)) == (B, G)
    except ValueError:
        fits = False
    if not fits:
        raise SpecError(label, f"{name} should be {shapes}: but got shape {shape(values.shape)}")
    with np.errstate(over="ignore", invalid="ignore"):
        as32 = np.asarray(values, np.float64).astype(np.float32)
        bad = ~(np.isfinite(as32) & (as32 > 0))
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        got = shown(float(np.asarray(values, np.float64)[at]))
        rule = "positive, finite in float32 (the kernels' format)"
        if not at:  # one number (--q-descale X)
            raise SpecError(label, f"must be a positive number, finite in float32, got {got}")
        raise SpecError(label, f"{name} must hold numbers {rule}: got {got} at {format_index(at)}")
    return as32


def fp8_format(dtype: str, stored: str) -> str:
    """The FP8 format of inputs given with descales: ``--dtype``'s when it is one, else the
    files' (``stored``, Q's dtype) when it is one, else float8_e4m3fn."""
    for name in (dtype, stored):
        if name in FP8_FORMATS:
            return name
    return FP8_FORMATS[0]


def quantized(name: str, values: NDArray[Any], fmt: str, label: str) -> F64:
    """``values`` rounded to the FP8 format (a no-op for FP8 values), in float64.

    Raises:
        SpecError: a finite value beyond the format's range (the descale belongs beside
            the quantized values, not the real ones).
    """
    wide = np.asarray(values, np.float64)
    rounded = precision.round_to(wide, fmt)
    with np.errstate(invalid="ignore"):
        lost = np.isfinite(wide) & ~np.isfinite(rounded)
    if lost.any():
        at = tuple(int(i) for i in np.argwhere(lost)[0])
        raise SpecError(
            label,
            f"{name} holds {shown(float(wide[at]))} at {format_index(at)}, beyond {fmt}'s range "
            f"(±{precision.fmt(fmt).max:g}): with descales, {name} holds the FP8 values "
            "(the real values ÷ the descale)",
        )
    return rounded


def over_lead(descale: F32, n_lead: int, group: int, heads: bool) -> F64:
    """A ``(B, G)`` descale shaped to multiply an operand ``(*lead, rows, dim)``: over
    the query heads (each group's repeated) when ``heads``, else over the kv heads."""
    x: F64 = np.asarray(np.repeat(descale, group, axis=1) if heads else descale, np.float64)
    if n_lead == 0:
        x = x.reshape(())
    elif n_lead == 1:
        x = x[0]
    else:
        x = x.reshape((1,) * (n_lead - 2) + x.shape)
    return x[..., None, None]


def unit_descale(B: int, G: int) -> F32:
    """A descale of 1 everywhere: one not given."""
    return np.ones((B, G), np.float32)


def broadcast(values: F32, B: int, G: int) -> F32:
    """A validated descale as ``(B, G)``."""
    return np.ascontiguousarray(np.broadcast_to(values, (B, G)))
