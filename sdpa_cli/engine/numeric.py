"""The numeric check of the backward pass: central differences in float64 on sampled
entries of each input, against the analytic gradients of :mod:`sdpa_cli.engine.grad`.

Only the blocks an entry feeds are recomputed, and O₊ − O₋ is taken element by
element before the sum, so the difference keeps its precision.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from sdpa_cli.engine.block import attend_block
from sdpa_cli.engine.grad import OPERAND, Gradients, random_stream
from sdpa_cli.engine.records import argmax_index
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import F64, Index


@dataclass(frozen=True)
class NumericCheck:
    """Central finite differences against the analytic gradient, on sampled entries.

    ``worst_at`` indexes the tensor as loaded. An entry's relative error counts what
    the difference cannot resolve as no error: (|numeric − analytic| − r) /
    max(|numeric|, |analytic|), where r is the difference's resolution (the rounding of
    the loss's terms over 2h), and 0 where that is negative or both are below r. A
    gradient far smaller than the loss it feeds (a one-hot row's dQ, ~1e-9 against
    outputs ~1) is resolved to a few digits only, and its rounding is no fault of the
    gradient's. The worst entry is the one with the largest error, and among equal
    ones (0 for a correct gradient) the one whose difference strays furthest.
    """

    name: str
    samples: int
    max_rel_error: float
    worst_at: Index | None
    numeric: float
    analytic: float

    def passed(self, tolerance: float) -> bool:
        return self.max_rel_error <= tolerance


EPS = float(np.finfo(np.float64).eps)

RESOLUTION_ULPS = 16
"""How many roundings of the loss's terms a central difference is allowed."""

RELATIVE_STEP = 6e-6
"""Central differences err by h² f‴/6 (truncation) and by ε·|f|/h (rounding): the
sum is smallest near h = ε^(1/3) ≈ 6·10⁻⁶ in float64, relative to the entry."""


def numeric_check(
    grads: Gradients, samples: int, seed: int, names: tuple[str, ...] | None = None
) -> list[NumericCheck]:
    """Check ``samples`` entries (drawn with ``seed``) of each gradient by central
    differences of ``Σ O ⊙ dO`` in float64.

    Only the blocks an entry feeds are recomputed: its own query row for Q, every row
    of the slices reading it for K and V. The outputs' difference O(x + h) − O(x − h)
    is taken element by element before the sum, so the rest of the loss cancels exactly.
    """
    spec = grads.spec
    rng = random_stream(seed, 2)
    checks: list[NumericCheck] = []
    for name in grads.present() if names is None else names:
        operand = OPERAND[name]
        analytic = grads.tensor(name)
        if analytic is None or operand == "sinks":  # a per-head logit: tested, not sampled
            continue
        values = np.array(getattr(spec, operand), dtype=np.float64)  # a writable copy
        if not values.size:
            checks.append(NumericCheck(name, 0, 0.0, None, 0.0, 0.0))
            continue
        picked = rng.choice(values.size, size=min(samples, values.size), replace=False)
        probe = _probe(spec, operand, values, grads.dout)
        worst: tuple[float, float, Index, float, float] | None = None  # errors, where, values
        for flat in sorted(int(i) for i in picked):
            idx = tuple(int(i) for i in np.unravel_index(flat, values.shape))
            x0 = float(values[idx])
            h = RELATIVE_STEP * max(1.0, abs(x0))
            plus, minus = x0 + h, x0 - h
            difference, magnitude = probe(idx, plus, minus)
            numeric = difference / (plus - minus)
            exact = float(analytic[idx])
            # The sum's rounding, ~ε·Σ|dO ⊙ O| over the outputs it feeds, divided by 2h:
            # gradients both below it cannot be told from 0 at this step, and agree.
            resolution = RESOLUTION_ULPS * EPS * magnitude / (plus - minus)
            largest = max(abs(numeric), abs(exact))
            if largest <= resolution:
                err = stray = 0.0
            else:
                with np.errstate(invalid="ignore"):
                    stray = abs(numeric - exact) / largest
                    err = max(abs(numeric - exact) - resolution, 0.0) / largest
                if not math.isfinite(err):
                    err = stray = 0.0 if numeric == exact else math.inf
            if worst is None or (err, stray) > worst[:2]:
                worst = (err, stray, idx, numeric, exact)
        assert worst is not None
        err, _, idx, numeric, exact = worst
        at = _loaded_index(spec, operand, values.shape, idx)
        checks.append(NumericCheck(name, len(picked), err, at, numeric, exact))
    return checks


def _probe(spec: AttentionSpec, operand: str, values: F64, dout: F64) -> Any:
    """A function (index, x₊, x₋) → (Σ dO ⊙ (O(x₊) − O(x₋)), Σ |dO| ⊙ (|O(x₊)| + |O(x₋)|))
    for entry ``index`` of ``operand``, which ``values`` (a float64 copy) holds: the
    loss's difference, and the size of the terms whose rounding it carries."""
    changes: dict[str, Any] = {operand: values}
    perturbed = dataclasses.replace(spec, **changes)  # reads ``values`` as it changes

    def loss_diff(idx: Index, plus: float, minus: float) -> tuple[float, float]:
        x0 = values[idx]
        total = magnitude = 0.0
        for lead_index, rows in _affected(spec, operand, idx):
            outs = []
            for x in (plus, minus):
                values[idx] = x
                outs.append(attend_block(perturbed, lead_index, rows, emulate=False).output)
            values[idx] = x0
            g = dout[lead_index][rows]
            total += float(np.sum(g * (outs[0] - outs[1])))
            magnitude += float(np.sum(np.abs(g) * (np.abs(outs[0]) + np.abs(outs[1]))))
        return total, magnitude

    return loss_diff


def _affected(spec: AttentionSpec, operand: str, idx: Index) -> Iterator[tuple[Index, slice]]:
    """The (slice, rows) blocks whose output entry ``idx`` of ``operand`` feeds."""
    arr = getattr(spec, operand)
    owner = idx[:-2]
    if operand == "q" or (operand == "bias" and arr.shape[-2] > 1):
        rows = slice(idx[-2], idx[-2] + 1)
    else:
        rows = slice(0, spec.L)
    for lead_index in np.ndindex(*spec.lead):
        li = tuple(int(x) for x in lead_index)
        if spec.operand_index(operand, li) == owner:
            yield li, rows


def _loaded_index(spec: AttentionSpec, operand: str, shape: tuple[int, ...], idx: Index) -> Index:
    """An index into the engine's layout of ``operand``, as an index into the file's."""
    marker = np.zeros(shape, np.bool_)
    marker[idx] = True
    loaded = spec.as_loaded(operand, marker)
    return argmax_index(loaded)
