"""Two runs of one model compared call by call (``sdpa diff``): where they part.

Each pair of calls (:mod:`~sdpa_cli.check.pairing`) is compared twice:

- **Inputs**: Q, K and V of run B against run A's, each as the largest over the
  (batch, head) slices of RMS(B − A) / RMS(A), counted over the query rows that see
  a key in both runs (Q) and the keys those rows see (K, V): padded positions,
  which a model discards, differ freely between implementations and count for
  nothing. K and V are compared per query head, so a run that repeats grouped
  K/V heads pairs with one that does not. The mask is compared as what it hides:
  the rows whose visible keys differ. An input *differs* when its relative
  difference passes ``max(BOUND · u, JUMP · m)``: ``u`` the unit roundoff of the
  narrower run's format (2⁻⁸ for bfloat16, 2⁻²⁴ for float32), ``m`` the largest
  difference of Q, K or V at any earlier call.
- **The kernel**: B's output judged against attention computed from B's *own*
  inputs with ``sdpa check``'s default judgement, so that rounding carried in from
  earlier layers is not charged to the kernel.

A call *diverges* **upstream** when an input, the mask, a shape or the scale
differs; in the **kernel** when the inputs agree and B's output fails its check
(or, where B's passes and the outputs still differ by more than the inputs may,
A's fails its own).

Pure numpy over two :class:`~sdpa_cli.engine.spec.AttentionSpec`: the files are read
in :mod:`sdpa_cli.api.diff`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.check.exports import strip_ones
from sdpa_cli.check.pairing import Pairing
from sdpa_cli.engine import masks, precision
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.visible import visible_keys
from sdpa_cli.errors import ExitCode
from sdpa_cli.names import COMPARED
from sdpa_cli.text import compact, json_number, shape

BOUND = 64.0
"""The largest relative difference of an input that reads as rounding, in units of
the narrower run's unit roundoff. A random-init Llama (2 to 12 layers) in eager
float32 against SDPA in bfloat16 differs by 1.2u at its first layer and by at most
15u at its twelfth (its hidden states growing layer by layer); a rotary embedding
turned the wrong way in one layer makes its Q and K differ by 235u to 263u. 64 sits
4× above the one and 4× below the other (docs/guide/capture.md)."""

JUMP = 4.0
"""How many times the largest difference of an earlier call an input may differ by
before it reads as a new divergence: in a deep model, rounding carried in grows past
any fixed bound, but by 1.1 to 1.5× a layer (3.9× at most, from the first layer to
the second, where both are far under :data:`BOUND`)."""

INPUTS = COMPARED[:3]
"""The inputs compared (Q, K, V), by their names in the files and the JSON."""
ADDED = COMPARED[3]
"""What is added to the logits (a bias, a float mask's finite values), compared where
either run adds something."""


@dataclass(frozen=True)
class Difference:
    """How far one tensor of run B is from run A's.

    Attributes:
        relative: the largest over (batch, head) slices of RMS(B − A) / RMS(A), over
            the rows or keys compared (inf where one has a non-finite value the other
            has not; NaN where nothing was compared).
        at: the slice's index, ``(batch, head)`` as the computation's lead.
        unit: the unit roundoff it is counted in.
    """

    relative: float
    at: tuple[int, ...]
    unit: float

    @property
    def units(self) -> float:
        return self.relative / self.unit

    def text(self) -> str:
        """``258u``; ``inf`` for a value one run lost; ``—`` when nothing was compared."""
        if not math.isfinite(self.relative):
            return "—" if math.isnan(self.relative) else "inf"
        return f"{compact(self.units, 3)}u"

    def to_dict(self) -> dict[str, Any]:
        return {
            "relative": _json(self.relative),
            "units": _json(self.units),
            "slice": list(self.at),
        }


@dataclass(frozen=True)
class Kernel:
    """One run's output judged against attention from its own inputs (``sdpa check``'s
    default judgement): ``run`` (``a`` or ``b``), whether it passed, and its first
    failed check's name and summary (empty when it passed)."""

    run: str
    passed: bool
    check: str = ""
    summary: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "passed": self.passed,
            "check": self.check or None,
            "summary": self.summary or None,
        }


