"""The thresholds of the findings, from flags over the config file over the defaults.

The top level of ``sdpa.yaml`` (or ``[tool.sdpa]`` in pyproject.toml) holds them,
keys spelled as the flags (``head-fraction``) or with underscores; its ``check``
section belongs to ``sdpa check`` (:mod:`sdpa_cli.check.settings`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from sdpa_cli.diagnosis.findings import THRESHOLD_NAMES, Thresholds
from sdpa_cli.engine.options import parse_number
from sdpa_cli.errors import SpecError
from sdpa_cli.files.config import ConfigFile, read_config
from sdpa_cli.text import printable, shown


def _fraction(value: Any, where: str, low: float) -> float:
    x = parse_number(value, where)
    if not (math.isfinite(x) and low < x <= 1):
        raise SpecError(where, f"must be in ({low:g}, 1], got {shown(value)}")
    return x


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SpecError(where, f"expected a whole number, got {shown(value)}")
    try:
        n = int(value)
    except ValueError:
        raise SpecError(where, f"expected a whole number, got {shown(value)}") from None
    if n < 0:
        raise SpecError(where, f"must be ≥ 0, got {n}")
    return n


ENGINE_KEYS = ("check", "backend", "device")
"""The config file's top-level keys that are not thresholds: ``check``'s section, and
what computes (``backend``, ``device``: :mod:`sdpa_cli.engine.arrays`)."""

_PARSERS: dict[str, Any] = {
    "saturation": lambda v, w: _fraction(v, w, 0.5),
    "uniform": lambda v, w: _fraction(v, w, 0.0),
    "head_fraction": lambda v, w: _fraction(v, w, 0.0),
    "max_findings": _count,
    "vanishing": lambda v, w: _fraction(v, w, 0.0),
}


def thresholds(
    flags: Mapping[str, Any], directory: str = ".", config: ConfigFile | None = None
) -> Thresholds:
    """Flags over the config file over the defaults; errors name the flag or file."""
    source, raw = read_config(directory) if config is None else config
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name in ENGINE_KEYS:
            continue  # sdpa check's own section; what computes (read by the command line)
        if name not in THRESHOLD_NAMES:
            raise SpecError(
                f"{source}: {printable(str(key))}",
                f"unknown setting; expected {', '.join(n.replace('_', '-') for n in THRESHOLD_NAMES)} "
                "backend, device or a check section",
            )
        values[name] = _PARSERS[name](value, f"{source}: {key}")
    for name, value in flags.items():
        if value is not None:
            values[name] = _PARSERS[name](value, "--" + name.replace("_", "-"))
    return Thresholds(**values)
