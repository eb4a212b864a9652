"""Settings from the command line, ``sdpa.yaml`` or ``[tool.sdpa]`` in pyproject.toml.

The first found wins, in this order: a flag; ``sdpa.yaml`` in the working
directory; ``[tool.sdpa]`` in ``pyproject.toml`` in the working directory; the
defaults. The top level holds the thresholds of the findings
(:class:`~sdpa_cli.diagnose.rules.Thresholds`); a ``check`` section (``[tool.sdpa.check]``)
holds the settings of ``sdpa check`` (:class:`~sdpa_cli.check.run.CheckSettings`).
Keys are spelled as the flags (``head-fraction``) or with underscores.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from sdpa_cli.diagnose.rules import KINDS, SEVERITIES, THRESHOLD_NAMES, Thresholds
from sdpa_cli.engine.spec import parse_number
from sdpa_cli.errors import InputError, SpecError
from sdpa_cli.text import printable, shown

CONFIG_FILES = ("sdpa.yaml", "pyproject.toml")


def _as_typed(value: Any) -> str:
    """A value as typed (``0.5``, not ``'0.5'``), on one short line."""
    text = printable(str(value))
    return text if len(text) <= 60 else text[:40] + "..."


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


_PARSERS: dict[str, Any] = {
    "saturation": lambda v, w: _fraction(v, w, 0.5),
    "uniform": lambda v, w: _fraction(v, w, 0.0),
    "head_fraction": lambda v, w: _fraction(v, w, 0.0),
    "max_findings": _count,
    "vanishing": lambda v, w: _fraction(v, w, 0.0),
}


ConfigFile = tuple[str | None, dict[str, Any]]
"""What :func:`read_config` found: the file's name (None for none) and its settings."""


def read_config(directory: str = ".") -> ConfigFile:
    """The settings of the first config file found, and the file's name."""

    def named(name: str) -> str:
        return name if directory == "." else os.path.join(directory, name)

    yaml_path = named("sdpa.yaml")
    if os.path.isfile(yaml_path):
        from pathlib import Path

        from sdpa_cli.files.loaders import parse_text

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


def thresholds(
    flags: Mapping[str, Any], directory: str = ".", config: ConfigFile | None = None
) -> Thresholds:
    """Flags over the config file over the defaults; errors name the flag or file."""
    source, raw = read_config(directory) if config is None else config
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name == "check":
            continue  # sdpa check's own section
        if name not in THRESHOLD_NAMES:
            raise SpecError(
                f"{source}: {printable(str(key))}",
                f"unknown setting; expected {', '.join(n.replace('_', '-') for n in THRESHOLD_NAMES)} "
                "or a check section",
            )
        values[name] = _PARSERS[name](value, f"{source}: {key}")
    for name, value in flags.items():
        if value is not None:
            values[name] = _PARSERS[name](value, "--" + name.replace("_", "-"))
    return Thresholds(**values)


# --- sdpa check -----------------------------------------------------------------------

REFERENCE_FORMATS = ("float32", "float64")
"""Formats a check's reference may be computed in."""

CHECK_NAMES = (
    "rtol",
    "atol",
    "reference",
    "tolerance",
    "fudge",
    "fail_on",
    "fail_on_severity",
    "equal_nan",
)
"""Settings of ``sdpa check`` a config file, a manifest or a flag may give."""


def _kinds(value: Any, where: str) -> tuple[str, ...]:
    """``overflow,nonfinite`` or a list; ``none`` (or empty) for no kind at all."""
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",")]
    elif isinstance(value, (list, tuple)):
        items = [str(v).strip() for v in value]
    else:
        raise SpecError(where, f"expected finding kinds, comma-separated, got {shown(value)}")
    kinds = tuple(k for k in items if k)
    if kinds in ((), ("none",)):
        return ()
    for kind in kinds:
        if kind not in KINDS:
            raise SpecError(
                where, f"unknown finding kind {shown(kind)}; choose from {', '.join(KINDS)}"
            )
    return kinds


def _flag(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    raise SpecError(where, f"expected true or false, got {shown(value)}")


def _tolerance(value: Any, where: str) -> float:
    x = parse_number(value, where)
    if not (math.isfinite(x) and x >= 0):
        raise SpecError(where, f"must be a finite number ≥ 0, got {_as_typed(value)}")
    return x


def _fudge(value: Any, where: str) -> float:
    x = parse_number(value, where)
    if not (math.isfinite(x) and x >= 1):
        raise SpecError(where, f"must be a finite number ≥ 1, got {_as_typed(value)}")
    return x


def _one_of(choices: tuple[str, ...]) -> Any:
    def parse(value: Any, where: str) -> str:
        if not isinstance(value, str) or value not in choices:
            raise SpecError(where, f"must be {' or '.join(choices)}, got {shown(value)}")
        return value

    return parse


_CHECK_PARSERS: dict[str, Any] = {
    "rtol": _tolerance,
    "atol": _tolerance,
    "reference": _one_of(REFERENCE_FORMATS),
    "tolerance": _one_of(("dtype", "measured")),
    "fudge": _fudge,
    "fail_on": _kinds,
    "fail_on_severity": _one_of(SEVERITIES),
    "equal_nan": _flag,
}


def check_values(raw: Mapping[str, Any], where: str | None = None) -> dict[str, Any]:
    """Parse ``sdpa check`` settings; keys spelled as the flags or with underscores.

    Raises:
        SpecError: an unknown key or a bad value, naming ``where`` and the key (or
            the flag, ``--rtol``, when ``where`` is None).
    """
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        label = (
            "--" + name.replace("_", "-") if where is None else f"{where}: {printable(str(key))}"
        )
        if name not in CHECK_NAMES:
            raise SpecError(
                label,
                f"unknown check setting; expected {', '.join(n.replace('_', '-') for n in CHECK_NAMES)}",
            )
        if value is not None:
            values[name] = _CHECK_PARSERS[name](value, label)
    return values


def check_config(directory: str = ".", config: ConfigFile | None = None) -> dict[str, Any]:
    """The ``check`` section of the config file (parsed), or nothing."""
    source, raw = read_config(directory) if config is None else config
    section = raw.get("check")
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise InputError(f"{source}: check", "must be a mapping of check settings")
    return check_values(section, f"{source}: check")


def merge_check_settings(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Check settings, each layer over the ones before (config, manifest, flags).

    Tolerances given one way replace those given the other: ``rtol``/``atol`` in a
    later layer drop an earlier ``tolerance: measured``, and ``measured`` drops an
    earlier ``rtol``/``atol``.
    """
    out: dict[str, Any] = {}
    for layer in layers:
        if layer.get("tolerance") == "measured":
            out.pop("rtol", None)
            out.pop("atol", None)
        if ("rtol" in layer or "atol" in layer) and out.get("tolerance") == "measured":
            out.pop("tolerance")
        out.update(layer)
    return out