@dataclass(frozen=True)
class CallDiff:
    """One pair of calls compared.

    Attributes:
        a, b: the calls' names in run A and in run B.
        format: the narrower of the two runs' formats at this call.
        differences: Q, K, V and the output of B against A's (those both runs hold).
        rows: the query rows compared: those that see a key in both runs.
        mask_rows: of those, the rows whose visible keys differ.
        mismatch: what differs that no number measures (a shape, the scale), in words.
        limit: the largest relative difference of an input that reads as rounding here.
        kernel: B's output judged; None without a recorded output.
        kernel_a: A's output judged, where B's passed, the inputs agree and the
            outputs still differ by more than an input may; else None.
        error: why the call could not be compared (a file that cannot be read).
    """

    a: str
    b: str
    format: str = "float64"
    differences: Mapping[str, Difference] = field(default_factory=dict)
    rows: int = 0
    mask_rows: int = 0
    mismatch: str | None = None
    limit: float = math.inf
    kernel: Kernel | None = None
    kernel_a: Kernel | None = None
    error: str | None = None

    @property
    def unit(self) -> float:
        """The unit roundoff of :attr:`format`: what the differences are counted in."""
        return precision.fmt(self.format).unit_roundoff

    def differing(self) -> tuple[str, ...]:
        """The inputs that differ, as named in prose: ``Q``, ``K``, ``V``, ``bias``,
        ``mask``."""
        named = [n.upper() for n in INPUTS if n in self.differences and self._past(n)]
        added = [ADDED] if ADDED in self.differences and self._past(ADDED) else []
        return (*named, *added, *(["mask"] if self.mask_rows else []))

    def _past(self, name: str) -> bool:
        x = self.differences[name].relative
        return not x <= self.limit and not math.isnan(x)

    @property
    def where(self) -> str | None:
        """``upstream``, ``kernel`` (:data:`~sdpa_cli.names.DIVERGENCES`) or None."""
        if self.error is not None:
            return None
        if self.mismatch or self.differing():
            return "upstream"
        return "kernel" if self.failed_kernel() is not None else None

    def failed_kernel(self) -> Kernel | None:
        """B's kernel when it failed, else A's when it failed, else None."""
        return next(
            (k for k in (self.kernel, self.kernel_a) if k is not None and not k.passed), None
        )

    def largest_input(self) -> float:
        """The largest finite relative difference of Q, K or V (0 when none)."""
        found = [self.differences[n].relative for n in INPUTS if n in self.differences]
        return max((x for x in found if math.isfinite(x)), default=0.0)

    def reason(self) -> str:
        """Why the call diverges, or that it does not, in a few words."""
        if self.mismatch:
            return self.mismatch
        differ = [n for n in self.differing() if n not in ("mask", ADDED)]
        parts = []
        if differ:
            sizes = ", ".join(self.differences[n.lower()].text() for n in differ)
            verb = "differs" if len(differ) == 1 else "differ"
            parts.append(f"{', '.join(differ)} {verb} by {sizes}")
        if ADDED in self.differing():
            added = self.differences[ADDED].text()
            parts.append(f"what is added to the logits (a bias, a float mask) differs by {added}")
        if self.mask_rows:
            parts.append(f"the mask hides other keys on {self.mask_rows} of {self.rows} rows")
        agree = [n.upper() for n in INPUTS if n in self.differences and n.upper() not in differ]
        if agree:
            found = [self.differences[n.lower()].units for n in agree]
            largest = max((x for x in found if not math.isnan(x)), default=0.0)
            within = f" within {compact(largest, 2)}u" if differ == [] else ""
            parts.append(f"{', '.join(agree)} {'agrees' if len(agree) == 1 else 'agree'}{within}")
        failed = self.failed_kernel()
        if self.where == "kernel" and failed is not None:
            whose = "B's" if failed.run == "b" else "A's"
            parts.append(f"{whose} output fails against its own inputs: {failed.check}")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "format": self.format,
            "unit": _json(self.unit),
            "differences": {n: d.to_dict() for n, d in self.differences.items()},
            "limit": _json(self.limit),
            "differ": [n.lower() for n in self.differing()],
            "rows": self.rows,
            "mask_rows": self.mask_rows,
            "mismatch": self.mismatch,
            "kernel": None if self.kernel is None else self.kernel.to_dict(),
            "kernel_a": None if self.kernel_a is None else self.kernel_a.to_dict(),
            "where": self.where,
            "error": self.error,
        }


