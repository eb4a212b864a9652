"""A frozen :class:`AttentionSpec`: the inputs and options, validated once at the entry.

Axis letters everywhere: B batch, H query heads, G key/value heads, L query length,
S key length, E key dim, Ev value dim. Tensors are read as PyTorch reads them,
Q ``(..., L, E)``, K ``(..., S, E)``, V ``(..., S, Ev)``; the leading axes broadcast,
and the last leading axis is the head axis (H for Q, G for K and V). When G < H and
G divides H, query head h reads key/value head h // (H/G) (grouped-query attention).

Under ``--layout bshd`` Q, K and V come as ``(..., L, H, E)`` (FlashAttention's layout)
and are read through a view with their last three axes ``(..., H, L, E)``; the output is
returned in the layout given. Under ``--heads`` (and ``--kv-heads``) ``(..., L, d_model)``
matrices are split into heads, also by a view.

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
from sdpa_cli.engine.descales import Descales
from sdpa_cli.engine.masks import Sentinels, alibi_slopes, sentinels
from sdpa_cli.engine.matrices import matrices, with_qv
from sdpa_cli.engine.options import Options, scale_factor
from sdpa_cli.engine.paged import Paging
from sdpa_cli.engine.spec_checks import (
    check_documents,
    check_dropout_mask,
    check_per_item,
    check_query_offset,
    check_score_mod,
    check_segment_ids,
    check_sinks,
)
from sdpa_cli.errors import SpecError


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
    sinks: NDArray[Any] | None = None
    """gpt-oss sinks: a logit per query head, (H,) or (1,), a softmax column V does not read."""
    segment_ids: tuple[NDArray[np.int64], NDArray[np.int64]] | None = None
    """Segment ids of the queries ``(1 or B, L)`` and keys ``(1 or B, S)``: a query sees
    only keys of its own segment (JAX's ``q_segment_ids``, ``kv_segment_ids``)."""
    dropout_mask: NDArray[np.bool_] | None = None
    """``--dropout-mask``: the keep mask replayed in place of the drawn one, (..., L, S)."""
    qv_width: int = 0
    """The width Ev of FlashAttention's ``qv`` term, folded into Q and K (0: none)."""
    paging: Paging | None = None  # K and V gathered from a paged cache's pages (--block-table)
    descale: Descales | None = None  # FP8 descales: Q, K, V held dequantized (engine/fp8.py)

    @property
    def mask_is_bool(self) -> bool:
        return self.mask is not None and self.mask.dtype == np.bool_

    @property
    def mask_kind(self) -> str:
        """How ``--mask`` is read, as messages name it: ``boolean`` (True hides or
        shows), ``float`` (added to the logits) or ``integer`` (numbers, added as a
        float mask is: 0/1 shows every key; PyTorch's SDPA refuses such a mask);
        ``""`` without a mask."""
        if self.mask is None:
            return ""
        if self.mask_is_bool:
            return "boolean"
        return "integer" if self.mask.dtype.kind in "iu" else "float"

    @cached_property
    def sentinels(self) -> Sentinels | None:
        """The values of a float mask that hide keys for the findings (≤ −1e4, −inf
        included; see :data:`~sdpa_cli.engine.masks.HIDES`), scanned once; None without
        a float mask."""
        if self.mask is None or self.mask_is_bool:
            return None
        return sentinels(self.mask)

    @cached_property
    def alibi_slopes(self) -> NDArray[np.float64]:
        """One ALiBi slope per query head, computed once."""
        return alibi_slopes(self.H)

    @property
    def factor(self) -> float:
        """What multiplies Q Kᵀ: the scale over the temperature."""
        return self.scale / self.options.temperature

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
    def output_rearranged(self) -> bool:
        """Whether the output is returned in another layout than the engine's
        ``(*lead, L, Ev)``: heads merged under ``--heads``, or ``(..., L, H, Ev)`` under
        ``--layout bshd`` (when there is a head axis)."""
        return self.options.heads is not None or (self.options.layout == "bshd" and bool(self.lead))

    @property
    def merged_output_shape(self) -> tuple[int, ...]:
        """The output's shape as returned: heads merged back under ``--heads``,
        ``(..., L, H, Ev)`` under ``--layout bshd``."""
        if self.options.heads is not None:
            return (*self.lead[:-1], self.L, self.options.heads * self.Ev)
        if self.output_rearranged:
            return (*self.lead[:-1], self.L, self.lead[-1], self.Ev)
        return self.output_shape

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
        shape = self.shapes.get(name)
        if self.options.heads is not None and name in ("q", "k", "v"):
            merged = np.moveaxis(arr, -3, -2)  # (..., L, heads, D/heads), undoing the split
            arr = merged.reshape(*merged.shape[:-2], -1)
        elif self.options.layout == "bshd" and name in ("q", "k", "v") and len(shape or ()) >= 3:
            arr = np.swapaxes(arr, -3, -2)  # (..., L, H, E) again, as the file has it
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
    sinks: NDArray[Any] | None = None,
    segment_ids: NDArray[Any] | None = None,
    segment_ids_kv: NDArray[Any] | None = None,
    dropout_mask: NDArray[Any] | None = None,
    qv: NDArray[Any] | None = None,
) -> AttentionSpec:
    """Check shapes and options once and return the frozen spec.

    Args:
        q, k, v: Q ``(..., L, E)`` (1-D: one query), K ``(..., S, E)``, V ``(..., S, Ev)``.
        bias: additive, broadcastable to the scores ``(..., L, S)``.
        mask: boolean (True = may attend, unless ``mask_true_means='masked'``) or
            numeric (added to the logits), broadcastable to ``(..., L, S)``.
        options: the computation options.
        names: tensor name (``q``, ``k``, ``v``, ``bias``, ``mask``, ``sinks``) → source.
        sinks: one logit per query head, ``(H,)`` or ``(1,)`` (gpt-oss).
        segment_ids, segment_ids_kv: integer ids per query ``(L,)``/``(B, L)`` and per
            key ``(S,)``/``(B, S)``; the queries' serve the keys by default.
        dropout_mask: a keep mask (bool or 0/1) broadcastable to ``(..., L, S)``.
        qv: FlashAttention's ``qv`` term, Q's shape with V's width: ``qv · vᵀ`` joins
            the scores (:func:`~sdpa_cli.engine.matrices.with_qv`).

    Raises:
        SpecError: naming the tensor or option, with what was expected and what came.
    """
    opts = options or Options()
    labels = {
        n: (names or {}).get(n, n.upper() if n in "qkv" else f"--{n}")
        for n in ("q", "k", "v", "bias", "mask", "sinks", "qv")
    }
    tensors = {"q": q, "k": k, "v": v, "bias": bias, "mask": mask, "sinks": sinks}
    shapes = {n: tuple(a.shape) for n, a in tensors.items() if a is not None}
    for n, a in tensors.items():
        if a is not None:
            _check_numeric(n.upper() if n in "qkv" else n, labels[n], a)

    q, k, v = matrices(q, k, v, opts, labels)
    _check_dims(q, k, v, labels, shapes)
    if qv is not None:
        _check_numeric("qv", labels["qv"], qv)
        q, k = with_qv(q, k, v, qv, opts, labels["qv"])
    L, E = q.shape[-2:]
    S, Ev = k.shape[-2], v.shape[-1]
    head_axis = -2 if opts.layout == "bshd" else -3  # in the tensors as loaded
    group = _group(q.shape[:-2], k.shape[:-2], v.shape[:-2], labels, shapes, head_axis)
    lead = _lead(q.shape[:-2], k.shape[:-2], v.shape[:-2], group, labels, shapes)
    scores_shape = (*lead, L, S)
    extras = {
        n: None if a is None else _broadcast_extra(n, a, scores_shape, len(lead), labels[n])
        for n, a in (("bias", bias), ("mask", mask))
    }
    if opts.mask_true_means == "masked" and mask is not None and mask.dtype != np.bool_:
        raise SpecError(
            "--mask-true-means", "applies to boolean masks only; this mask holds numbers"
        )
    for flag, values, most in (
        ("--key-lengths", opts.key_lengths, ("keys", S)),
        ("--query-lengths", opts.query_lengths, ("queries", L)),
        ("--query-offset", opts.query_offset, None),
    ):
        packed = opts.cu_seqlens is not None and flag != "--query-lengths"
        if values is not None and not packed:  # packed: per document (check_documents)
            check_per_item(flag, values, lead, scores_shape, most)
    check_query_offset(opts)
    check_documents(opts, tuple(lead), int(L), int(S))
    check_score_mod(opts, bias is not None)
    if sinks is not None:
        check_sinks(sinks, lead[-1] if lead else 1, labels["sinks"])
    label = (names or {}).get("dropout_mask", "--dropout-mask")
    if (keep := check_dropout_mask(dropout_mask, opts, label)) is not None:
        keep = _broadcast_extra("keep mask", keep, scores_shape, len(lead), label)
    segments = check_segment_ids(segment_ids, segment_ids_kv, tuple(lead), L, S, names or {})

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
        sinks=sinks,
        segment_ids=segments,
        dropout_mask=keep,
        qv_width=0 if qv is None else int(Ev),
    )


