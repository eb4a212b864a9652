"""How flat, or how peaked, a row of random logits is by chance: the row rules flag a row
only where random logits would be as flat (near-uniform) or as peaked (one-hot) in fewer
than :data:`CHANCE` of rows over as many visible keys.

Random here means logits of unit variance, independent across keys: what 1/√d_k gives
Q·K for Q and K of unit variance, attention that is healthy if uninformative. Over a
few keys such rows are often flat: at the default threshold (entropy ≥ 0.98 · log n)
19 % of rows over n = 2 keys, 6.5 % over 3, 2.7 % over 4, 0.17 % over 8, 1.3e-5 over
16 and 6e-9 over 32. A causal mask gives every head rows over 2, 3, 4, … keys, and a
model thousands of heads, so the rules would fire on every run without this test.

Flat: a row's entropy H falls short of log n by about half its logits' variance s²
(over its n keys, weighted equally), and n·s² of n unit normals is χ² with n − 1
degrees of freedom. A row with shortfall δ = log n − H is that flat by chance with
P(χ²ₙ₋₁ ≤ 2nδ) (:func:`flat_chance`); the approximation is exact as δ → 0, where the
rule looks. The scale applied twice (logits of variance 1/d_k) leaves a shortfall
near 1/(2·d_k): at d_k = 64 a chance of 3e-6 over 8 keys, 4e-9 over 12.

Peaked: over 2 keys the gap of two unit normals is N(0, 2), so a max weight w (a gap
g = log(w / (1 − w))) has chance erfc(g / 2) (:func:`peaked_chance`): the default 0.99
(g = 4.6) comes once in 864 rows. Over 3 keys and more the default is rarer than
:data:`CHANCE` already (1.4e-5 over 3 keys, 1.3e-6 over 4), so only 2 keys are tested.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine.types import F64

CHANCE = 2e-5
"""A row is flagged only where random logits are as flat or as peaked in fewer than
1 in 50,000 rows over as many keys."""

SERIES_DOF = 128
"""Below this many degrees of freedom P(χ²ₖ ≤ x) is summed as a series; from it on,
the Wilson–Hilferty cube root (5 % too large at a chance of 1e-5 there, under 1 % from
k = 1000: a row a little less likely flagged, never more)."""

_TERMS = 400
"""Series terms: the terms peak at j = x/2 − k/2 ≤ 3·(k/2) + 40 < 240 and fall away by
400 below :data:`SERIES_DOF`."""


def chi2_cdf(x: F64, k: NDArray[np.int64]) -> F64:
    """P(χ²ₖ ≤ x), elementwise over arrays of one shape.

    The regularized lower incomplete gamma P(a, y) with a = k/2, y = x/2:
    y^a e^−y / Γ(a + 1) · Σⱼ yʲ / ((a + 1)⋯(a + j)) below :data:`SERIES_DOF`;
    Φ(((x/k)^⅓ − 1 + 2/(9k)) / √(2/(9k))) from it on.
    """
    x = np.maximum(np.asarray(x, dtype=np.float64), 0.0)
    k = np.asarray(k, dtype=np.float64)
    out = np.empty(np.broadcast(x, k).shape)
    x, k = np.broadcast_to(x, out.shape), np.broadcast_to(k, out.shape)
    small = k < SERIES_DOF
    a = k[small] / 2
    # Far above the mean P is 1 to double precision; the cap keeps the sum finite.
    y = np.minimum(x[small] / 2, 4 * a + 40)
    term, total = np.ones_like(y), np.ones_like(y)
    for j in range(1, _TERMS):
        term = term * y / (a + j)
        total += term
    values, at = np.unique(a, return_inverse=True)
    log_gamma = np.array([math.lgamma(v + 1) for v in values])[at].reshape(a.shape)
    with np.errstate(divide="ignore"):  # y = 0: log 0 = −inf, the chance 0
        out[small] = np.minimum(np.exp(a * np.log(y) - y - log_gamma) * total, 1.0)
    kw, xw = k[~small], x[~small]
    z = (np.cbrt(xw / kw) - 1 + 2 / (9 * kw)) / np.sqrt(2 / (9 * kw))
    out[~small] = 0.5 * np.array([math.erfc(-v / math.sqrt(2)) for v in z.ravel()]).reshape(z.shape)
    return out


def flat_chance(n: NDArray[np.int64], normalized: F64) -> F64:
    """The share of rows of random logits over ``n`` keys at least as flat as a row whose
    entropy is ``normalized`` · log n: P(χ²ₙ₋₁ ≤ 2n · (1 − normalized) · log n)."""
    shortfall = (1 - normalized) * np.log(np.maximum(n, 2))
    return chi2_cdf(2 * n * shortfall, n - 1)


def peaked_chance(max_weight: F64) -> F64:
    """The share of rows of random logits over 2 keys at least as peaked as one whose
    larger weight is ``max_weight``: erfc(g / 2), g = log(w / (1 − w)) the logit gap."""
    w = np.asarray(max_weight, dtype=np.float64)
    with np.errstate(divide="ignore"):  # w = 1: an infinite gap, the chance 0
        gap = np.log(w) - np.log1p(-w)
    return np.array([math.erfc(g / 2) for g in gap.ravel()]).reshape(gap.shape)
