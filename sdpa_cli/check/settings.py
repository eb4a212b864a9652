"""The settings of ``sdpa check``: :class:`CheckSettings`, and their parsing from flags,
a manifest, or the ``check`` section of the config file (``[tool.sdpa.check]``).

Keys are spelled as the flags (``fail-on``) or with underscores. One set of rules
checks every source: a bad value names the flag, or the file and the key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sdpa_cli.diagnosis.findings import Thresholds
from sdpa_cli.diagnosis.thresholds import thresholds as read_thresholds
from sdpa_cli.engine.arrays import NUMPY, Backend, current
from sdpa_cli.engine.options import parse_bool, parse_number
from sdpa_cli.errors import InputError, SpecError
from sdpa_cli.files.config import ConfigFile, read_config
from sdpa_cli.files.confine import outside_allowed
from sdpa_cli.names import (
    ERROR_STATS,
    KINDS,
    REFERENCE_FORMATS,
    SEVERITIES,
    TOLERANCE_RULES,
    format_name,
)
from sdpa_cli.text import as_typed, printable, shown

CHECK_NAMES = (
    "rtol",
    "atol",
    "reference",
    "tolerance",
    "fudge",
    "fail_on",
    "fail_on_severity",
    "equal_nan",
    "max_error",
)
"""Settings of ``sdpa check`` a config file, a manifest or a flag may give."""

DEFAULT_GATE = ("nonfinite", "overflow")
"""Finding kinds that fail a check with no expectation: non-finite values, and
overflow in the run's own formats (the inputs' dtype or ``--dtype``)."""


# --- parsing ----------------------------------------------------------------------------


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


def _tolerance(value: Any, where: str) -> float:
    x = parse_number(value, where)
    if not (math.isfinite(x) and x >= 0):
        raise SpecError(where, f"must be a finite number ≥ 0, got {as_typed(value)}")
    return x


def _fudge(value: Any, where: str) -> float:
    x = parse_number(value, where)
    if not (math.isfinite(x) and x >= 1):
        raise SpecError(where, f"must be a finite number ≥ 1, got {as_typed(value)}")
    return x


def _error_limits(value: Any, where: str) -> tuple[tuple[str, float], ...]:
    """``abs_p99=1e-3,cosine_min=0.999``, a list of such, or a mapping: limits on the
    error statistics (:data:`~sdpa_cli.names.ERROR_STATS`)."""
    if isinstance(value, Mapping):
        items = [(str(k), v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)) and all(
        isinstance(x, (list, tuple)) and len(x) == 2 for x in value
    ):  # already parsed: (stat, value) pairs
        items = [(str(k), v) for k, v in value]
    else:
        texts = value.split(",") if isinstance(value, str) else value
        if not isinstance(texts, (list, tuple)):
            raise SpecError(where, f"expected STAT=VALUE pairs, got {shown(value)}")
        items = []
        for text in texts:
            stat, eq, number = str(text).strip().partition("=")
            if not eq:
                raise SpecError(where, f"expected STAT=VALUE, got {shown(text)}")
            items.append((stat.strip(), number.strip()))
    limits = []
    for stat, number in items:
        if stat not in ERROR_STATS:
            raise SpecError(
                where,
                f"unknown error statistic {shown(stat)}; choose from {', '.join(ERROR_STATS)}",
            )
        limits.append((stat, _tolerance(number, f"{where} {stat}")))
    return tuple(limits)


def _one_of(choices: tuple[str, ...]) -> Any:
    def parse(value: Any, where: str) -> str:
        if not isinstance(value, str) or value not in choices:
            raise SpecError(where, f"must be {' or '.join(choices)}, got {shown(value)}")
        return value

    return parse


def _reference(value: Any, where: str) -> str:
    """float32 or float64, by name or alias (``fp32``, ``double``: names.FORMAT_ALIASES)."""
    name = format_name(value)
    if name not in REFERENCE_FORMATS:
        raise SpecError(where, f"must be {' or '.join(REFERENCE_FORMATS)}, got {shown(value)}")
    return name


_CHECK_PARSERS: dict[str, Any] = {
    "rtol": _tolerance,
    "atol": _tolerance,
    "reference": _reference,
    "tolerance": _one_of(TOLERANCE_RULES),
    "fudge": _fudge,
    "fail_on": _kinds,
    "fail_on_severity": _one_of(SEVERITIES),
    "equal_nan": parse_bool,
    "max_error": _error_limits,
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


# --- the settings of one run ------------------------------------------------------------


@dataclass(frozen=True)
class CheckSettings:
    """How to judge an export. ``None`` means the default described on each field."""

    rtol: float | None = None
    """Relative tolerance; with ``atol`` (both or neither). Default: by the export's format."""
    atol: float | None = None
    reference: str | None = None
    """Format of the reference: float32 for 16- and 8-bit exports, float64 otherwise."""
    tolerance: str = "kernel"
    """``kernel``: element by element no worse than the plain computation in the
    export's format times ``fudge`` (:mod:`sdpa_cli.check.relative`); ``dtype``: the
    fixed defaults of :data:`~sdpa_cli.check.compare.DTYPE_TOLERANCES`; ``measured``:
    PyTorch's ``get_tolerances`` (one rtol and atol from the plain computation's
    largest errors, times ``fudge``)."""
    fudge: float | None = None
    """The factor on the plain computation's error (default 2, 4 for a float32 export;
    2 for ``measured``)."""
    fail_on: tuple[str, ...] | None = None
    """Finding kinds that fail the run; default :data:`DEFAULT_GATE` without
    expectations, none with them."""
    fail_on_severity: str | None = None
    """Fail on any finding at or above this severity."""
    equal_nan: bool = False
    """Whether NaN in both the export and the reference counts as a match."""
    max_error: tuple[tuple[str, float], ...] = ()
    """Limits on the error statistics, each export's ``NAME.error`` check (none: no
    such check)."""

    def __post_init__(self) -> None:
        if (self.rtol is None) != (self.atol is None):
            raise SpecError(
                "--rtol/--atol", "give both rtol and atol, or neither (defaults by the dtype)"
            )
        # Each value as the config file and the flags are checked (one set of rules),
        # and the reference by its format's name (fp32 → float32).
        parsed = check_values({name: getattr(self, name) for name in CHECK_NAMES})
        object.__setattr__(self, "reference", parsed.get("reference"))
        if self.tolerance == "measured" and self.rtol is not None:
            raise SpecError("--tolerance", "measured computes rtol and atol; drop --rtol/--atol")


