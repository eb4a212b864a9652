"""Merged partials (``--expect-partials``): each key shard against the reference over its
keys alone, and their merge against the whole attention; checked on real values from a
float64 loop per key range."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from attention_cases import causal_over_keys
from clirunner import assert_one_error_line, invoke

from sdpa_cli.check.partials import merge_partials
from sdpa_cli.errors import ExitCode

RANGES = ((0, 5), (5, 12), (12, 16))


def _inputs(tmp_path: Path) -> tuple[str, ...]:
    rng = np.random.default_rng(19)
    names = []
    for n in "qkv":
        np.save(tmp_path / f"{n}.npy", rng.standard_normal((2, 3, 16, 4)))
        names.append(str(tmp_path / f"{n}.npy"))
    return tuple(names)


def _loop(tmp_path: Path, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Causal attention over keys start:stop alone, a float64 loop per row."""
    q, k, v = (np.load(tmp_path / f"{n}.npy") for n in "qkv")
    return causal_over_keys(q, k, v, start, stop)


def _write(
    tmp_path: Path, ranges: tuple[tuple[int, int], ...], wrong_lse: int | None = None
) -> str:
    entries = []
    for n, (start, stop) in enumerate(ranges):
        out, lse = _loop(tmp_path, start, stop)
        if n == wrong_lse:
            lse = lse + 0.5
        np.save(tmp_path / f"out{n}.npy", out)
        np.save(tmp_path / f"lse{n}.npy", lse)
        entries.append({"keys": f"{start}:{stop}", "output": f"out{n}.npy", "lse": f"lse{n}.npy"})
    path = tmp_path / "partials.json"
    path.write_text(json.dumps(entries))
    return str(path)


def _verdicts(tmp_path: Path, partials: str) -> tuple[int, dict[str, bool]]:
    result = invoke(
        "check", *_inputs(tmp_path), "--causal", "--expect-partials", partials, "--format", "json"
    )
    checks = json.loads(result.output)["cases"][0]["checks"]
    return result.exit_code, {c["name"]: c["passed"] for c in checks}


def test_partials_from_a_float64_loop_pass(tmp_path: Path) -> None:
    _inputs(tmp_path)
    code, verdicts = _verdicts(tmp_path, _write(tmp_path, RANGES))
    assert code == ExitCode.OK
    names = [f"partial[{a}:{b}].{t}.close" for a, b in RANGES for t in ("output", "lse")]
    for name in [*names, "merged.output.close", "merged.lse.close"]:
        assert verdicts[name], name


def test_a_wrong_lse_fails_its_partial_and_the_merge(tmp_path: Path) -> None:
    _inputs(tmp_path)
    code, verdicts = _verdicts(tmp_path, _write(tmp_path, RANGES, wrong_lse=1))
    assert code == ExitCode.CHECK_FAILED
    assert not verdicts["partial[5:12].lse.close"]
    assert verdicts["partial[5:12].output.close"]
    assert verdicts["partial[0:5].lse.close"]
    assert not verdicts["merged.output.close"]
    assert not verdicts["merged.lse.close"]


def test_merge_weights_by_lse_not_by_averaging(tmp_path: Path) -> None:
    _inputs(tmp_path)
    parts = [_loop(tmp_path, a, b) for a, b in RANGES]
    whole_out, whole_lse = _loop(tmp_path, 0, 16)
    out, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    np.testing.assert_allclose(out, whole_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, whole_lse, rtol=1e-12)
    # A merge that averages the shards' outputs (over those with a visible key) is wrong.
    seen = np.stack([np.isfinite(p[1]) for p in parts])[..., None]
    averaged = np.stack([p[0] for p in parts]).sum(axis=0) / seen.sum(axis=0)
    assert not np.allclose(averaged, whole_out, rtol=1e-3, atol=1e-3)


def test_a_wrongly_merged_export_fails_merged_output(tmp_path: Path) -> None:
    """An exporter that averaged its shards and then exported the "merged" result as a
    single partial over all keys fails that partial and the merge."""
    _inputs(tmp_path)
    parts = [_loop(tmp_path, a, b) for a, b in RANGES]
    seen = np.stack([np.isfinite(p[1]) for p in parts])[..., None]
    np.save(tmp_path / "avg.npy", np.stack([p[0] for p in parts]).sum(axis=0) / seen.sum(axis=0))
    np.save(tmp_path / "lse.npy", _loop(tmp_path, 0, 16)[1])
    path = tmp_path / "p.yaml"
    path.write_text("- {keys: '0:16', output: avg.npy, lse: lse.npy}\n")
    code, verdicts = _verdicts(tmp_path, str(path))
    assert code == ExitCode.CHECK_FAILED
    assert not verdicts["partial[0:16].output.close"]
    assert not verdicts["merged.output.close"]
    assert verdicts["merged.lse.close"]


def test_a_shard_with_no_visible_key_contributes_nothing() -> None:
    out = [np.ones((1, 2, 3)), np.full((1, 2, 3), np.nan)]
    lse = [np.zeros((1, 2)), np.full((1, 2), -np.inf)]
    merged, merged_lse = merge_partials(out, lse)
    np.testing.assert_array_equal(merged, 1.0)
    np.testing.assert_array_equal(merged_lse, 0.0)


@pytest.mark.parametrize(
    ("ranges", "message"),
    [
        (((0, 8), (6, 16)), "overlap"),
        (((0, 8), (9, 16)), "gap"),
        (((0, 8), (8, 12)), "not at S = 16"),
    ],
)
def test_ranges_that_do_not_tile_are_refused(
    tmp_path: Path, ranges: tuple[tuple[int, int], ...], message: str
) -> None:
    inputs = _inputs(tmp_path)
    partials = _write(tmp_path, ranges)
    result = invoke("check", *inputs, "--causal", "--expect-partials", partials)
    assert message in assert_one_error_line(result, ExitCode.BAD_INPUT)
