"""A manifest's cases name every tensor a case file may hold: segment ids (``segment-ids``,
``segment-ids-kv``) and a dropout mask (``dropout-mask``) are read as their flags would
be, relative to the manifest."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from clirunner import invoke, strict_json

from sdpa_cli.api.manifest import load_manifest

SAMPLES = Path(__file__).resolve().parents[2] / "samples"


def _softmax_rows(q: np.ndarray, k: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """Weights of a (L, S) score matrix, hidden keys excluded, in float64."""
    s = np.where(visible, q @ k.T / np.sqrt(q.shape[-1]), -np.inf)
    e = np.exp(s - s.max(axis=1, keepdims=True))
    weights: np.ndarray = e / e.sum(axis=1, keepdims=True)
    return weights


def _segments_case(tmp_path: Path, *, with_segments: bool) -> Path:
    """The textbook causal example, Q = K = V = [[1,0],[2,0],[3,0]], with its third token
    in a document of its own, and the export a kernel honouring that would give."""
    x = np.array([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]])
    ids = np.array([0, 0, 1])
    visible = np.tril(np.ones((3, 3), dtype=bool)) & (ids[:, None] == ids[None, :])
    np.save(tmp_path / "out.npy", _softmax_rows(x, x, visible) @ x)
    (tmp_path / "segments.json").write_text(json.dumps(ids.tolist()))
    (tmp_path / "causal.yaml").write_text((SAMPLES / "causal.yaml").read_text())
    lines = ["cases:", "  - name: documents", "    case: causal.yaml", "    causal: true"]
    lines.append("    expect-output: out.npy")
    if with_segments:
        lines.append("    segment-ids: segments.json")
    (tmp_path / "m.yaml").write_text("\n".join(lines) + "\n")
    return tmp_path / "m.yaml"


def test_a_cases_segment_ids_are_read_relative_to_the_manifest(tmp_path: Path) -> None:
    manifest = _segments_case(tmp_path, with_segments=True)
    (case,) = load_manifest(str(manifest))
    assert case.tensors == {"segment_ids": str(tmp_path / "segments.json")}
    result = invoke("check", "--manifest", str(manifest), "--format", "json")
    assert result.exit_code == 0, result.output
    (row,) = strict_json(result.stdout)["cases"]
    assert row["passed"]
    assert row["error"] is None


def test_without_the_segment_ids_the_same_export_fails(tmp_path: Path) -> None:
    """The third query sees the earlier keys again: 2.869 where the export says 3."""
    manifest = _segments_case(tmp_path, with_segments=False)
    result = invoke("check", "--manifest", str(manifest))
    assert result.exit_code == 1, result.output
    assert "documents   FAIL" in result.stdout


def test_a_dropout_mask_without_dropout_is_that_cases_error(tmp_path: Path) -> None:
    (tmp_path / "causal.yaml").write_text((SAMPLES / "causal.yaml").read_text())
    np.save(tmp_path / "keep.npy", np.ones((3, 3), dtype=bool))
    (tmp_path / "m.yaml").write_text(
        "cases:\n  - name: dropped\n    case: causal.yaml\n    dropout-mask: keep.npy\n"
    )
    result = invoke("check", "--manifest", str(tmp_path / "m.yaml"), "--format", "json")
    assert result.exit_code == 2, result.output
    (row,) = strict_json(result.stdout)["cases"]
    assert "--dropout-mask" in row["error"]
    assert "dropout" in row["error"]
