"""The backward pass: dQ, dK, dV (and d(bias)) of attention, analytically, block by block.

For the scalar loss ℓ = Σ O ⊙ dO (dO the output's gradient) and one block of query
rows, with A the weights, P the weights after dropout (A · keep / (1 − p)), and the
factor f = scale / temperature:

    dV     += Pᵀ · dO                                   (S, Ev)
    dP      = dO · Vᵀ                                   (rows, S)
    dA      = dP · keep / (1 − p)                       dP without dropout
    dS      = A ⊙ (dA − rowsum(dA ⊙ A))                 the softmax's Jacobian
    dlogits = dS, zero where a mask replaced the logit  (a float mask adds: it passes)
    d(bias) = dlogits                                   summed over broadcast axes
    dscaled = dlogits ⊙ (1 − tanh²(scaled / C))        softcap C's chain rule
    dQ      = dscaled · K · f;  dK += dscaledᵀ · Q · f  GQA: summed over the group

Every block recomputes its weights (as FlashAttention's backward does) rather than
reading stored ones, so nothing score-sized outlives a block; dK, dV and d(bias)
are summed over blocks in block order, so the result does not depend on ``--jobs``.
The backward pass runs in float64 whatever ``--dtype`` says: the format is what
the gradients' range is judged against (:mod:`sdpa_cli.diagnosis.grad`).

Per row the pass keeps what the gradient-health findings read: ‖dA‖, ‖dS‖, the
largest weight and 1 − Σ A², which bounds the softmax Jacobian's norm (the
Jacobian diag(A) − A Aᵀ is positive semi-definite, so its norm is at most its
trace): ‖dS‖ ≤ (1 − Σ A²) · ‖dA‖, and a one-hot row passes back nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine.block import sink_head
from sdpa_cli.engine.driver import InOrder, KeyMode, Place, Progress, block_rows, sweep
from sdpa_cli.engine.grad_block import (
    BlockGrad,
    add_bias_gradient,
    backward_block,
    lean_backward_block,
)
from sdpa_cli.engine.grad_health import GRAD_RECORDS, HealthRecords, record_bytes
from sdpa_cli.engine.precision import is_float
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.trace import check_memory, split_heads_of_output
from sdpa_cli.engine.types import F64, Index
from sdpa_cli.errors import SpecError
from sdpa_cli.names import GRADIENTS

if TYPE_CHECKING:
    from sdpa_cli.engine.stats import Stats


OPERAND = {"dq": "q", "dk": "k", "dv": "v", "dbias": "bias", "dsinks": "sinks"}

SLICED = ("dq", "dk", "dv")
"""The gradients finished slice by slice (the others are summed to the end)."""

BACKWARD_ELEMENTS = 1 << 20
"""Scores per block of the backward pass: twice the forward pass's
(:data:`~sdpa_cli.engine.driver.BLOCK_ELEMENTS`). Each block gives dK and dV over
every key it reads, S × E apiece, summed into the whole: taller blocks give those
products more rows and leave fewer sums (1, 8, 16384, 64: 37.8 → 27.3 s), for two
block-sized arrays per thread (8 MiB each)."""


def random_stream(seed: int, purpose: int) -> np.random.Generator:
    """One independent random stream per use of ``--seed`` (1: a random dO, 2: the
    entries a numeric check samples); dropout draws from its own Philox counter."""
    return np.random.default_rng([seed, purpose])


def make_dout(
    spec: AttentionSpec, given: str | NDArray[Any], seed: int, where: str
) -> NDArray[Any]:
    """The output's gradient dO in the engine's layout ``(*lead, L, Ev)``: float64, or a
    file's float16 or float32 as it is (every value exact; the products read it as
    float64 block by block: a quarter of the memory for a float16 dO).

    Args:
        given: ``ones``, ``random`` (standard normal, from ``seed``) or an array
            shaped like the output as returned (leading axes of size 1 may differ).
        where: how to name the source in an error (``--dout`` or the file).

    Raises:
        SpecError: when the array's shape is not the output's, or its values not numbers.
    """
    if spec.qv_width:  # dK would hold V's gradient through the scores: not split back
        raise SpecError(
            "--qv",
            "the backward pass of the qv term is not supported (nor is it in FlashAttention-3)",
        )
    shape = spec.merged_output_shape
    if isinstance(given, str):
        if given == "ones":
            return np.ones(spec.output_shape)
        if given == "random":
            return split_heads_of_output(spec, random_stream(seed, 1).standard_normal(shape))
        raise SpecError(where, f"expected a file, ones or random, got {given!r}")
    arr = np.asarray(given)
    if arr.dtype.names is not None or not (arr.dtype.kind in "biuf" or is_float(arr.dtype)):
        raise SpecError(where, f"dO has dtype {arr.dtype}; expected numbers")
    if _squeezed(arr.shape) != _squeezed(shape):
        raise SpecError(
            where,
            f"dO should have the output's shape {shape}: but got {tuple(arr.shape)}",
        )
    kept = arr.dtype if arr.dtype in (np.float16, np.float32) else np.float64
    return split_heads_of_output(spec, np.asarray(arr, dtype=kept).reshape(shape))


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape without its leading axes of size 1."""
    i = 0
    while i < len(shape) - 2 and shape[i] == 1:
        i += 1
    return tuple(shape[i:])


