"""The config file: ``sdpa.yaml``, or ``[tool.sdpa]`` in pyproject.toml, found and read.

``--config FILE`` names the file (:func:`use_config`); a pyproject.toml named so must
hold ``[tool.sdpa]``. Otherwise the file is discovered as ruff and pytest discover
theirs: from the working directory upward, in each directory ``sdpa.yaml`` first,
then a ``pyproject.toml`` holding ``[tool.sdpa]`` (one without it is passed over); the
search stops after the repository's root (a directory holding ``.git``), the home
directory or the file-system root. None found: the defaults. Flags override what it
says. Its top level holds the thresholds of the findings
(:mod:`sdpa_cli.diagnosis.thresholds`); a ``check`` section (``[tool.sdpa.check]``)
holds the settings of ``sdpa check`` (:mod:`sdpa_cli.check.settings`). This module
only reads the file: each layer parses its own settings. Every problem with the file
(not UTF-8, invalid or too deeply nested TOML or YAML, ``tool`` not a table) is an
:class:`~sdpa_cli.errors.InputError` naming it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sdpa_cli.errors import InputError
from sdpa_cli.files.checks import working_directory
from sdpa_cli.files.opening import open_input
from sdpa_cli.files.structured import parse_text
from sdpa_cli.text import one_line, printable

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef,import-not-found,unused-ignore]

ConfigFile = tuple[str | None, dict[str, Any]]
"""What :func:`read_config` found: the file's name (None for none) and its settings."""
MAX_CONFIG_BYTES = 16 << 20
"""A pyproject.toml larger than this is not a config file."""

_explicit: list[str | None] = [None]
"""The file ``--config`` named for this command, if any."""


def use_config(path: str | None) -> None:
    """Read ``path`` (``--config FILE``) as the config file from now on; None: discover it."""
    _explicit[0] = path


def read_config(directory: str = ".") -> ConfigFile:
    """The settings of the config file (``--config``'s, or the first found upward from
    ``directory``), and the file's name.

    Raises:
        InputError: naming the file: unreadable, invalid, not a mapping, or (named by
            ``--config``) a pyproject.toml without ``[tool.sdpa]``.
    """
    if _explicit[0] is not None:
        return _read_named(_explicit[0])
    if not os.path.isabs(directory) and working_directory() is None:
        return None, {}  # the working directory was deleted: no folder to search up from
    start = Path(directory).absolute()
    home = Path.home().absolute() if "HOME" in os.environ else None
    for folder in (start, *start.parents):
        for name in ("sdpa.yaml", "pyproject.toml"):
            path = folder / name
            if not path.exists() or path.is_dir():  # a device or FIFO is read, and refused
                continue
            label = printable(name if folder == start and directory == "." else str(path))
            if folder != start and directory == ".":
                label = printable(os.path.relpath(path))
            found = _read_yaml(path, label) if name == "sdpa.yaml" else _read_toml(path, label)
            if found is not None:
                return found
        if (folder / ".git").exists() or folder == home:
            break
    return None, {}


def _read_named(text: str) -> ConfigFile:
    """The file ``--config`` names: YAML (``sdpa.yaml``) or TOML (``[tool.sdpa]``)."""
    path = Path(text).expanduser()
    label = printable(text)
    if path.suffix.lower() == ".toml":
        found = _read_toml(path, label)
        if found is None:
            raise InputError(label, "has no [tool.sdpa] table")
        return found
    return _read_yaml(path, label)


def _read_yaml(path: Path, label: str) -> ConfigFile:
    data = parse_text(path, "yaml", label)
    if data is None:
        return label, {}
    if not isinstance(data, dict):
        raise InputError(label, "expected a mapping of threshold names to values")
    return label, data


def _read_toml(path: Path, label: str) -> ConfigFile | None:
    """``[tool.sdpa]`` of a pyproject.toml, or None when it has none."""
    with open_input(path, label) as inp:
        raw = inp.read_all(
            MAX_CONFIG_BYTES, f"; a config file holds at most {MAX_CONFIG_BYTES} bytes"
        )
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise InputError(label, "is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(label, f"not valid TOML: {one_line(exc)}") from None
    except RecursionError:
        raise InputError(label, "is nested too deeply") from None
    tool = doc.get("tool", {})
    if not isinstance(tool, dict):
        raise InputError(label, f"[tool] must be a table, got {type(tool).__name__}")
    section = tool.get("sdpa")
    if section is None:
        return None
    if not isinstance(section, dict):
        raise InputError(label, "[tool.sdpa] must be a table")
    return f"{label} [tool.sdpa]", section
