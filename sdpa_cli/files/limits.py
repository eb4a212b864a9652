"""The limits of the machine a run must fit in: the memory it may still take.

The smallest of three, each where known: Linux's ``MemAvailable``; the address space
left under ``ulimit -v`` / ``prlimit --as`` (``RLIMIT_AS`` less this process's
``VmSize``); the room left in the process's cgroup (v2 ``memory.max`` less
``memory.current``; v1 ``memory.limit_in_bytes`` less ``memory.usage_in_bytes``), as
in a container. A run that would not fit is refused up front with one line rather
than dying of MemoryError (or the OOM killer) halfway.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

from sdpa_cli.errors import InputError

_UNLIMITED = 1 << 60
"""Above this a cgroup's limit means none (v1 writes 2**63 rounded to a page)."""


def cores() -> int:
    """The cores this process may run on: a run's threads by default (``--jobs``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def available_memory(proc: str = "/proc", sys: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process may still allocate: the least of MemAvailable, the address
    space left under RLIMIT_AS and the cgroup's room; None when none is known.

    Args:
        proc: where ``/proc`` is (tests point it at a fake tree).
        sys: where the cgroup file system is mounted.
    """
    known = [
        n
        for n in (
            _mem_available(Path(proc)),
            _address_space_left(Path(proc)),
            _cgroup_left(Path(proc), Path(sys)),
        )
        if n is not None
    ]
    return max(0, min(known)) if known else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return None


def _kib_field(text: str | None, field: str) -> int | None:
    """``Field:   1234 kB`` of a /proc file, in bytes."""
    for line in (text or "").splitlines():
        if line.startswith(field + ":"):
            try:
                return int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                return None
    return None


def _mem_available(proc: Path) -> int | None:
    return _kib_field(_read(proc / "meminfo"), "MemAvailable")


def _address_space_left(proc: Path, limit: int | None = None) -> int | None:
    """RLIMIT_AS (its soft limit) less the address space in use (``VmSize``)."""
    if limit is None:
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        limit = soft
    if limit == resource.RLIM_INFINITY or limit < 0:
        return None
    used = _kib_field(_read(proc / "self" / "status"), "VmSize") or 0
    return limit - used - BLAS_ADDRESS_SPACE * (os.cpu_count() or 1)


BLAS_ADDRESS_SPACE = 96 << 20
"""Address space that the BLAS library (OpenBLAS: a work buffer per thread) and each
thread's stack take on top of what sdpa counts, per core: under ``ulimit -v`` a run
that left them less failed inside OpenBLAS's malloc (exit 1, or a hang) where it
should have been refused up front."""


def _cgroup_left(proc: Path, root: Path) -> int | None:
    """The room left in this process's cgroup, v2 or v1; None when unlimited or unknown."""
    rooms: list[int] = []
    for line in (_read(proc / "self" / "cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, where = parts
        rel = where.lstrip("/")
        if controllers == "":  # v2: 0::/path
            room = _room(root / rel / "memory.max", root / rel / "memory.current")
            if room is None and rel:  # a container sees its own cgroup at the root
                room = _room(root / "memory.max", root / "memory.current")
        elif "memory" in controllers.split(","):
            base = root / "memory"
            room = _room(base / rel / "memory.limit_in_bytes", base / rel / "memory.usage_in_bytes")
            if room is None and rel:
                room = _room(base / "memory.limit_in_bytes", base / "memory.usage_in_bytes")
        else:
            continue
        if room is not None:
            rooms.append(room)
    return min(rooms) if rooms else None


def _room(limit_file: Path, usage_file: Path) -> int | None:
    """A cgroup's limit less its usage; None when it has no limit or none is readable."""
    limit_text = (_read(limit_file) or "").strip()
    usage_text = (_read(usage_file) or "").strip()
    if not limit_text or limit_text == "max" or not usage_text:
        return None
    try:
        limit, usage = int(limit_text), int(usage_text)
    except ValueError:
        return None
    return None if limit >= _UNLIMITED else limit - usage


NUMPY_ADDRESS_SPACE = 128 << 20
"""Address space that importing numpy and a first block of work take, before any
figure sdpa counts."""


def check_address_space(threads: int, proc: str = "/proc", limit: int | None = None) -> None:
    """Refuse, before numpy is imported, a run whose ``ulimit -v`` leaves less address
    space than numpy, a BLAS buffer and a malloc arena per thread take: past that
    point OpenBLAS's malloc fails inside a matrix product and ends the process with
    its own message (exit 1, or a hang), which nothing in sdpa can catch.

    Raises:
        InputError: naming ``ulimit -v``.
    """
    left = _address_space_left(Path(proc), limit)
    if left is None:
        return
    left += BLAS_ADDRESS_SPACE * (os.cpu_count() or 1)  # _address_space_left took it
    need = NUMPY_ADDRESS_SPACE + BLAS_ADDRESS_SPACE * threads
    if left < need:
        raise InputError(
            "ulimit -v",
            f"leaves {max(left, 0) >> 20} MiB of address space; sdpa needs at least "
            f"{need >> 20} MiB with {threads} thread{'s' * (threads > 1)} (numpy, and a BLAS "
            "buffer and a malloc arena per thread): raise the limit, or give --jobs 1",
        )


def keep_freed_blocks() -> None:
    """Have glibc keep freed block-sized arrays for reuse. By default it hands every
    freed allocation above 128 KiB back to the system and maps the next one afresh,
    a page fault per 4 KiB of every array of every block: a third of a run's time
    (and Dask's workers start with MALLOC_TRIM_THRESHOLD_=65536: a manifest's cases
    ran 1.5× slower there)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes  # imported here: only glibc needs it, and it keeps sdpa --help fast

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: map only allocations above 32 MiB
        libc.mallopt(-1, 16 << 20)  # M_TRIM_THRESHOLD: keep up to 16 MiB of freed heap
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def release_freed_blocks() -> None:
    """Hand the freed memory glibc keeps (:func:`keep_freed_blocks`) back to the
    system, between the passes of a run: what one pass freed in its threads' arenas
    would otherwise stay in the process's RSS under the next pass's peak (a backward
    check's reference pass left about 60 MiB at (1, 8, 16384, 64))."""
    if not sys.platform.startswith("linux"):
        return
    import contextlib
    import ctypes  # imported here: only glibc needs it

    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to release
        ctypes.CDLL("libc.so.6").malloc_trim(0)
