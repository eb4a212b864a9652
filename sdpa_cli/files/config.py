"""The config file: ``sdpa.yaml``, or ``[tool.sdpa]`` in pyproject.toml, found and read.

The first found wins, in this order: ``sdpa.yaml`` in the working directory;
``[tool.sdpa]`` in ``pyproject.toml`` in the working directory; none. Flags override
what it says. Its top level holds the thresholds of the findings
(:mod:`sdpa_cli.diagnosis.thresholds`); a ``check`` section (``[tool.sdpa.check]``)
holds the settings of ``sdpa check`` (:mod:`sdpa_cli.check.settings`). This module
only reads the file: each layer parses its own settings.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sdpa_cli.errors import InputError
from sdpa_cli.files.structured import parse_text

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef,import-not-found,unused-ignore]

ConfigFile = tuple[str | None, dict[str, Any]]
"""What :func:`read_config` found: the file's name (None for none) and its settings."""


def read_config(directory: str = ".") -> ConfigFile:
    """The settings of the first config file found, and the file's name."""

    def named(name: str) -> str:
        return name if directory == "." else os.path.join(directory, name)

    yaml_path = named("sdpa.yaml")
    if os.path.isfile(yaml_path):
        data = parse_text(Path(yaml_path), "yaml", yaml_path)
        if data is None:
            return yaml_path, {}
        if not isinstance(data, dict):
            raise InputError(yaml_path, "expected a mapping of threshold names to values")
        return yaml_path, data
    toml_path = named("pyproject.toml")
    if os.path.isfile(toml_path):
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
