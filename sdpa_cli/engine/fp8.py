"""FP8 attention with descales, emulated as FlashAttention-3's FP8 forward computes it.

With descales (:mod:`sdpa_cli.engine.descales`) and an FP8 ``--dtype``, a block runs as
FlashAttention-3's FP8 forward kernel (hopper) and PyTorch's FP8 attention do:

    S = Q_fp8 · K_fp8ᵀ                       accumulated in float32 (--accumulate)
    x = S · scale · q_descale · k_descale    scores and logits kept in float32
    e = exp(x − max_j x)                      in float32 (--softmax-dtype)
    ℓ = Σ_j e                                 the row sum of the unrounded e, in float32
    P = e rounded to the FP8 format           the kernel keeps P in e4m3 for P·V
    O = (P · V_fp8) · (1/ℓ · v_descale)       accumulated in float32, stored in bfloat16

The raw stage is the real values' product, S · q_descale · k_descale, and the weights are
what the product reads, P / ℓ. The max here is each row's final one: the kernel rounds
each key block's P against the running max instead (its online softmax), a rounding of
the same size that ``sdpa check``'s kernel-relative rule allows for.

Without an FP8 ``--dtype`` the descales only dequantize: a run in float64 (the reference)
or a 16-bit format computes with the real values, Q · q_descale and so on.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine import precision
from sdpa_cli.engine.descales import (
    Descales,
    broadcast,
    check_descale,
    fp8_format,
    over_lead,
    quantized,
    unit_descale,
)
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import F64, Index
from sdpa_cli.errors import SpecError
from sdpa_cli.files.loaders import load_array
from sdpa_cli.names import DESCALES, FP8_FORMATS
from sdpa_cli.text import printable


def flag(name: str) -> str:
    """A descale's flag: ``--q-descale``."""
    return "--" + name.replace("_", "-")


def descale_number(text: str) -> float | None:
    """A descale given as a number (``--q-descale 0.02``), or None: a file's name."""
    try:
        return float(text)
    except ValueError:
        return None


def read_descale(text: str, name: str) -> tuple[NDArray[Any], str]:
    """``--q-descale X|FILE``: a number (one descale for the whole tensor) or a file
    holding a tensor of them; and how messages name it (the flag, or the file)."""
    value = descale_number(text)
    if value is None:
        return load_array(text, name=name), printable(text)
    return np.asarray(value), flag(name)


FP8_OUTPUT = "bfloat16"
"""The format FP8 kernels store their output in (FlashAttention-3's and PyTorch's)."""


def runs_fp8(spec: AttentionSpec, emulate: bool = True) -> bool:
    """Whether blocks run as the FP8 kernel: descales given and an FP8 ``--dtype``."""
    return emulate and spec.descale is not None and spec.options.dtype in FP8_FORMATS


def kernel_descales(
    spec: AttentionSpec, lead: Index, emulate: bool = True
) -> tuple[float, float, float] | None:
    """The slice's descales of Q, K and V when its blocks run as the FP8 kernel (None:
    they do not, :func:`runs_fp8`)."""
    if not runs_fp8(spec, emulate):
        return None
    assert spec.descale is not None
    return spec.descale.at(lead, spec.group)


def judged_in(spec: AttentionSpec, export: str) -> str:
    """The format a check judges an export of the format ``export`` in: an FP8 kernel's
    (descales given) in :data:`FP8_OUTPUT`, its output's (an ulp of FP8 would allow an
    eighth of the row's scale); any other in ``export``."""
    return FP8_OUTPUT if spec.descale is not None and export in FP8_FORMATS else export


def with_descales(
    spec: AttentionSpec, loaded: Mapping[str, NDArray[Any]], names: Mapping[str, str]
) -> AttentionSpec:
    """The spec with descales (those of :data:`~sdpa_cli.names.DESCALES` in ``loaded``;
    ``names``: where each came from): Q, K and V rounded to the FP8 format and kept
    dequantized in float64, the descales beside them. Unchanged without any.

    Raises:
        SpecError: a descale of the wrong shape or not positive, a value of Q, K or V
            beyond the FP8 format, or an option no FP8 kernel takes with them.
    """
    given = {n: loaded[n] for n in DESCALES if loaded.get(n) is not None}
    if not given:
        return spec
    first = names.get(next(iter(given)), "--q-descale")
    o = spec.options
    for refused, why in (
        (o.dropout > 0, "--dropout: FP8 attention kernels run no dropout"),
        (o.prescale, "--prescale: FP8 kernels scale the scores after the product"),
        (spec.qv_width > 0, "--qv: the qv term takes no descale here"),
    ):
        if refused:
            raise SpecError(first, f"descales are not taken with {why}")
    n = len(spec.lead)
    B = spec.lead[-2] if n >= 2 else 1
    G = max(spec.k.shape[-3], spec.v.shape[-3]) if n else 1
    checked = {k: check_descale(k, a, names.get(k, k), B, G) for k, a in given.items()}
    full = {
        k: broadcast(checked[k], B, G) if k in checked else unit_descale(B, G) for k in DESCALES
    }
    fmt = fp8_format(o.dtype, str(spec.q.dtype))
    values = {}
    for key, name, heads in (("q", "Q", True), ("k", "K", False), ("v", "V", False)):
        stored = quantized(name, getattr(spec, key), fmt, names.get(key, name))
        values[key] = stored * over_lead(full[f"{key}_descale"], n, spec.group, heads)
    descales = Descales(
        full["q_descale"],
        full["k_descale"],
        full["v_descale"],
        fmt,
        checked,
        {k: names.get(k, k) for k in checked},
    )
    q, k, v = values["q"], values["k"], values["v"]
    return dataclasses.replace(spec, q=q, k=k, v=v, descale=descales)


