"""What a tensor file holds: every tensor's shape, dtype, range, moments, non-finite
counts, and headroom in float16 and bfloat16. Numpy only; never prints.

Every read goes through :mod:`sdpa_cli.files.loaders`, so every safety check of an input
applies here too: the format is sniffed from the first bytes, ``.npy`` headers are
checked against the file before it is memory-mapped and never unpickled, safetensors
headers are checked before allocation, YAML aliases are refused, text is capped. A file
the loaders refuse raises the same :class:`~sdpa_cli.errors.InputError` here.

What a file holds:

- ``.npy``: one array, named after the file (``q.npy`` → ``q``).
- ``.npz``: every member; ``file.npz:name`` one member.
- ``.safetensors``: every tensor, in name order (the loader re-reads the JSON header
  for each, a few KiB in practice); ``file.safetensors:name`` one tensor.
- PyTorch files (``torch.save``): every tensor, in the file's order, from one
  ``torch.load(weights_only=True)``; ``file.pt:name`` one tensor.
- ``.json``/``.yaml``: a mapping is a case file, read by
  :func:`~sdpa_cli.files.cases.load_case` (so it is refused as ``sdpa compute`` would
  refuse it) and reported tensor by tensor (``q``, ``k``, ``v``, ``bias``, ``mask``,
  inline or from the files they name); anything else is one nested list, named
  after the file.

A member of an ``.npz`` or ``.safetensors`` file that the loader refuses (a pickled
object array, a corrupt header entry) does not hide the others: it is reported as a
row of its own, carrying the loader's problem, and :func:`errors` lists it, so the
command can still exit 2. Problems of the file as a whole (missing, not the
format it claims, a corrupt safetensors header, no tensors at all) raise.

Statistics are over the finite values, in float64, gathered block by block over the
flat array (:data:`CHUNK` elements at a time), so a memory-mapped file of gigabytes is
never converted whole. Blocks are merged with Chan et al.'s pairwise update
(:class:`~sdpa_cli.engine.stats.Moments`), so a large common offset does not cancel the
spread. Overflow and underflow are decided by the cast itself
(:func:`~sdpa_cli.engine.precision.round_to`), as everywhere else in sdpa.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine import precision
from sdpa_cli.engine.options import OPTION_NAMES
from sdpa_cli.engine.records import Moments
from sdpa_cli.errors import InputError
from sdpa_cli.files.cases import load_case
from sdpa_cli.files.loaders import Source, sniff
from sdpa_cli.files.npy import load_npy, load_npz, npz_members
from sdpa_cli.files.pytorch import load_torch, torch_arrays
from sdpa_cli.files.safetensors import load_safetensors, safetensors_members
from sdpa_cli.files.structured import nested_to_array, parse_text
from sdpa_cli.text import printable

CHUNK = 1 << 20
"""Elements converted to float64 at a time: 8 MiB of working memory, whatever the file."""

HEADROOM_FORMATS = ("float16", "bfloat16")
"""Formats every tensor is measured against."""

SUBNORMAL_SHARE = 0.01
"""The share of a tensor's nonzero values that a cast must make subnormal before it is
a note: any data spread around zero holds a few values below the format's smallest
normal (randn in float16: about 5 in 100 000, |x| < 6.1e-5), and each loses bits only
below an absolute error of half the smallest subnormal (3e-8 in float16), far under the
rounding of the tensor's ordinary values. One value in a hundred says the tensor's own
scale nears the format's bottom (randn × 0.005 in float16), where the bits lost matter."""


