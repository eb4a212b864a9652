"""Hints on failed gradient comparisons: the backward pass recomputed under the slips a
backward kernel most often makes, one at a time, in float64; a hint names the one the
exported gradient matches (:func:`~sdpa_cli.check.hints.export_matches`).

The slips: dQ or dK without the scale; the D = rowsum(dO ⊙ O) term left out of the
softmax's backward (dS = P ⊙ dA); dV from the unnormalised weights exp(S − max); the
mask applied in the forward pass but not in the backward (P recomputed as exp(S − LSE)
over every key, as a FlashAttention-style backward reads the forward's LSE); the whole
backward run without the mask (the gradients of unmasked attention); grouped-query dK and dV holding one query head's share,
not the sum over the heads that share a K/V head; dropout's mask not replayed in the
backward. A slice at a time, every row at
once: only for cases of at most :data:`~sdpa_cli.check.hints._SUSPECT_LIMIT` scores.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.check.hints import _SUSPECT_LIMIT, export_matches
from sdpa_cli.check.records import Check
from sdpa_cli.check.residual import Readable
from sdpa_cli.engine.block import attend_block, dropout_keep, operands, sink_logit
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import F64

Gradient = dict[str, F64]
"""dQ, dK and dV in the engine's layout (shaped like ``spec.q``, ``spec.k``, ``spec.v``)."""


def with_gradient_hints(
    checks: list[Check],
    spec: AttentionSpec,
    dout: F64,
    exports: Mapping[str, NDArray[Any]],
    reference: Mapping[str, Readable],
    export: str,
) -> list[Check]:
    """A hint on each failed ``dq``/``dk``/``dv`` comparison that a backward slip
    explains. ``spec``: the computation in float64 as the kernel saw it; ``dout`` in
    the engine's layout, as are ``exports`` and ``reference`` (read whole, on small
    cases only)."""
    failing = {
        c.name.removesuffix(".close")
        for c in checks
        if c.status == "fail" and c.name.endswith(".close") and c.name[:2] in ("dq", "dk", "dv")
    }
    if not failing or math.prod(spec.weights_shape) > _SUSPECT_LIMIT:
        return checks
    hints: dict[str, str] = {}
    for hint, names, values in _slips(spec, dout, reference):
        for name in sorted(failing & names - hints.keys()):
            if export_matches(exports[name], values()[name], np.asarray(reference[name]), export):
                hints[name] = hint
        if failing <= hints.keys():
            break
    return [
        dataclasses.replace(c, hint=hints[c.name.removesuffix(".close")])
        if c.name.endswith(".close") and c.name.removesuffix(".close") in hints
        else c
        for c in checks
    ]


Slip = tuple[str, set[str], Callable[[], Gradient]]
"""A hint, the gradients it concerns, and (computed on first use) their values."""


def _slips(spec: AttentionSpec, dout: F64, reference: Mapping[str, Readable]) -> Iterator[Slip]:
    f = spec.factor
    exact = {n: np.asarray(values, np.float64) for n, values in reference.items()}
    if "dk" in exact:
        yield (
            f"dK misses the scale: the export is dSᵀ·Q, not dSᵀ·Q·{_num(f)} (a bug in the kernel)",
            {"dk"},
            lambda: {"dk": exact["dk"] / f},
        )
    if "dq" in exact:
        yield (
            f"dQ misses the scale: the export is dS·K, not dS·K·{_num(f)} (a bug in the kernel)",
            {"dq"},
            lambda: {"dq": exact["dq"] / f},
        )
    yield (
        "the softmax's backward leaves out D = rowsum(dO ⊙ O): dS = P ⊙ dA, not "
        "P ⊙ (dA − D) (a bug in the kernel)",
        {"dq", "dk"},
        _once(lambda: _variant(spec, dout, "no-d")),
    )
    yield (
        "dV from the unnormalised weights exp(S − max), the row sums not divided out "
        "(a bug in the kernel)",
        {"dv"},
        _once(lambda: _variant(spec, dout, "unnormalised")),
    )
    if _masked(spec):
        yield (
            "the mask is applied in the forward pass but not in the backward: P recomputed "
            "as exp(S − LSE) over every key (a bug in the kernel)",
            {"dq", "dk", "dv"},
            _once(lambda: _variant(spec, dout, "unmasked-backward")),
        )
        yield (
            "the backward pass ran without the mask: the gradients of attention over every "
            "key (a bug in the kernel, or the mask not passed to it)",
            {"dq", "dk", "dv"},
            _once(lambda: _variant(spec, dout, "unmasked")),
        )
    if spec.options.dropout > 0:
        yield (
            "the backward pass did not replay dropout's mask: the gradients of attention "
            "without dropout (a bug in the kernel, or its mask or seed not passed back)",
            {"dq", "dk", "dv"},
            _once(lambda: _variant(spec, dout, "no-dropout")),
        )
    if spec.group > 1:
        yield (
            f"dK and dV of each K/V head hold one query head's share, not the sum over the "
            f"{spec.group} query heads that share it (a bug in the kernel)",
            {"dk", "dv"},
            _once(lambda: _variant(spec, dout, "first-head")),
        )


