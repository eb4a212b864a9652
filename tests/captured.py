"""Captured models, as their tests build and judge them: the sizes of a tiny randomly
initialised Hugging Face model, and a capture's folder judged as a user judges it
(`sdpa check --manifest` with its default settings), forward and backward."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clirunner import invoke

SIZES: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    # Q and K entries of order 1: the default 0.02 gives near-uniform weights, which hide
    # most bugs.
    "initializer_range": 0.1,
}
"""A tiny model's config: two layers, grouped-query heads."""


def check(folder: Path) -> tuple[int, dict[str, Any]]:
    """`sdpa check --manifest` with its default settings: exit code and JSON report."""
    manifest = str(folder / "manifest.yaml")
    result = invoke("check", "--manifest", manifest, "--jobs", "1", "--format", "json")
    assert result.exit_code in (0, 1), result.output
    report: dict[str, Any] = json.loads(result.stdout)
    return result.exit_code, report


def failures(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Every failed check of the report: (case, check, summary)."""
    return [
        (case["name"], c["name"], c["summary"])
        for case in report["cases"]
        for c in case["checks"] or []
        if not c["passed"]
    ]