@dataclass(frozen=True)
class Headroom:
    """One tensor against one low-precision format, as a cast to it would go.

    Attributes:
        format: ``float16`` or ``bfloat16``.
        max: the format's largest finite value.
        normal: the format's smallest positive normal value.
        tiny: the format's smallest positive (subnormal) value.
        bits: log2(max / largest finite |x|): negative means values beyond the format;
            inf for a tensor with no nonzero finite value, NaN for one with no finite value.
        overflow: finite values that become ±inf when cast.
        flush: nonzero finite values that become zero when cast.
        subnormal: nonzero finite values that become subnormal (nonzero, below
            ``normal``: fewer significant bits) when cast.
        nonzero: the tensor's nonzero finite values (the share's whole).
    """

    format: str
    max: float
    normal: float
    tiny: float
    bits: float
    overflow: int
    flush: int
    subnormal: int
    nonzero: int = 0

    @property
    def ok(self) -> bool:
        """Whether every value survives the cast with full precision bits."""
        return not (self.overflow or self.flush or self.subnormal)

    @property
    def subnormal_notable(self) -> bool:
        """Whether the values made subnormal are worth a note: at least
        :data:`SUBNORMAL_SHARE` of the nonzero ones (every one, when ``nonzero`` is
        not known)."""
        return self.subnormal > 0 and self.subnormal >= SUBNORMAL_SHARE * self.nonzero


