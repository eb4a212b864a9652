"""The package's shape: the public API, the layers' size, the map of ARCHITECTURE.md, and
what a distribution carries (license, py.typed, URLs, changelog, the pre-commit hook)."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path
from typing import Any

import yaml

import sdpa_cli
from sdpa_cli.cli import cli

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the dependency tomli on Python 3.10
    import tomli as tomllib

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
    assert folders == [
        "api",
        "capture",
        "check",
        "cli",
        "diagnosis",
        "engine",
        "files",
        "render",
        "schemas",
    ]
    for folder in folders:
        assert f"`{folder}/`" in text, folder


def pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as fh:
        return tomllib.load(fh)


def test_the_license_is_an_spdx_expression_with_its_file() -> None:
    """Regression: `license = { text = "MIT" }` made setuptools warn three times on install."""
    project = pyproject()["project"]
    assert project["license"] == "MIT"
    assert project["license-files"] == ["LICENSE"]
    assert "License ::" not in " ".join(project["classifiers"])  # PEP 639: not both
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("MIT License\n\nCopyright (c) 2026 the sdpa authors\n")
    # the SPDX expression and license-files need setuptools 77
    assert pyproject()["build-system"]["requires"] == ["setuptools>=77"]


def test_the_package_is_typed_and_says_where_it_lives() -> None:
    assert (PACKAGE / "py.typed").is_file()
    config = pyproject()
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["sdpa_cli"]
    urls = config["project"]["urls"]
    assert sorted(urls) == ["Changelog", "Documentation", "Homepage", "Issues", "Repository"]
    assert all(url.startswith("https://") for url in urls.values())


def test_the_docs_extra_and_dev_build_the_site_and_the_wheel() -> None:
    extras = pyproject()["project"]["optional-dependencies"]
    assert extras["docs"] == ["mkdocs>=1.6", "mkdocs-material>=9.5"]
    assert set(extras["docs"]) <= set(extras["dev"])
    assert "build>=1.2" in extras["dev"]
    assert {"plot", "dask", "torch"} <= set(extras)


def test_the_changelog_starts_with_unreleased() -> None:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert text.startswith("# Changelog\n")
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings[0] == "## [Unreleased]"


def test_the_pre_commit_hook_runs_a_command_sdpa_has() -> None:
    (hook,) = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text(encoding="utf-8"))
    assert hook["id"] == "sdpa-check"
    assert hook["language"] == "python"  # pre-commit pip-installs this repository
    program, command = hook["entry"].split()
    assert program == next(iter(pyproject()["project"]["scripts"]))
    assert command in cli.commands


def test_install_hints_name_packages_an_index_has() -> None:
    """Regression: `sdpa capture` without torch said pip install 'sdpa-cli[torch]', and
    no index has sdpa-cli: every hint names the packages themselves."""
    hints = [
        (str(p.relative_to(ROOT)), line.strip())
        for p in PACKAGE.rglob("*.py")
        for line in p.read_text(encoding="utf-8").splitlines()
        if "pip install" in line
    ]
    assert hints, "no install hint found"
    assert [(path, line) for path, line in hints if "sdpa-cli[" in line] == []
    from sdpa_cli.capture import INSTALL_TORCH

    assert INSTALL_TORCH == "pip install torch"


def test_ci_runs_the_readmes_commands_and_nothing_else() -> None:
    """Regression: CI installed torch itself before `make test`, a step the README did
    not have, so a green CI hid a fresh clone's failing `make test`."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("Contributors, on a fresh clone", 1)[1].split("```bash\n", 1)[1]
    shown = [line.split("#")[0].strip() for line in block.split("```", 1)[0].splitlines()]
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    steps = [line.strip() for line in script if line.strip() and not line.startswith("#")]
    assert steps[:2] == ["set -euo pipefail", 'cd "$(dirname "$0")/.."']
    assert steps[2:] == [line for line in shown if line]
    assert all(step.startswith("make ") for step in steps[2:])