def _num(x: float) -> str:
    return f"{x:.6g}"


def _once(compute: Callable[[], Gradient]) -> Callable[[], Gradient]:
    found: list[Gradient] = []

    def values() -> Gradient:
        if not found:
            found.append(compute())
        return found[0]

    return values


def _masked(spec: AttentionSpec) -> bool:
    o = spec.options
    return o.hides_by_position or spec.mask is not None


def _variant(spec: AttentionSpec, dout: F64, slip: str) -> Gradient:
    """The backward pass in float64 with one slip, every slice whole."""
    f = spec.factor
    dq, dk, dv = np.zeros(spec.q.shape), np.zeros(spec.k.shape), np.zeros(spec.v.shape)
    rows = slice(0, spec.L)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        for lead in np.ndindex(*spec.lead):
            at = tuple(int(i) for i in lead)
            ops = operands(spec, at, emulate=False)
            block = attend_block(spec, at, rows, emulate=False, inputs=ops)
            q = np.asarray(spec.q[spec.operand_index("q", at)], np.float64)
            k, v = ops.k, ops.v
            d_o = np.asarray(dout[at], np.float64)
            p = np.asarray(block.weights, np.float64)
            da = d_o @ v.T
            keep: F64 | float = 1.0  # dropout's kept weights, scaled by 1 / (1 − p)
            if spec.options.dropout > 0 and slip != "no-dropout":
                keep = dropout_keep(spec, at, rows, block.keys) / (1.0 - spec.options.dropout)
                da = da * keep
            sink = sink_logit(spec, at)  # a sink's logit takes its share of every row
            d = np.einsum("ij,ij->i", p, da)[:, None]  # rowsum(dO ⊙ O)
            dv_part = (p * keep).T @ d_o
            if slip == "no-d":
                ds = p * da
            elif slip == "unnormalised":
                logits = np.asarray(block.masked, np.float64)
                top = np.max(logits, axis=1, keepdims=True, initial=-np.inf)
                if sink is not None:  # the max the kernel subtracts takes the sink's in
                    top = np.maximum(top, sink)
                dv_part = (np.nan_to_num(np.exp(logits - top)) * keep).T @ d_o
                ds = p * (da - d)
            elif slip in ("unmasked-backward", "unmasked"):
                before = block.biased if block.biased is not None else block.capped
                scaled = np.asarray(before if before is not None else block.scaled, np.float64)
                # the forward's LSE (masked), or the unmasked softmax's own
                lse = _lse(np.asarray(block.masked if slip == "unmasked-backward" else scaled))
                if sink is not None:
                    lse = np.logaddexp(lse, sink)
                p = np.exp(scaled - lse[:, None])
                if slip == "unmasked":
                    d = np.einsum("ij,ij->i", p, da)[:, None]
                dv_part = (p * keep).T @ d_o
                ds = p * (da - d)
            else:
                ds = p * (da - d)
            if spec.options.softcap is not None:  # the softcap's chain rule
                t = np.tanh(np.asarray(block.scaled, np.float64) / spec.options.softcap)
                ds = ds * (1.0 - t * t)
            q_at, k_at, v_at = (spec.operand_index(n, at) for n in ("q", "k", "v"))
            dq[q_at] += ds @ k * f
            # first-head: only query head g·r of each group writes K/V head g's share
            if slip != "first-head" or at[-1] % spec.group == 0:
                dk[k_at] += ds.T @ q * f
                dv[v_at] += dv_part
    return {"dq": dq, "dk": dk, "dv": dv}


def _lse(logits: F64) -> F64:
    top = np.max(logits, axis=1, initial=-np.inf)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        out: F64 = safe + np.log(np.sum(np.exp(logits - safe[:, None]), axis=1))
    return out
