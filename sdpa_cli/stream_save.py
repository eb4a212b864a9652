"""``--save FILE.npz``: ``sdpa compute``'s written block by block, ``sdpa grad``'s.

The .npz holds what ``np.savez`` writes, one ``.npy`` member per stage: one sweep writes
every stage's blocks into temporary files, then each is copied into its member. The
disk it needs is checked before anything is computed (:func:`check_room`).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import zipfile
from typing import IO, Any, BinaryIO

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.engine.block import applicable_stages
from sdpa_cli.engine.driver import Place, Progress, sweep
from sdpa_cli.engine.grad import Gradients
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.trace import merge_heads
from sdpa_cli.errors import InputError
from sdpa_cli.files.writers import Writer, write_atomic
from sdpa_cli.report import grad_arrays


def stage_shape(spec: AttentionSpec, name: str) -> tuple[int, ...]:
    """A stage's shape as written: the output's as returned (heads merged under
    ``--heads``, ``(..., L, H, Ev)`` under ``--layout bshd``)."""
    return spec.merged_output_shape if name == "output" else spec.weights_shape


_MEMBER_BYTES = 512
"""A bound on what a member adds to its values: the .npy header (64-byte aligned), the
zip's local header and central directory entry with their zip64 fields."""

_COPY_BYTES = 1 << 20
"""Bytes copied at a time from a temporary file into the .npz."""


def _npz_members(spec: AttentionSpec) -> list[tuple[str, tuple[int, ...], np.dtype[Any]]]:
    """What ``--save`` writes, in order: every stage the options bring about, then
    ``visible``; each name, shape and dtype."""
    f8, b1 = np.dtype(np.float64), np.dtype(np.bool_)
    stages = [(s, stage_shape(spec, s), f8) for s in applicable_stages(spec)]
    return [*stages, ("visible", spec.weights_shape, b1)]


def npz_bytes(spec: AttentionSpec) -> int:
    """The size of the ``--save`` file, to a few hundred bytes: 8 bytes per value of
    each stage, 1 per score of ``visible``, and the headers."""
    return sum(
        math.prod(shape) * dt.itemsize + _MEMBER_BYTES for _, shape, dt in _npz_members(spec)
    )


def save_room(spec: AttentionSpec) -> int:
    """The disk ``--save`` needs while it writes: the file, and its largest member
    still in a temporary file (each is freed once copied into the file)."""
    largest = max(math.prod(shape) * dt.itemsize for _, shape, dt in _npz_members(spec))
    return npz_bytes(spec) + largest


def check_room(spec: AttentionSpec, path: str) -> None:
    """Refuse, before computing, an ``--save`` file the disk it goes to cannot hold.

    Raises:
        InputError: naming ``path``, with the size needed and the space free.
    """
    folder = os.path.dirname(os.path.abspath(path))
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return  # a missing folder: the write names it
    need = save_room(spec)
    if need > free:
        gib = 2.0**30
        scores = len(_npz_members(spec)) - 2  # less the output and the visibility
        raise InputError(
            os.fspath(path),
            f"needs {need / gib:.1f} GiB of disk while it is written ({scores} stages of "
            f"{spec.weights_shape} in float64, the output and the visibility, one of them "
            f"twice), but {free / gib:.1f} GiB is free on its disk; save it elsewhere, "
            "or slice the inputs",
        )


def save_npz(
    spec: AttentionSpec, path: str, *, jobs: int = 1, progress: Progress | None = None
) -> None:
    """Write every stage (full shape) and ``visible`` to ``path``, atomically
    (:func:`stages_writer`)."""
    write_atomic(path, stages_writer(spec, path, jobs=jobs, progress=progress))