@dataclass(frozen=True)
class RunDiff:
    """Two runs compared: their manifests, how their calls paired, each pair compared
    in run A's order, and the rule's two numbers."""

    a: str
    b: str
    pairing: Pairing
    calls: tuple[CallDiff, ...]
    bound: float = BOUND
    jump: float = JUMP

    @property
    def first(self) -> CallDiff | None:
        """The first call that diverges, or None."""
        return next((c for c in self.calls if c.where is not None), None)

    @property
    def exit_code(self) -> ExitCode:
        """2 when a call could not be compared, else 1 when one diverges, else 0."""
        if any(c.error is not None for c in self.calls):
            return ExitCode.BAD_INPUT
        return ExitCode.CHECK_FAILED if self.first is not None else ExitCode.OK

    def conclusion(self) -> str:
        """One line: the first divergence, where it is and why; or that there is none."""
        first = self.first
        if first is not None:
            place = "upstream of attention" if first.where == "upstream" else "in the kernel"
            failed = first.failed_kernel()
            if first.where == "kernel" and failed is not None and failed.run == "a":
                place = "in run A's kernel"
            return f"first divergence: {first.a} — {place} ({first.reason()})"
        compared = [c for c in self.calls if c.error is None]
        largest = max(
            (
                c.differences[n].units
                for c in compared
                for n in INPUTS
                if n in c.differences and math.isfinite(c.differences[n].units)
            ),
            default=0.0,
        )
        judged = sum(c.kernel is not None for c in compared)
        kernels = f"; {judged} of B's outputs pass against their own inputs" if judged else ""
        return (
            f"no divergence: {len(compared)} of {len(self.calls)} calls compared, Q, K and "
            f"V within {compact(largest, 2)}u of A's{kernels}"
        )

    def to_dict(self) -> dict[str, Any]:
        first = self.first
        return {
            "runs": {"a": self.a, "b": self.b},
            "pairing": self.pairing.to_dict(),
            "rule": {"bound": self.bound, "jump": self.jump},
            "calls": [c.to_dict() for c in self.calls],
            "first": None if first is None else {"a": first.a, "b": first.b, "where": first.where},
            "conclusion": self.conclusion(),
            "exit_code": int(self.exit_code),
        }


def _json(x: float) -> float | str | None:
    """A number for JSON (:func:`~sdpa_cli.text.json_number`); null for NaN, nothing
    measured."""
    return None if math.isnan(x) else json_number(float(x))


# --- measuring ------------------------------------------------------------------------


