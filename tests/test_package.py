"""The package's shape: the public API, the layers' size, the map of ARCHITECTURE.md."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import sdpa_cli

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sdpa_cli"


def every_module() -> list[str]:
    return [m.name for m in pkgutil.walk_packages([str(PACKAGE)], prefix="sdpa_cli.")]


def test_public_names_are_what_the_api_promises_after_every_module_is_imported() -> None:
    """Regression: a subpackage named like a public function (``sdpa_cli.diagnose``)
    replaces the function on the package once anything imports the subpackage."""
    for name in every_module():
        if not name.endswith("__main__"):
            importlib.import_module(name)
    for name in sdpa_cli.__all__:
        value = getattr(sdpa_cli, name)
        assert not isinstance(value, type(sdpa_cli)), f"sdpa_cli.{name} is a module"
    assert callable(sdpa_cli.diagnose)
    assert callable(sdpa_cli.trace)
    assert callable(sdpa_cli.assert_attention_close)


def test_no_module_is_longer_than_one_sitting() -> None:
    """About 500 lines at most: a module a reader can hold in one sitting."""
    lines = {
        str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
        for p in PACKAGE.rglob("*.py")
    }
    long = {path: n for path, n in lines.items() if n > 500}
    assert not long, long


def test_architecture_names_every_folder() -> None:
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert folders == ["capture", "check", "cli", "diagnosis", "engine", "files", "render"]
    for folder in folders:
        assert f"`{folder}/`" in text, folder