def stages_writer(
    spec: AttentionSpec, path: str, *, jobs: int = 1, progress: Progress | None = None
) -> Writer:
    """The writer of every stage (full shape) and ``visible`` as an .npz for ``path``
    (for :func:`~sdpa_cli.files.writers.write_all_atomic`), as ``np.savez`` writes a
    trace kept whole.

    One sweep computes every stage of each block and writes its rows at their place
    in the stage's temporary file beside ``path`` (anonymous: nothing is left, even
    if the process is killed); the temporary files are then copied, one by one, into
    the .npz's members. Writing twice costs less than computing each stage again.

    Args:
        spec: the computation.
        path: the .npz file; it appears whole or not at all.
        jobs: threads computing blocks.
        progress: told the scores done after each block.
    """
    members = _npz_members(spec)
    folder = os.path.dirname(os.path.abspath(path))

    def write(fh: BinaryIO) -> None:
        with contextlib.ExitStack() as stack:
            temps = {
                name: stack.enter_context(tempfile.TemporaryFile(dir=folder))
                for name, shape, _ in members
                if math.prod(shape) > 0
            }
            _fill(spec, {name: t.fileno() for name, t in temps.items()}, jobs, progress)
            # np.savez's layout: stored (uncompressed) members, zip64 forced on each.
            with zipfile.ZipFile(fh, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
                for name, shape, dt in members:
                    with zf.open(f"{name}.npy", "w", force_zip64=True) as member:
                        header = {"descr": np.lib.format.dtype_to_descr(dt), "fortran_order": False}
                        np.lib.format.write_array_header_1_0(member, {**header, "shape": shape})
                        temp = temps.pop(name, None)
                        if temp is not None:
                            _copy(spec, name, temp, member)
                            temp.close()  # its disk is freed as the .npz grows

    return write


def _fill(spec: AttentionSpec, fds: dict[str, int], jobs: int, progress: Progress | None) -> None:
    """One sweep over every key: each block's rows of each stage (and ``visible``) at
    their offset in the file ``fds[name]``, in the engine's layout ``(*lead, L, ...)``.
    The threads write their own blocks, so nothing waits for the order."""
    if not fds:
        return

    def visit(place: Place) -> None:
        block = place.attend(spec)
        first = 0  # the block's first row, counted over every slice before it
        for i, n in zip(place.lead, spec.lead, strict=True):
            first = first * n + i
        first = first * spec.L + place.rows.start
        for name, fd in fds.items():
            values = block.visible if name == "visible" else getattr(block, name)
            dt = np.bool_ if name == "visible" else np.float64
            data: NDArray[Any] = np.ascontiguousarray(values, dtype=dt)
            _pwrite_all(fd, data.data.cast("B"), first * data[0].nbytes)

    for _ in sweep(spec, visit, jobs=jobs, keys="all", progress=progress):
        pass


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _copy(spec: AttentionSpec, name: str, temp: IO[bytes], member: IO[bytes]) -> None:
    """A stage's temporary file into its member; the output with its heads merged,
    ``(..., L, heads · Ev)`` under ``--heads``, ``(..., L, H, Ev)`` under ``--layout
    bshd`` (the same bytes; a slice of the leading axes at a time)."""
    temp.seek(0)
    if name != "output" or not spec.output_rearranged:
        shutil.copyfileobj(temp, member, _COPY_BYTES)
        return
    heads = spec.lead[-1]
    per_slice = heads * spec.L * spec.Ev
    for _ in range(math.prod(spec.lead[:-1])):
        parts = np.frombuffer(temp.read(8 * per_slice), np.float64)
        merged = np.moveaxis(parts.reshape(heads, spec.L, spec.Ev), 0, 1)
        member.write(np.ascontiguousarray(merged).data)


def gradients_writer(grads: Gradients) -> Writer:
    """The writer of ``dq``, ``dk``, ``dv`` (and ``dbias``), each in its operand's shape
    as loaded, and the ``dout`` used, as an .npz."""

    def write(fh: BinaryIO) -> None:
        arrays = grad_arrays(grads)
        arrays["dout"] = merge_heads(grads.spec, grads.dout).astype(np.float64)  # as the gradients
        np.savez(fh, **arrays)  # type: ignore[arg-type]

    return write