def mismatch(a: AttentionSpec, b: AttentionSpec) -> str | None:
    """What two calls do not share that no difference measures: their shapes (leading
    1s aside), their scale (a temperature's included), softcap and dropout, ALiBi,
    a score-mod, sinks; None when they share them."""
    dims_a, dims_b = _dims(a), _dims(b)
    if dims_a != dims_b:
        return f"the shapes differ: {dims_a} in A, {dims_b} in B"
    for what, x, y in (
        ("scale", a.factor, b.factor),
        ("softcap", a.options.softcap, b.options.softcap),
        ("dropout", a.options.dropout, b.options.dropout),
    ):
        if x != y and not (x is not None and y is not None and math.isclose(x, y, rel_tol=1e-6)):
            return f"the {what} differs: {_words(x)} in A, {_words(y)} in B"
    for what, u, w in (
        ("ALiBi", a.options.alibi, b.options.alibi),
        ("score-mod", a.options.score_mod, b.options.score_mod),
        ("sinks", a.sinks is not None, b.sinks is not None),
    ):
        if u != w:
            return f"the {what} differs: {_given(u)} in A, {_given(w)} in B"
    return None


def _given(x: object) -> str:
    return "none" if x is None or x is False else "given" if x is True else str(x)


def _dims(spec: AttentionSpec) -> str:
    """``(2, 4) × L 16 × S 16, E 16, Ev 16``: the lead (leading 1s aside) and lengths."""
    lead = strip_ones((*spec.lead, 1))[:-1]
    return f"{shape(lead)} × L {spec.L} × S {spec.S}, E {spec.E}, Ev {spec.Ev}"


def _words(x: float | None) -> str:
    return "none" if x is None else compact(float(x), 6)


def compare_call(
    a: AttentionSpec,
    b: AttentionSpec,
    outputs: tuple[NDArray[Any] | None, NDArray[Any] | None],
    unit: float,
) -> tuple[dict[str, Difference], int, int]:
    """Q, K, V (and the outputs, ``(A's, B's)`` in the computation's layout, when both
    were recorded) of ``b`` against ``a``, counted in ``unit``; the rows compared;
    the rows whose visible keys differ. ``a`` and ``b`` share their shapes
    (:func:`mismatch`)."""
    rows, keys, mask_rows, added = _compared(a, b)
    found = {
        n: difference(_per_head(a, n), _per_head(b, n), rows if n == "q" else keys, a, unit)
        for n in INPUTS
    }
    if added is not None:
        found[ADDED] = _worst(added, np.asarray(rows.any(axis=-1)), a, unit)
    out_a, out_b = outputs
    if out_a is not None and out_b is not None:
        n = math.prod(a.lead)
        found["output"] = difference(
            np.reshape(out_a, (n, a.L, -1)), np.reshape(out_b, (n, a.L, -1)), rows, a, unit
        )
    return found, int(rows.sum()), mask_rows


def _per_head(spec: AttentionSpec, name: str) -> NDArray[np.float64]:
    """Q, K or V as ``(N, L or S, E)`` in float64, one slice per (batch, query head):
    K and V repeated over the query heads of their group."""
    x = np.asarray(getattr(spec, name))
    if name != "q" and spec.group > 1 and x.ndim >= 3 and x.shape[-3] * spec.group == spec.H:
        x = np.repeat(x, spec.group, axis=-3)
    whole = np.broadcast_to(x, (*spec.lead, *x.shape[-2:]))
    return whole.reshape(-1, *x.shape[-2:]).astype(np.float64)


def _compared(
    a: AttentionSpec, b: AttentionSpec
) -> tuple[NDArray[Any], NDArray[Any], int, NDArray[np.float64] | None]:
    """The query rows that see a key in both runs ``(N, L)``, the keys those rows see
    in either ``(N, S)``, how many of those rows see other keys in each, and per slice
    ``(N,)`` the relative RMS difference of what is added to the logits on the keys
    both runs see (None: neither adds anything)."""
    n = math.prod(a.lead)
    rows = np.ones((n, a.L), dtype=bool)
    keys = np.ones((n, a.S), dtype=bool)
    adds = _adds(a) or _adds(b)
    added = np.zeros(n) if adds else None
    differ = 0
    every = slice(0, a.L)
    for i, (ia, ib) in enumerate(zip(np.ndindex(*a.lead), np.ndindex(*b.lead), strict=True)):
        va, vb = visible_keys(a, ia, every), visible_keys(b, ib, every)
        if va is None and vb is None and added is None:
            continue
        va = np.ones((a.L, a.S), dtype=bool) if va is None else va
        vb = np.ones((a.L, a.S), dtype=bool) if vb is None else vb
        rows[i] = va.any(axis=1) & vb.any(axis=1)
        keys[i] = ((va | vb) & rows[i][:, None]).any(axis=0)
        differ += int(((va != vb).any(axis=1) & rows[i]).sum())
        if added is not None:
            both = va & vb
            added[i] = _relative(_added(a, ia), _added(b, ib), both)
    return rows, keys, differ, added