@dataclass(frozen=True)
class TensorStats:
    """What one tensor holds.

    Attributes:
        name: the member name (``.npz``, ``.safetensors``, case-file key), or the
            file's stem for a file holding one array.
        shape: its shape.
        dtype: numpy's name for its dtype (``float32``, ``bfloat16``, ``int64``),
            with ``(big-endian)`` when it is stored so.
        size: the number of elements.
        finite: how many of them are finite (the statistics' sample).
        min: the smallest finite value (NaN when none).
        max: the largest finite value (NaN when none).
        mean: the mean of the finite values (NaN when none).
        std: their population standard deviation, numpy's default (NaN when none).
        nan: NaN elements.
        posinf: +inf elements.
        neginf: -inf elements.
        absmax: the largest finite |x| (NaN when none).
        absmin: the smallest nonzero finite |x| (NaN when none).
        headroom: one entry per format of :data:`HEADROOM_FORMATS`.
        source: for a case file, the file a tensor was read from (``None`` when inline
            or when the tensor is the file's own).
        where: for a refused member, the file and member at fault (the error's
            ``where``).
        problem: for a refused member, the loader's reason; every other field is then
            empty.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    size: int
    finite: int
    min: float
    max: float
    mean: float
    std: float
    nan: int
    posinf: int
    neginf: int
    absmax: float
    absmin: float
    headroom: tuple[Headroom, ...]
    source: str | None = None
    where: str | None = None
    problem: str | None = None

    @property
    def inf(self) -> int:
        """Infinite elements, of either sign."""
        return self.posinf + self.neginf

    @property
    def error(self) -> str | None:
        """``where: problem`` for a refused member, as the loader words it."""
        return None if self.problem is None else f"{self.where}: {self.problem}"


@dataclass(frozen=True)
class FileReport:
    """Every tensor of one file.

    Attributes:
        path: the file as given (with ``:member`` when one was picked).
        format: ``npy``, ``npz``, ``safetensors``, ``torch``, ``json`` or ``yaml``.
        case: whether a JSON or YAML file was read as a case file.
        tensors: one entry per tensor, in the file's order (refused members included).
    """

    path: str
    format: str
    case: bool
    tensors: tuple[TensorStats, ...]


def inspect_file(text: str, *, chunk: int = CHUNK) -> FileReport:
    """Read a file (``path``, ``path.npz:name`` or ``path.safetensors:name``) through
    the loaders and describe every tensor it holds.

    Args:
        text: the path as the user typed it.
        chunk: elements converted to float64 at a time.

    Returns:
        A :class:`FileReport`; members refused by the loader appear as rows with a
        ``problem``.

    Raises:
        InputError: the file as a whole cannot be read (the loader's message).
    """
    src = Source.parse(text)
    fmt = sniff(src.path, src.label)
    case = False
    rows: list[TensorStats] = []
    if fmt == "npy":
        rows.append(inspect_array(load_npy(src.path, src.label), src.path.stem, chunk=chunk))
    elif fmt in ("npz", "safetensors"):
        load = load_npz if fmt == "npz" else load_safetensors
        if src.member is not None:
            rows.append(
                inspect_array(load(src.path, src.member, src.label), src.member, chunk=chunk)
            )
        else:
            members = npz_members if fmt == "npz" else safetensors_members
            names = members(src.path, src.label)
            for name in names:
                label = f"{src.label}:{printable(name)}"  # a key may hold an ESC
                try:
                    arr = load(src.path, name, label)
                except InputError as exc:
                    rows.append(refused(name, exc))
                    continue
                rows.append(inspect_array(arr, name, chunk=chunk))
                del arr  # one member in memory at a time (.npz members are read whole)
    elif fmt == "torch":
        if src.member is not None:
            arr = load_torch(src.path, src.member, src.label)
            rows.append(inspect_array(arr, src.member, chunk=chunk))
        else:
            for name, found in torch_arrays(src.path, src.label):
                if isinstance(found, InputError):
                    rows.append(refused(name, found))
                else:
                    rows.append(inspect_array(found, name, chunk=chunk))
    else:
        data = parse_text(src.path, fmt, src.label)
        if isinstance(data, dict):
            case = True
            del data  # freed first: load_case parses again, as the owner of a case file's rules
            loaded = load_case(text, OPTION_NAMES)
            for key, arr in loaded.tensors.items():
                origin = loaded.sources[key]
                source = None if origin == f"{src.label}: {key}" else origin
                rows.append(inspect_array(arr, key, source=source, chunk=chunk))
        else:
            arr = nested_to_array(data, src.label)
            rows.append(inspect_array(arr, src.path.stem, chunk=chunk))
    return FileReport(path=src.label, format=fmt, case=case, tensors=tuple(rows))


def refused(name: str, exc: InputError) -> TensorStats:
    """The row of a member the loader refused: its name and the loader's problem."""
    nan = math.nan
    return TensorStats(
        name=name,
        shape=(),
        dtype="",
        size=0,
        finite=0,
        min=nan,
        max=nan,
        mean=nan,
        std=nan,
        nan=0,
        posinf=0,
        neginf=0,
        absmax=nan,
        absmin=nan,
        headroom=(),
        where=exc.where,
        problem=exc.problem,
    )


def dtype_name(dtype: np.dtype[Any]) -> str:
    """numpy's name of a dtype, with ``(big-endian)`` when it is stored so
    (ml_dtypes' ``bfloat16`` and ``float8_*`` keep their names)."""
    if dtype.byteorder == ">":  # numpy writes the native order as "="
        return f"{dtype.name} (big-endian)"
    return dtype.name


def _flat_blocks(a: NDArray[Any], chunk: int) -> Iterator[NDArray[Any]]:
    """Blocks of at most ``chunk`` elements covering ``a`` once, in memory order.

    A C- or Fortran-ordered array (what the loaders return, memory-mapped or not) is
    flattened as a view, so a memory-mapped file is read block by block, never
    copied whole. The statistics do not depend on the order.
    """
    flat = np.ravel(a, order="K")  # a view for any contiguous array, C or Fortran
    for start in range(0, flat.size, chunk):
        yield flat[start : start + chunk]


@dataclass
class _Tally:
    """Running counts of one format's cast outcomes."""

    overflow: int = 0
    flush: int = 0
    subnormal: int = 0


def inspect_array(
    a: NDArray[Any], name: str, *, source: str | None = None, chunk: int = CHUNK
) -> TensorStats:
    """Statistics of one array, block by block, in float64.

    min, max, mean and std are over the finite values; NaN and ±inf are counted. For
    each format of :data:`HEADROOM_FORMATS`: the bits between the largest finite |x|
    and the format's max, and how many values the cast overflows, flushes to zero or
    makes subnormal. Integers and booleans are converted to float64 (0 and 1 for
    booleans); integers beyond 2⁵³ round.

    Args:
        a: any real array (numpy, memory-mapped, or an ``ml_dtypes`` bfloat16/float8 one).
        name: what to call it.
        source: where a case file's tensor came from, if not inline.
        chunk: elements converted to float64 at a time (at least 1).

    Returns:
        A :class:`TensorStats`; an empty array has every statistic NaN and counts 0.
    """
    formats = [precision.fmt(f) for f in HEADROOM_FORMATS]
    moments = Moments()
    tallies = [_Tally() for _ in formats]
    nan = posinf = neginf = 0
    absmax = -math.inf
    absmin = math.inf
    nonzero_count = 0
    for block in _flat_blocks(a, max(1, chunk)):
        x = np.asarray(block, dtype=np.float64)
        ok = np.isfinite(x)
        if not ok.all():
            nan += int(np.count_nonzero(np.isnan(x)))
            posinf += int(np.count_nonzero(x == math.inf))
            neginf += int(np.count_nonzero(x == -math.inf))
            x = x[ok]
        if not x.size:
            continue
        mean = float(x.mean())
        # Each block's own sum of squared deviations, merged pairwise: no cancellation.
        m2 = float(np.square(x - mean).sum())
        moments.merge(Moments(int(x.size), mean, m2, float(x.min()), float(x.max())))
        mag = np.abs(x)
        absmax = max(absmax, float(mag.max()))
        nonzero = mag[mag > 0]
        nonzero_count += int(nonzero.size)
        if nonzero.size:
            absmin = min(absmin, float(nonzero.min()))
        for f, tally in zip(formats, tallies, strict=True):
            _tally(x, mag, f, tally)
    count = moments.count
    top = absmax if count else math.nan
    headroom = tuple(
        _headroom(f, t, top, nonzero_count) for f, t in zip(formats, tallies, strict=True)
    )
    return TensorStats(
        name=name,
        shape=tuple(int(n) for n in a.shape),
        dtype=dtype_name(a.dtype),
        size=int(a.size),
        finite=count,
        min=moments.lo if count else math.nan,
        max=moments.hi if count else math.nan,
        mean=moments.mean,
        # Population std (numpy's default): 0 for one value, as np.std gives.
        std=math.sqrt(moments.m2 / count) if count else math.nan,
        nan=nan,
        posinf=posinf,
        neginf=neginf,
        absmax=top,
        absmin=absmin if count and math.isfinite(absmin) else math.nan,
        headroom=headroom,
        source=source,
    )


def _headroom(f: precision.Format, t: _Tally, top: float, nonzero: int) -> Headroom:
    """A tensor against format ``f``: its largest finite magnitude ``top`` (NaN when it
    has no finite value), the cast's outcomes ``t`` and its ``nonzero`` finite values."""
    return Headroom(
        format=f.name,
        max=f.max,
        normal=f.normal,
        tiny=f.tiny,
        bits=f.headroom(top) if not math.isnan(top) else math.nan,
        overflow=t.overflow,
        flush=t.flush,
        subnormal=t.subnormal,
        nonzero=nonzero,
    )


def _tally(
    x: NDArray[np.float64], mag: NDArray[np.float64], f: precision.Format, t: _Tally
) -> None:
    """Count the finite values ``x`` (|x| = ``mag``) that the cast to ``f`` overflows,
    flushes to zero or makes subnormal. Only candidates are cast: beyond ``f.max``,
    or nonzero below ``f.normal``."""
    big = mag > f.max
    if big.any():
        t.overflow += int(np.count_nonzero(~np.isfinite(precision.round_to(x[big], f.name))))
    small = (mag < f.normal) & (mag > 0)
    if small.any():
        cast = np.abs(precision.round_to(x[small], f.name))
        t.flush += int(np.count_nonzero(cast == 0))
        # The cast decides: a value just below ``normal`` may round up to it.
        t.subnormal += int(np.count_nonzero((cast > 0) & (cast < f.normal)))


@dataclass(frozen=True)
class Unreadable:
    """A file that could not be read at all.

    Attributes:
        path: the file as given.
        error: the loader's error: ``where`` and ``problem``.
    """

    path: str
    error: InputError


def inspect_files(texts: Sequence[str], *, chunk: int = CHUNK) -> list[FileReport | Unreadable]:
    """:func:`inspect_file` on every path, in order; a file that cannot be read is an
    :class:`Unreadable` in its place, and the others are still read."""
    results: list[FileReport | Unreadable] = []
    for text in texts:
        try:
            results.append(inspect_file(text, chunk=chunk))
        except InputError as exc:
            results.append(Unreadable(text, exc))
    return results


def errors(results: Sequence[FileReport | Unreadable]) -> list[InputError]:
    """Every file and member that could not be read, in order, as the loader's errors."""
    found: list[InputError] = []
    for r in results:
        if isinstance(r, Unreadable):
            found.append(r.error)
        else:
            found += [InputError(t.where or r.path, t.problem) for t in r.tensors if t.problem]
    return found
