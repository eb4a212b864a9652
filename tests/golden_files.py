"""Golden text files: what each command's render reads like, kept under tests/golden.

``make golden`` (``SDPA_REGEN_GOLDEN=1``) rewrites them; review the diff: a change in
a golden file is a change in what users read.
"""

from __future__ import annotations

import os
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent / "golden"


def check_golden(name: str, text: str) -> None:
    """``text`` is the golden file ``name`` to the byte (rewritten under ``make golden``)."""
    path = GOLDEN / name
    if os.environ.get("SDPA_REGEN_GOLDEN"):
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"missing golden file {path}; run `make golden`"
    assert text == path.read_text(encoding="utf-8")