Shapes = Mapping[str, tuple[int, ...]]


def _check_dims(
    q: NDArray[Any], k: NDArray[Any], v: NDArray[Any], labels: Mapping[str, str], shapes: Shapes
) -> None:
    """K's key dim is Q's, and V has a row per key."""
    E, Ek, S, Sv = q.shape[-1], k.shape[-1], k.shape[-2], v.shape[-2]
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


def _group(
    q_lead: tuple[int, ...],
    k_lead: tuple[int, ...],
    v_lead: tuple[int, ...],
    labels: Mapping[str, str],
    shapes: Shapes,
    head_axis: int = -3,
) -> int:
    """Query heads per key/value head: grouped-query attention has K and V with G heads,
    a divisor of Q's H heads (1 otherwise)."""
    if k_lead and v_lead and k_lead[-1] != v_lead[-1] and 1 not in (k_lead[-1], v_lead[-1]):
        raise SpecError(
            labels["v"],
            f"K has {k_lead[-1]} heads but V has {v_lead[-1]} (K {shapes['k']}, V {shapes['v']})",
        )
    if not (q_lead and (k_lead or v_lead)):
        return 1
    H = q_lead[-1]
    G = max(k_lead[-1] if k_lead else 1, v_lead[-1] if v_lead else 1)
    if H == 1 or G in (1, H):  # H = 1: Q broadcasts over the K/V heads
        return 1
    if H % G:
        raise SpecError(
            labels["k"],
            f"grouped-query attention needs K/V's heads to divide Q's: "
            f"Q has {H} heads (axis {head_axis} of {shapes['q']}), K/V have {G}",
        )
    return H // G