def descale_slips(spec: AttentionSpec) -> Iterator[tuple[str, AttentionSpec]]:
    """The slips an FP8 kernel makes with its descales, each as the computation it does
    instead (the real values it reads): a descale left out, K's applied twice, K's in
    place of V's, per-head descales read for the wrong heads (K's and V's of the next kv
    head; Q's tiled over the query heads where they are repeated)."""
    d = spec.descale
    if d is None:
        return
    n, group = len(spec.lead), spec.group
    qd, kd, vd = (over_lead(x, n, group, h) for x, h in ((d.q, True), (d.k, False), (d.v, False)))
    q, k, v = spec.q, spec.k, spec.v
    given = set(d.given)
    for name, key, values, factor in (("q", "Q", q, qd), ("k", "K", k, kd), ("v", "V", v, vd)):
        if f"{name}_descale" in given:
            slip = {name: values / factor}
            label = f"{name}_descale left out ({key}'s {d.fmt} values read as the real ones)"
            yield label, dataclasses.replace(spec, **slip)  # type: ignore[arg-type]
    if "k_descale" in given:
        yield "k_descale applied twice", dataclasses.replace(spec, k=k * kd)
        yield "k_descale in place of v_descale", dataclasses.replace(spec, v=v / vd * kd)
    if d.k.shape[1] > 1 and ({"k_descale", "v_descale"} & given):
        nk, nv = (over_lead(np.roll(x, -1, axis=1), n, group, False) for x in (d.k, d.v))
        label = "the K and V descales of the next kv head (per-head descales misread)"
        yield label, dataclasses.replace(spec, k=k / kd * nk, v=v / vd * nv)
    if group > 1 and d.q.shape[1] > 1 and "q_descale" in given:
        tiled = over_lead(np.tile(d.q, (1, group)), n, 1, False)  # head h: kv head h mod G's
        label = "q_descale tiled over the query heads (head h reading kv head h mod G's)"
        yield label, dataclasses.replace(spec, q=q / qd * tiled)


def attend_fp8(
    masked: F64,
    v: F64,
    v_descale: float,
    sink: float | None,
    *,
    fmt: str,
    softmax: str,
    accumulate: str,
) -> tuple[F64, F64, F64 | None]:
    """The FP8 kernel's weights and output from a block's masked logits ``(rows, keys)``
    and its FP8 values of V ``(keys, Ev)`` (the module's docstring): the weights P / ℓ
    (float64), the output ``(rows, Ev)`` stored in :data:`FP8_OUTPUT`, and each row's
    weight on the sink (``sink``: its logit, a last column of the softmax V does not
    read; None without)."""
    rows, keys = masked.shape
    logits = masked if sink is None else np.concatenate([masked, np.full((rows, 1), sink)], -1)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        # max-subtracted (exp ≤ 1); a row with no visible key subtracts 0 and weighs nothing
        top = np.max(logits, axis=-1, keepdims=True, initial=-math.inf)
        x = precision.round_to(logits - np.where(top == -math.inf, 0.0, top), softmax)
        e = precision.round_to(np.exp(x), softmax)
        # ℓ sums the unrounded e, rounded once to float32: the kernel's order of float32
        # additions is its own, and any order's sum is this close to the exact one
        total = precision.round_to(precision.row_sum(e, "float64"), softmax)
        safe = np.where(total == 0.0, 1.0, total)
        p = precision.round_to(e, fmt)  # P as the kernel keeps it for the P·V product
        acc = precision.matmul(p[:, :keys], v, accumulate)
        # 1/ℓ · v_descale scales each row once, after the product (the kernel's finalize)
        factor = precision.round_to(precision.round_to(1.0 / safe, softmax) * v_descale, softmax)
        output = precision.round_to(precision.round_to(acc * factor, softmax), FP8_OUTPUT)
        weights = p / safe
    sink_weight = None if sink is None else weights[:, -1].copy()
    return np.ascontiguousarray(weights[:, :keys]), output, sink_weight