@dataclass(frozen=True)
class Gradients(HealthRecords):
    """The gradients of ``Σ O ⊙ dO`` and what the health findings read.

    ``dq``, ``dk``, ``dv`` and ``dbias`` are float64 and shaped like ``spec.q``,
    ``spec.k``, ``spec.v`` and ``spec.bias`` (the engine's layout; see
    :meth:`loaded`). Row records are ``(*lead, L)``; key records ``(*lead, S)``.
    """

    spec: AttentionSpec
    dout: NDArray[Any]
    """dO as :func:`make_dout` gives it (float64, or a file's float16 or float32)."""
    dq: F64
    dk: F64
    dv: F64
    dbias: F64 | None
    health: Mapping[str, NDArray[Any]]
    """Every record of :data:`~sdpa_cli.engine.grad_health.GRAD_RECORDS`, by name."""
    dsinks: F64 | None = None
    """With ``--sinks``: d(sink logit) per head, shaped like ``spec.sinks``:
    Σ over the head's rows of p_sink · (0 − Σ_j A_j dA_j)."""
    kept: frozenset[Index] | None = None
    """The query slices (positions of the lead) whose dQ, dK and dV were kept; None:
    every one. The others are zeros never written (pages never touched): read kept
    slices with :meth:`at`."""

    def vanishing(self, threshold: float) -> NDArray[np.bool_]:
        """``(*lead, L)``: the rows whose softmax passes back less than ``threshold`` of
        their gradient (1 − Σ w²), among those that see two keys or more (one key always
        gets weight 1)."""
        with np.errstate(invalid="ignore"):
            return (self.n_visible >= 2) & np.isfinite(self.gain) & (self.gain < threshold)

    def tensor(self, name: str) -> F64 | None:
        """``dq``, ``dk``, ``dv`` or ``dbias`` in the engine's layout, whole.

        Raises:
            ValueError: when the pass kept some slices only (:attr:`kept`).
        """
        if self.kept is not None and name in SLICED:
            raise ValueError(f"{name} was kept for some slices only; read them with at()")
        return getattr(self, name)  # type: ignore[no-any-return]

    def at(self, name: str, lead: Index) -> F64:
        """The slice of ``dq``, ``dk`` or ``dv`` that the query slice ``lead`` reads
        (under grouped-query attention, a key/value head its group shares)."""
        if self.kept is not None and lead not in self.kept:
            raise ValueError(f"{name} was not kept for the slice at {lead}")
        part: F64 = getattr(self, name)[self.spec.operand_index(OPERAND[name], lead)]
        return part

    def loaded(self, name: str) -> F64 | None:
        """A gradient in the shape its operand was loaded in (heads merged back)."""
        values = self.tensor(name)
        return None if values is None else self.spec.as_loaded(OPERAND[name], values)

    def present(self) -> tuple[str, ...]:
        """The gradients this computation has (``dbias`` only with a bias)."""
        return tuple(n for n in GRADIENTS if getattr(self, n) is not None)