@dataclass(frozen=True)
class Overrides:
    """What the command line adds to every case: the config file's check settings
    (under the case's), flags (over them) and the findings' thresholds."""

    config: Mapping[str, Any] = field(default_factory=dict)
    check_flags: Mapping[str, Any] = field(default_factory=dict)
    option_flags: Mapping[str, Any] = field(default_factory=dict)
    """Options of the computation given as flags (those not given left out)."""
    thresholds: Thresholds = field(default_factory=Thresholds)
    allow_outside: bool = False
    """Whether a manifest's files may name files outside their folder (``--allow-outside``):
    carried to the workers, which read the case files."""
    backend: Backend = NUMPY
    """What computes each case (``--backend``, ``--device``): carried to the workers."""
    evidence: bool = False
    """Whether a case's report keeps the arrays a page draws of its failed checks
    (:class:`~sdpa_cli.check.records.Evidence`, ``check --html``)."""
    grid_share: int = 0
    """With ``check --manifest --html``: the cases whose heads' patterns share a page
    (each case's report then holds its row of the grid, ``CheckReport.heads``); 0: none."""

    @classmethod
    def given(
        cls,
        thresholds: Mapping[str, str | None] | None = None,
        check: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> Overrides:
        """What the command line gives every case, as typed: the findings'
        ``thresholds`` (name → text), the ``check`` settings (as the flags spell
        them), the ``options`` of the computation (None: not given). The config file
        is read once, for the thresholds and the check settings.

        Raises:
            SpecError: a bad value, naming its flag or the config file's key.
        """
        config_file = read_config()
        return cls(
            config=check_config(config=config_file),
            check_flags=check_values(check or {}),
            option_flags={k: v for k, v in (options or {}).items() if v is not None},
            thresholds=read_thresholds(thresholds or {}, config=config_file),
            allow_outside=outside_allowed(),
            backend=current(),
        )

    def settings(self, case: Mapping[str, Any] | None = None) -> CheckSettings:
        """A case's settings: the config file's, the case's (a manifest's), the flags'.

        Raises:
            SpecError: settings that do not fit together.
        """
        return CheckSettings(**merge_check_settings(self.config, case or {}, self.check_flags))