def _lead(
    q_lead: tuple[int, ...],
    k_lead: tuple[int, ...],
    v_lead: tuple[int, ...],
    group: int,
    labels: Mapping[str, str],
    shapes: Shapes,
) -> tuple[int, ...]:
    """The broadcast leading axes, with the key/value head axis stretched to H, so
    only grouped-query attention is special."""

    def stretched(lead: tuple[int, ...]) -> tuple[int, ...]:
        if group > 1 and lead and lead[-1] > 1:
            return (*lead[:-1], lead[-1] * group)
        return lead

    try:
        return tuple(np.broadcast_shapes(q_lead, stretched(k_lead), stretched(v_lead)))
    except ValueError:
        raise SpecError(
            labels["k"],
            f"the leading axes of Q {shapes['q']}, K {shapes['k']} and V {shapes['v']} "
            "do not broadcast",
        ) from None


def _broadcast_extra(
    name: str, a: NDArray[Any], scores_shape: tuple[int, ...], n_lead: int, label: str
) -> NDArray[Any]:
    """A bias or mask as an array of the scores' rank that broadcasts to them."""
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
            label,
            f"{name} of shape {tuple(a.shape)} does not broadcast to the scores' shape "
            f"{scores_shape} (..., L, S)",
        )
    return _pad(a2, n_lead)