def _adds(spec: AttentionSpec) -> bool:
    """Whether the computation adds something to the logits: a bias, a float mask."""
    return spec.bias is not None or (spec.mask is not None and not spec.mask_is_bool)


def _added(spec: AttentionSpec, lead_index: tuple[int, ...]) -> NDArray[np.float64]:
    """What the slice adds to its logits ``(L, S)``: its bias and its float mask's
    finite values (the hidden keys' sentinels are the mask, compared as what it hides)."""
    total = np.zeros((spec.L, spec.S))
    if spec.bias is not None:
        total = total + spec.bias[spec.operand_index("bias", lead_index)]
    if spec.mask is not None and not spec.mask_is_bool:
        m = np.asarray(spec.mask[spec.operand_index("mask", lead_index)], dtype=np.float64)
        total = total + np.where(masks.hides(m), 0.0, m)
    return total


def _relative(a: NDArray[np.float64], b: NDArray[np.float64], keep: NDArray[np.bool_]) -> float:
    """RMS(b − a) / RMS(a) over ``keep`` (inf where only ``b`` adds anything)."""
    with np.errstate(invalid="ignore", over="ignore"):
        num = float(np.square(np.where(keep, b - a, 0.0)).sum())
        den = float(np.square(np.where(keep, a, 0.0)).sum())
    if den > 0:
        return math.sqrt(num / den)
    return math.inf if num > 0 else 0.0


def difference(
    a: NDArray[np.float64],
    b: NDArray[np.float64],
    keep: NDArray[np.bool_],
    spec: AttentionSpec,
    unit: float,
) -> Difference:
    """``b`` against ``a`` (both ``(N, n, D)``) over the rows ``keep`` ``(N, n)``: the
    largest RMS(B − A) / RMS(A) of a slice, and that slice's index in ``spec``'s lead."""
    with np.errstate(invalid="ignore", over="ignore"):
        same = (a == b) | (np.isnan(a) & np.isnan(b))  # inf = inf, NaN = NaN: no difference
        step = np.where(same, 0.0, b - a)
        step = np.where(np.isfinite(step), step, np.inf)  # one run finite, the other not
        num = np.where(keep, np.square(step).sum(axis=-1), 0.0).sum(axis=-1)
        den = np.where(keep, np.square(np.where(np.isfinite(a), a, 0.0)).sum(axis=-1), 0.0).sum(
            axis=-1
        )
        ratio = np.where(
            den > 0, np.sqrt(num / np.where(den > 0, den, 1.0)), np.where(num > 0, np.inf, 0.0)
        )
    return _worst(ratio, np.asarray(keep.any(axis=-1)), spec, unit)


def _worst(
    ratio: NDArray[np.float64], counted: NDArray[np.bool_], spec: AttentionSpec, unit: float
) -> Difference:
    """The largest of the slices' ratios ``(N,)`` among those ``counted``, and where."""
    if not counted.any():
        return Difference(math.nan, (), unit)
    ratio = np.where(counted, ratio, -1.0)
    worst = int(np.argmax(ratio))
    at = tuple(int(i) for i in np.unravel_index(worst, spec.lead)) if spec.lead else ()
    return Difference(float(ratio[worst]), at, unit)
