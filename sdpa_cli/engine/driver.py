"""The one block driver: every command walks the computation through :func:`sweep`.

A block is a few query rows of one (batch, head) slice, about :data:`BLOCK_ELEMENTS`
scores. :func:`sweep` owns how blocks are walked: their order, the thread pool, the
K and V of each slice converted once and shared (:class:`SliceInputs`), which key
range a block must compute (keys a causal mask, a window or key padding hides from
every row of the block are skipped), and progress. A command says only what it wants
from each block: its ``visit(place)`` computes the block through
:meth:`Place.attend` and returns a record, which ``sweep`` yields in block order
whatever the threads did, so results never depend on scheduling.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np

from sdpa_cli.engine.arrays import NUMPY, Backend, namespace, release_scratch
from sdpa_cli.engine.block import Block, Operands, attend_block, full_keys, key_range, operands
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.types import Index

T = TypeVar("T")

BLOCK_ELEMENTS = 1 << 19
"""Scores per block (rows × keys): 4 MiB of float64 (2 MiB of float32) per stage array."""

KeyMode = Literal["visible", "all", "all-if-v-nonfinite"]
"""Which keys a block computes: ``visible`` skips the key ranges hidden from every row
of the block (when hidden keys weigh nothing); ``all`` computes every key (a table or a
whole stage shows them); ``all-if-v-nonfinite`` skips like ``visible`` unless V holds
NaN or inf (the backward pass: 0 · NaN poisons a dense kernel's dS)."""

Progress = Callable[[int], None]
"""Told the number of scores done after each block."""


def block_rows(spec: AttentionSpec, elements: int | None = None) -> int:
    """Query rows per block: about ``elements`` scores (default :data:`BLOCK_ELEMENTS`),
    at least one row."""
    return max(1, (elements or BLOCK_ELEMENTS) // max(spec.S, 1))


def iter_blocks(
    spec: AttentionSpec, rows: int | None = None, leads: Iterable[Index] | None = None
) -> Iterator[tuple[Index, slice]]:
    """Every (lead index, query-row slice) pair, in C order (of ``leads`` when given)."""
    step = rows or block_rows(spec)
    every = (tuple(int(x) for x in lead) for lead in np.ndindex(*spec.lead))
    for lead in every if leads is None else leads:
        for i0 in range(0, spec.L, step):
            yield lead, slice(i0, min(i0 + step, spec.L))


class SliceInputs:
    """K and V per slice, converted once and shared by the blocks (and threads) that
    need them. Kept for the most recent ``keep`` slices, every conversion of a slice
    together (a check reads one slice as the reference, the emulated run and its
    float64 twin: evicting by conversion would convert the slice again every block)."""

    def __init__(self, keep: int = 2, backend: Backend = NUMPY) -> None:
        self._keep = keep
        self.backend = backend
        """What computes the lean pass (:mod:`~sdpa_cli.engine.arrays`)."""
        self.xp = namespace(backend)
        """Its namespace."""
        self._lock = threading.Lock()
        self._cache: OrderedDict[Index, dict[tuple[Any, ...], Operands]] = OrderedDict()

    def get(self, spec: AttentionSpec, lead: Index, emulate: bool = True) -> Operands:
        key = (id(spec), spec.operand_index("k", lead), spec.operand_index("v", lead), emulate)
        with self._lock:
            of_slice = self._cache.get(lead)
            if of_slice is None:
                of_slice = self._cache[lead] = {}
                while len(self._cache) > self._keep:
                    self._cache.popitem(last=False)
            found = of_slice.get(key)
            if found is None:
                found = of_slice[key] = operands(spec, lead, emulate)
            return found


@dataclass(frozen=True)
class Place:
    """Where a block sits: query rows ``rows`` of the slice at ``lead``, over the keys
    ``keys``; ``inputs`` is the sweep's cache of converted K and V; ``number`` its
    place in the sweep's order (0, 1, …)."""

    lead: Index
    rows: slice
    keys: slice
    inputs: SliceInputs
    number: int = 0

    @property
    def at(self) -> tuple[int | slice, ...]:
        """The block's rows of a ``(*lead, L, ...)`` array: ``array[place.at]``."""
        return (*self.lead, self.rows)

    def attend(self, spec: AttentionSpec, *, emulate: bool = True) -> Block:
        """Every stage of this block under ``spec`` (the sweep's spec, or another with
        the same shapes: a reference, another scale)."""
        inputs = self.inputs.get(spec, self.lead, emulate)
        return attend_block(
            spec, self.lead, self.rows, emulate=emulate, keys=self.keys, inputs=inputs
        )

    def part(self, spec: AttentionSpec, rows: slice) -> Place:
        """Some of this place's rows: their own key range when this place skips keys
        (fewer rows may see fewer keys), every key when it computes every key."""
        keys = self.keys
        if (keys.start, keys.stop) != (0, spec.S):
            keys = key_range(spec, self.lead, rows)
        return Place(self.lead, rows, keys, self.inputs, self.number)

    def twin(self, spec: AttentionSpec, block: Block) -> Block:
        """The float64 block an emulated block's statistics are read against: what
        *would* overflow or flush comes from exact values (the block itself when the
        run is not emulated)."""
        return self.attend(spec, emulate=False) if spec.options.emulated else block


def _keys(
    spec: AttentionSpec, lead: Index, rows: slice, mode: KeyMode, inputs: SliceInputs
) -> slice:
    if mode == "all":
        return full_keys(spec)
    keys = key_range(spec, lead, rows)
    skipped = (keys.start, keys.stop) != (0, spec.S)
    if mode == "all-if-v-nonfinite" and skipped and inputs.get(spec, lead, False).v_bad.any():
        return full_keys(spec)
    return keys


def sweep(
    spec: AttentionSpec,
    visit: Callable[[Place], T],
    *,
    jobs: int = 1,
    rows: int | None = None,
    leads: Iterable[Index] | None = None,
    keys: KeyMode = "visible",
    progress: Progress | None = None,
    ahead: int | None = None,
    backend: Backend | None = None,
) -> Iterator[T]:
    """``visit(place)`` for every block, on ``jobs`` threads, results in block order.

    numpy releases the GIL in matmuls and ufuncs, so threads share the work; at most
    ``ahead`` blocks are in flight, which bounds the memory. With ``jobs`` = 1
    everything runs in the calling thread.

    Args:
        spec: the computation whose blocks are walked.
        visit: computes what the command wants from one block.
        jobs: threads computing blocks.
        rows: query rows per block (default :func:`block_rows`); any value gives the
            same numbers to rounding.
        leads: the slices to walk (default every one, in C order).
        keys: which keys each block computes (:data:`KeyMode`).
        progress: told the scores done after each block.
        ahead: blocks in flight, computed or being computed, at most (default two per
            thread; fewer where each block's result is large).
        backend: the library the lean pass computes with (default numpy; a sweep
            whose visits run the lean pass passes
            :func:`~sdpa_cli.engine.forward.lean_backend`); torch runs its own threads,
            or a device's: its blocks then run one at a time.
    """
    backend = backend or NUMPY
    if backend.threads_own:
        jobs = 1
    in_flight = max(ahead or 2 * jobs, jobs)
    per_lead = max(1, -(-spec.L // (rows or block_rows(spec))))  # blocks in a slice
    # the slices whose K and V stay converted: as many as the blocks in flight can
    # span (two for long sequences: 16 MiB each of float64 K and V at S = 16384)
    inputs = SliceInputs(keep=min(jobs + 1, 1 + -(-(in_flight - 1) // per_lead)), backend=backend)
    places = (
        Place(lead, r, _keys(spec, lead, r, keys, inputs), inputs, n)
        for n, (lead, r) in enumerate(iter_blocks(spec, rows, leads))
    )

    def done(place: Place, result: T) -> T:
        if progress is not None:
            progress((place.rows.stop - place.rows.start) * max(spec.S, 1))
        return result

    if jobs <= 1:
        try:
            for place in places:
                yield done(place, visit(place))
        finally:
            if backend.threads_own:  # a device's block buffers go back when the sweep ends
                release_scratch()
        return
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="sdpa") as pool:
        pending: deque[tuple[Place, Future[T]]] = deque()
        try:
            for place in places:
                pending.append((place, pool.submit(visit, place)))
                if len(pending) >= in_flight:
                    first, future = pending.popleft()
                    yield done(first, future.result())
            while pending:
                first, future = pending.popleft()
                yield done(first, future.result())
        finally:
            for _, future in pending:
                future.cancel()


class InOrder:
    """Blocks' turns, in the sweep's order: a thread that computed block ``n`` merges
    its result into the whole with ``with order.turn(place.number):``, once every
    earlier block has merged. Sums then run in block order whatever ``jobs`` is, and
    a result is dropped once merged rather than held until the caller reaches it.

    The sweep's threads start blocks in order, so a thread waits only on blocks being
    computed; a block that fails (:meth:`failed`) releases every thread waiting."""

    def __init__(self) -> None:
        self._turn = threading.Condition()
        self._next = 0
        self._broken = False

    @contextmanager
    def turn(self, number: int) -> Iterator[None]:
        """Wait for block ``number``'s turn; the next block's comes when this ends."""
        with self._turn:
            self._turn.wait_for(lambda: self._next == number or self._broken)
            if self._broken:
                raise RuntimeError("an earlier block failed")
            try:
                yield
            except BaseException:
                self._broken = True
                raise
            finally:
                self._next += 1
                self._turn.notify_all()

    def failed(self) -> None:
        """A block failed before its turn: no later block will get one."""
        with self._turn:
            self._broken = True
            self._turn.notify_all()


def slice_blocks(spec: AttentionSpec, lead: Index) -> Iterator[Block]:
    """Every block of the slice at ``lead``, every key of it, in order: for what
    describes a whole slice (``explain``'s notes, the scale comparison)."""
    return sweep(spec, lambda place: place.attend(spec), leads=[lead], keys="all")
