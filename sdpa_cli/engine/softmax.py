"""The row softmax every path computes with, and the LSE read off it.

:func:`softmax` is max-subtracted and safe (a row with no visible key gets zeros);
:func:`softmax_lse` reads each row's logsumexp off the weights. Re-exported by
:mod:`sdpa_cli.engine.block`, where the stages are computed.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine import precision
from sdpa_cli.engine.types import F64

DENORMAL_FLOOR = {
    np.dtype(dt): math.log(float(np.finfo(dt).tiny)) for dt in (np.float64, np.float32)
}
"""exp(x) is subnormal below log(smallest normal): −708.4 in float64, −87.3 in float32.
Subnormals are 10–30× slower in exp and in the matmul that follows, and a saturated
row (what this tool exists to find) is full of them. Arguments below the floor are
set to −inf, so their weights are 0 rather than a subnormal: a change smaller than
the format's smallest normal number, which no result can resolve after the row is
normalised (every weight is divided by a sum ≥ 1)."""


def softmax(logits: F64, dtype: str = "float64", *, native: bool = False) -> F64:
    """Row softmax over the last axis, max-subtracted, computed in the format ``dtype``
    (``native``: in the dtype of ``logits`` itself, float64 or float32).

    A row whose logits are all −inf (no visible key) gets zero weights, as PyTorch's
    safe softmax, FlashAttention and ONNX return; a finite mask value keeps such a
    row uniform, as kernels that mask with −1e9 or finfo.min do.
    """

    def r(x: F64) -> F64:
        return x if native else precision.round_to(x, dtype)

    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        # initial=−inf keeps an empty key axis (S = 0) valid; NaN still propagates.
        m = np.max(logits, axis=-1, keepdims=True, initial=-math.inf)
        # Subtracting the row max keeps exp ≤ 1 (no overflow); an all −inf row subtracts 0.
        x = r(logits - np.where(m == -math.inf, 0.0, m).astype(logits.dtype))
        floor = DENORMAL_FLOOR.get(x.dtype)
        if floor is not None and x.size and np.min(x) < floor:
            np.copyto(x, -math.inf, where=x < floor)  # see DENORMAL_FLOOR
        e = r(np.exp(x, out=x))
        total = e.sum(axis=-1, keepdims=True) if native else precision.row_sum(e, dtype)
        total = np.where(total == 0.0, 1.0, total).astype(e.dtype)
        return r(np.divide(e, total, out=e))


def softmax_lse(masked: NDArray[Any], weights: NDArray[Any]) -> F64:
    """Each row's logsumexp of the masked logits, read off their softmax: LSE =
    s_top − log w_top for the row's largest weight (every weight is exp(s − LSE));
    −inf for a row with no key to attend to, NaN for a row of NaN. Any leading axes;
    keys last."""
    if not weights.shape[-1]:
        return np.full(weights.shape[:-1], -math.inf)
    # Rounded weights tie (FP8's P: every weight within 3% of the top's is 1 / ℓ): of the
    # tied, the largest logit's, whose rounding is the smallest relative to its weight.
    tied = weights == np.max(weights, axis=-1, keepdims=True)
    top = np.argmax(np.where(tied, masked, -math.inf), axis=-1)[..., None]
    w_top = np.take_along_axis(weights, top, axis=-1)[..., 0].astype(np.float64)
    s_top = np.take_along_axis(masked, top, axis=-1)[..., 0].astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = s_top - np.log(w_top)
    return np.where(np.isnan(w_top), math.nan, np.where(w_top > 0, lse, -math.inf))
