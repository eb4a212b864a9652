"""The limits of the machine a run must fit in: the memory it may still take.

The smallest of three, each where known: Linux's ``MemAvailable``; the address space
left under ``ulimit -v`` / ``prlimit --as`` (``RLIMIT_AS`` less this process's
``VmSize``); the room left in the process's cgroup (v2 ``memory.max`` less
``memory.current``; v1 ``memory.limit_in_bytes`` less ``memory.usage_in_bytes``), as
in a container. A run that would not fit is refused up front with one line rather
than dying of MemoryError (or the OOM killer) halfway.
"""

from __future__ import annotations

import resource
from pathlib import Path

_UNLIMITED = 1 << 60
"""Above this a cgroup's limit means none (v1 writes 2**63 rounded to a page)."""


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
    return limit - used


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
