"""The one build hook: the repository's ``samples/`` shipped in the wheel as
``sdpa_cli/samples/``, so every ``--help`` example works from an installed copy.

``samples/`` stays at the top of the repository (the README and the tests name it
there); ``build_py`` copies it into the build's package folder, which the wheel packs.
An sdist carries ``samples/`` (``MANIFEST.in``), so a wheel built from it has them
too. An editable install copies nothing: ``sdpa_cli.files.samples`` reads the
repository's ``samples/`` in place. Everything else is in ``pyproject.toml``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SAMPLES = Path(__file__).resolve().parent / "samples"
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", ".*")


class BuildPyWithSamples(build_py):
    """``build_py``, then ``samples/`` copied to ``<build>/sdpa_cli/samples/``."""

    def run(self) -> None:
        super().run()
        if self.editable_mode or not SAMPLES.is_dir():
            return
        target = Path(self.build_lib) / "sdpa_cli" / "samples"
        shutil.rmtree(target, ignore_errors=True)  # a file removed from samples/ goes too
        shutil.copytree(SAMPLES, target, ignore=SKIP)


setup(cmdclass={"build_py": BuildPyWithSamples})
