"""Thresholds from the command line, ``sdpa.yaml`` or ``[tool.sdpa]`` in pyproject.toml.

The first found wins, in this order: a flag; ``sdpa.yaml`` in the working
directory; ``[tool.sdpa]`` in ``pyproject.toml`` in the working directory; the
defaults of :class:`~sdpa_cli.diagnose.Thresholds`. Keys are spelled as the flags
(``head-fraction``) or with underscores.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from sdpa_cli.diagnose import THRESHOLD_NAMES, Thresholds
from sdpa_cli.errors import InputError, SpecError
from sdpa_cli.spec import parse_number

CONFIG_FILES = ("sdpa.yaml", "pyproject.toml")


def _fraction(value: Any, where: str, low: float) -> float:
    x = parse_number(value, where)
    if not (math.isfinite(x) and low < x <= 1):
        raise SpecError(where, f"must be in ({low:g}, 1], got {value!r}")
    return x


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SpecError(where, f"expected a whole number, got {value!r}")
    try:
        n = int(value)
    except ValueError:
        raise SpecError(where, f"expected a whole number, got {value!r}") from None
    if n < 0:
        raise SpecError(where, f"must be ≥ 0, got {n}")
    return n


_PARSERS = {
    "saturation": lambda v, w: _fraction(v, w, 0.5),
    "uniform": lambda v, w: _fraction(v, w, 0.0),
    "head_fraction": lambda v, w: _fraction(v, w, 0.0),
    "max_findings": _count,
}


def read_config(directory: str = ".") -> tuple[str | None, dict[str, Any]]:
    """The thresholds section of the first config file found, and the file's name."""

    def named(name: str) -> str:
        return name if directory == "." else os.path.join(directory, name)

    yaml_path = named("sdpa.yaml")
    if os.path.isfile(yaml_path):
        from pathlib import Path

        from sdpa_cli.loaders import parse_text

        data = parse_text(Path(yaml_path), "yaml", yaml_path)
        if data is None:
            return yaml_path, {}
        if not isinstance(data, dict):
            raise InputError(yaml_path, "expected a mapping of threshold names to values")
        return yaml_path, data
    toml_path = named("pyproject.toml")
    if os.path.isfile(toml_path):
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib  # type: ignore[no-redef,import-not-found,unused-ignore]
        try:
            with open(toml_path, "rb") as fh:
                doc = tomllib.load(fh)
        except OSError as exc:
            raise InputError(toml_path, f"cannot read: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise InputError(toml_path, f"not valid TOML: {exc}") from None
        section = doc.get("tool", {}).get("sdpa")
        if section is None:
            return None, {}
        if not isinstance(section, dict):
            raise InputError(toml_path, "[tool.sdpa] must be a table")
        return f"{toml_path} [tool.sdpa]", section
    return None, {}


def thresholds(flags: Mapping[str, Any], directory: str = ".") -> Thresholds:
    """Flags over the config file over the defaults; errors name the flag or file."""
    source, raw = read_config(directory)
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in THRESHOLD_NAMES:
            raise SpecError(
                f"{source}: {key}",
                f"unknown setting; expected {', '.join(n.replace('_', '-') for n in THRESHOLD_NAMES)}",
            )
        values[name] = _PARSERS[name](value, f"{source}: {key}")
    for name, value in flags.items():
        if value is not None:
            values[name] = _PARSERS[name](value, "--" + name.replace("_", "-"))
    return Thresholds(**values)