SliceSink = Callable[[str, Index, F64], object]
"""Told each finished slice of dQ, dK and dV: the gradient's name, the slice's index in
its operand's leading axes, its values ``(L or S, E)``, valid during the call."""


def backward(
    spec: AttentionSpec,
    dout: NDArray[Any],
    *,
    rows: int | None = None,
    jobs: int = 1,
    progress: Progress | None = None,
    stats: Stats | None = None,
    keep: Collection[Index] | None = None,
    on_slice: SliceSink | None = None,
) -> Gradients:
    """dQ, dK, dV and d(bias) of ``Σ O ⊙ dO``, over every block of the computation.

    dQ, dK and dV are summed slice by slice: a slice is finished after the last query
    slice that reads it (a key/value head after its group's last query head) and
    handed to ``on_slice``, so a reader can judge the whole gradient while the pass
    keeps only the slices asked for. Each slice's sums run in block order whatever is
    kept: a kept slice is bit for bit the same.

    Args:
        spec: the validated computation.
        dout: dO in the engine's layout, from :func:`make_dout`.
        rows: query rows per block (default: :data:`BACKWARD_ELEMENTS` scores).
        jobs: threads computing blocks.
        progress: told the scores done after each block.
        stats: gathers the forward pass's statistics (``Stats.empty(spec)``), so that
            one pass gives the forward findings too; ``spec`` must then be float64.
        keep: the query slices (positions of ``spec.lead``) whose dQ, dK and dV to
            keep; None keeps every one (:attr:`Gradients.kept`).
        on_slice: told every finished slice of dQ, dK and dV, in no promised order.
    """
    if spec.options.score_mod is not None:  # its derivative would need autodiff
        raise SpecError("--score-mod", "has no backward pass here; use it with compute")
    kept = None if keep is None else frozenset(keep)
    check_fits(spec, kept)
    sums = _SliceSums(spec, kept, on_slice)
    dbias = np.zeros(spec.bias.shape) if spec.bias is not None else None
    dsinks: F64 | None = np.zeros(spec.sinks.shape) if spec.sinks is not None else None
    length = {"row": spec.L, "key": spec.S}
    health = {r.name: np.zeros((*spec.lead, length[r.axis]), r.dtype) for r in GRAD_RECORDS}

    def merge(g: BlockGrad) -> None:
        li, r, ks = g.lead_index, g.rows, g.keys
        if stats is not None and g.records is not None:
            stats.merge(g.records)
        sums.at("dq", li)[r] += g.dq
        sums.at("dk", li)[ks] += g.dk
        sums.at("dv", li)[ks] += g.dv
        if dbias is not None and g.dbias is not None:
            add_bias_gradient(spec, dbias, li, r, ks, g.dbias)
        if dsinks is not None and g.dsinks is not None:
            dsinks[sink_head(spec, li)] += g.dsinks.sum()
        at: tuple[int | slice, ...] = (*li, r)
        for record in GRAD_RECORDS:
            if record.merge is None:  # a row's record: one block's
                health[record.name][at] = g.health[record.name]
            else:  # a key's: every block of rows'
                record.merge(health[record.name][li][ks], g.health[record.name])

    order = InOrder()

    def visit(place: Place) -> None:
        """One block, merged in its turn by the thread that computed it: its dK and
        dV (S × E each) are dropped at once, and the merges run beside the blocks."""
        try:
            inputs = place.inputs.get(spec, place.lead, emulate=False)
            g = dout[place.at]
            block = lean_backward_block(spec, place, g, inputs, stats) or backward_block(
                spec, place.lead, place.rows, g, keys=place.keys, inputs=inputs, stats=stats
            )
        except BaseException:
            order.failed()
            raise
        with order.turn(place.number):
            merge(block)

    # NaN or inf in V outside a block's keys would poison a dense kernel's dS through
    # 0 · NaN: such blocks compute every key.
    sweep_keys: KeyMode = "all-if-v-nonfinite"
    rows = rows or block_rows(spec, BACKWARD_ELEMENTS)
    for _ in sweep(spec, visit, jobs=jobs, rows=rows, keys=sweep_keys, progress=progress):
        pass
    sums.finish_all()
    if stats is not None:
        stats.add_all_moments()
    return Gradients(
        spec=spec,
        dout=dout,
        dq=sums.whole["dq"],
        dk=sums.whole["dk"],
        dv=sums.whole["dv"],
        dbias=dbias,
        dsinks=dsinks,
        health=health,
        kept=kept,
    )


