"""The limits of the machine a run must fit in: the memory available now."""

from __future__ import annotations


def available_memory() -> int | None:
    """Bytes of memory available now (Linux's MemAvailable), or None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
