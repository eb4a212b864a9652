"""One query against every key, worked as a hand calculation works it: dot products term by
term, scaled scores, e^(x − m), weights, contributions weight · v_j and their sum.

Pure numpy; ``explain --query`` shows it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from sdpa_cli.engine import precision
from sdpa_cli.engine.block import attend_block
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import F64, Index

TERMS_UP_TO = 4
"""Dot products are written out term by term up to this key dim."""


@dataclass(frozen=True)
class KeyScore:
    """One key's line of a scorecard."""

    key: int
    terms: tuple[tuple[float, float], ...] | None
    raw: float
    scaled: float
    logit: float
    visible: bool
    exp: float
    weight: float
    contribution: F64

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key}
        if self.terms is not None:
            out["terms"] = [list(t) for t in self.terms]
        out.update(
            raw=self.raw,
            scaled=self.scaled,
            logit=self.logit,
            visible=self.visible,
            exp=self.exp,
            weight=self.weight,
            contribution=self.contribution.tolist(),
        )
        return out


@dataclass(frozen=True)
class Scorecard:
    """One query against every key, as a hand calculation works it: dot products, scaled
    scores, weights e^(x − m) / Z, contributions weight · v_j and their sum.

    ``shown`` are the keys to list: every key in key order when they all fit, else
    the heaviest ``limit`` of the visible keys, heaviest first (never a key a mask
    hides: its weight is 0; the heaviest of all keys in a row with none visible);
    ``rest_weight`` and ``rest_contribution`` sum the others.
    """

    lead: Index
    query: int
    q: F64
    keys: tuple[KeyScore, ...]
    logit_max: float
    z: float
    output: F64
    shown: tuple[int, ...]
    rest_weight: float
    rest_contribution: F64
    dropout: bool

    @property
    def n_visible(self) -> int:
        """The keys the query sees (not hidden by a mask)."""
        return sum(k.visible for k in self.keys)

    @property
    def sum_exp(self) -> float:
        """Σ e^x over the visible keys, without the max subtracted (inf when it overflows)."""
        with np.errstate(over="ignore"):
            return float(self.z * np.exp(self.logit_max)) if math.isfinite(self.logit_max) else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": [*self.lead, self.query],
            "query": self.query,
            "q": self.q.tolist(),
            "keys": [k.to_dict() for k in self.keys],
            "logit_max": self.logit_max,
            "z": self.z,
            "sum_exp": self.sum_exp,
            "output": self.output.tolist(),
            "shown_keys": list(self.shown),
        }


def scorecard(spec: AttentionSpec, lead: Index, query: int, limit: int = 16) -> Scorecard:
    """Query ``query`` of the slice at ``lead`` against every key, step by step."""
    block = attend_block(spec, lead, slice(query, query + 1))
    o = spec.options
    fmt = o.dtype if o.emulated else "float64"
    q = precision.round_to(
        np.asarray(spec.q[spec.operand_index("q", lead)][query], dtype=np.float64), fmt
    )
    k = precision.round_to(np.asarray(spec.k[spec.operand_index("k", lead)], dtype=np.float64), fmt)
    v = precision.round_to(np.asarray(spec.v[spec.operand_index("v", lead)], dtype=np.float64), fmt)
    visible = block.attended[0]
    logits = block.masked[0]
    # As the softmax does: over every finite logit (a finite mask value included).
    finite = np.isfinite(logits)
    m = float(logits[finite].max()) if finite.any() else -math.inf
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.where(finite, np.exp(logits - (m if math.isfinite(m) else 0.0)), 0.0)
    mixing = block.weights[0] if block.dropped is None else block.dropped[0]
    contributions = mixing[:, None] * v
    keys = tuple(
        KeyScore(
            key=j,
            terms=tuple(zip(q.tolist(), k[j].tolist(), strict=True))
            if spec.E <= TERMS_UP_TO
            else None,
            raw=float(block.raw[0, j]),
            scaled=float(block.scaled[0, j]),
            logit=float(logits[j]),
            visible=bool(visible[j]),
            exp=float(e[j]),
            weight=float(mixing[j]),
            contribution=contributions[j],
        )
        for j in range(spec.S)
    )
    if limit >= spec.S:
        shown = tuple(range(spec.S))
    else:
        # A hidden key weighs 0 (or what a finite mask value leaks): it is listed only
        # in a row that sees no key at all, where the weights are all there is.
        candidates = np.flatnonzero(visible) if visible.any() else np.arange(spec.S)
        order = np.argsort(-mixing[candidates], kind="stable")  # ties: the first key first
        shown = tuple(int(j) for j in candidates[order[:limit]])
    rest = np.ones(spec.S, dtype=np.bool_)
    rest[list(shown)] = False
    return Scorecard(
        lead=lead,
        query=query,
        q=q,
        keys=keys,
        logit_max=m,
        z=float(e.sum()),
        output=block.output[0],
        shown=shown,
        rest_weight=float(mixing[rest].sum()),
        rest_contribution=contributions[rest].sum(axis=0),
        dropout=block.dropped is not None,
    )