def check_fits(spec: AttentionSpec, kept: frozenset[Index] | None = None) -> None:
    """Refuse, before allocating, a backward pass whose gradients cannot fit in memory
    (rather than be killed): 8 bytes a value of dQ, dK and dV kept (every one with
    ``kept`` None, else the slices kept and one being summed), of d(bias), and the
    records of every row and key.

    Raises:
        SpecError: with the memory needed and available.
    """
    sizes = [math.prod(getattr(spec, OPERAND[n]).shape[-2:]) for n in SLICED]
    if kept is None:
        values = sum(math.prod(getattr(spec, OPERAND[n]).shape) for n in SLICED)
    else:
        values = (len(kept) + 1) * sum(sizes)
    values += math.prod(spec.bias.shape) if spec.bias is not None else 0
    records = record_bytes(math.prod((*spec.lead, spec.L)), math.prod((*spec.lead, spec.S)))
    need = 8 * values + records
    check_memory(
        need,
        f"gradients of Q {spec.shapes.get('q', spec.q.shape)}",
        f"keeping {'every gradient' if kept is None else 'the gradients shown'} in float64",
        "slice the inputs",
    )


class _SliceSums:
    """dQ, dK and dV summed slice by slice: a kept slice in its place in the whole
    array (``np.zeros``: the pages of a slice never kept are never touched), any other
    in an array of its own, dropped once finished."""

    def __init__(
        self, spec: AttentionSpec, kept: frozenset[Index] | None, on_slice: SliceSink | None
    ) -> None:
        self.spec, self.on_slice = spec, on_slice
        self.whole = {n: np.zeros(getattr(spec, OPERAND[n]).shape) for n in SLICED}
        # each operand slice: the slices kept (None: all), the last query slice to read
        # it in block order (it is finished after that one), those handed over
        self.kept = {
            n: None if kept is None else {spec.operand_index(OPERAND[n], li) for li in kept}
            for n in SLICED
        }
        self.last: dict[str, dict[Index, Index]] = {n: {} for n in SLICED}
        for lead in np.ndindex(*spec.lead):
            li = tuple(int(i) for i in lead)
            for n in SLICED:
                self.last[n][spec.operand_index(OPERAND[n], li)] = li
        self.open: dict[str, dict[Index, F64]] = {n: {} for n in SLICED}
        self.done: dict[str, set[Index]] = {n: set() for n in SLICED}
        self.lead: Index | None = None

    def at(self, name: str, lead: Index) -> F64:
        """Where query slice ``lead`` sums its part of gradient ``name``."""
        if lead != self.lead:
            if self.lead is not None:
                self._finish(self.lead)
            self.lead = lead
        oi = self.spec.operand_index(OPERAND[name], lead)
        target = self.open[name].get(oi)
        if target is None:
            kept, whole = self.kept[name], self.whole[name]
            target = whole[oi] if kept is None or oi in kept else np.zeros(whole.shape[-2:])
            self.open[name][oi] = target
        return target

    def _finish(self, lead: Index) -> None:
        for n in SLICED:
            oi = self.spec.operand_index(OPERAND[n], lead)
            if self.last[n][oi] == lead and oi in self.open[n]:
                self._hand(n, oi, self.open[n].pop(oi))

    def _hand(self, name: str, oi: Index, values: F64) -> None:
        self.done[name].add(oi)
        if self.on_slice is not None:
            self.on_slice(name, oi, values)

    def finish_all(self) -> None:
        """Finish the last slice, then every slice no block reached (zeros: L = 0)."""
        if self.lead is not None:
            self._finish(self.lead)
        for n in SLICED:
            for index in np.ndindex(*self.whole[n].shape[:-2]):
                oi = tuple(int(i) for i in index)
                if oi not in self.done[n]:
                    self._hand(n, oi, self.whole[n][oi])
