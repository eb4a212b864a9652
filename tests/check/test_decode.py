"""``sdpa check --decode``: a causal prefill against the same tokens decoded step by step.

The decode steps are checked against an independent reference: the float64 loop of
``tests/reference.py`` run one query at a time over the keys a decoder has cached by
then (no mask at all: the cache is exactly what the query sees), and PyTorch's SDPA
run the same way for an exported decode run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from attention_cases import random_qkv
from clirunner import assert_one_error_line, invoke
from numpy.typing import NDArray
from reference import attention

from sdpa_cli.check.decode import decode_checks, step_spec
from sdpa_cli.check.settings import CheckSettings
from sdpa_cli.engine.options import parse_options
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.engine.trace import trace
from sdpa_cli.errors import ExitCode, SpecError

F64 = NDArray[np.float64]
B, H, L, S, E = 2, 2, 4, 9, 8
TOL = 1e-9


def qkv(seed: int = 0) -> tuple[F64, F64, F64]:
    return random_qkv(seed, B, H, L, S, E, E)


def spec_of(**raw: Any) -> AttentionSpec:
    q, k, v = qkv()
    return build_spec(q, k, v, options=parse_options({"causal": True, **raw}))


def loop_decode(offsets: tuple[int, int], window: tuple[int, int] | None = None) -> F64:
    """Query i of item b alone over the cache 0 .. N_b + i, by the float64 loop."""
    q, k, v = qkv()
    out = np.zeros((B, H, L, E))
    for b in range(B):
        for i in range(L):
            p = offsets[b] + i
            keys = slice(max(0, p - window[0]) if window else 0, p + 1)
            got = attention(q[b, :, i : i + 1], k[b, :, keys], v[b, :, keys])
            out[b, :, i] = got.output[:, 0]
    return out


def prefill(spec: AttentionSpec) -> F64:
    out = trace(spec, stages=("output",)).output
    assert out is not None
    return out


@pytest.mark.parametrize(
    ("raw", "offsets", "window"),
    [
        ({"causal_align": "lower-right"}, (S - L, S - L), None),
        ({"query_offset": "5,2"}, (5, 2), None),
        ({"causal_align": "lower-right", "window": "2,0"}, (S - L, S - L), (2, 0)),
    ],
)
def test_steps_equal_the_loop_decode_and_the_prefill(
    raw: dict[str, Any], offsets: tuple[int, int], window: tuple[int, int] | None
) -> None:
    spec = spec_of(**raw)
    steps = np.concatenate([prefill(step_spec(spec, i)) for i in range(L)], axis=-2)
    want = loop_decode(offsets, window)
    np.testing.assert_allclose(steps, want, atol=TOL)
    np.testing.assert_allclose(prefill(spec), want, atol=TOL)
    [check] = decode_checks(spec, CheckSettings())
    assert check.status == "pass"
    assert check.mismatch is not None
    assert check.mismatch.max_abs < 1e-13


def test_step_keeps_only_the_cache_so_far() -> None:
    step = step_spec(spec_of(query_offset="5,2", key_lengths="9,6"), 1)
    assert (step.L, step.S) == (1, 7)  # keys 0 .. 6 for item 0 (position 6)
    assert step.options.query_offset == (6, 3)
    assert step.options.key_lengths == (7, 6)
    assert step.options.causal_align == "upper-left"


def test_upper_left_prefill_with_l_ne_s_is_not_its_decode() -> None:
    spec = spec_of()
    [check] = decode_checks(spec, CheckSettings())
    assert check.status == "fail"
    assert check.hint is not None
    assert "--causal-align lower-right" in check.hint
    want = np.abs(loop_decode((S - L, S - L)) - prefill(spec)).max()
    assert check.mismatch is not None
    assert check.mismatch.max_abs == pytest.approx(want, rel=1e-12)
    assert want > 0.1


def test_emulated_format_is_judged_at_its_default_tolerance() -> None:
    spec = spec_of(causal_align="lower-right", dtype="bfloat16")
    [check] = decode_checks(spec, CheckSettings())
    assert check.status == "pass"
    assert check.tolerance is not None
    assert check.tolerance.source == "bfloat16 defaults"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"causal": False}, "--decode: compares a causal prefill with its decode steps"),
        ({"mask_mod": "kv_idx <= q_idx"}, "--decode: is not supported with --mask-mod"),
        ({"dropout": "0.1"}, "--decode: is not supported with --dropout"),
    ],
)
def test_refused(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        decode_checks(spec_of(**raw), CheckSettings())


# --- the command ----------------------------------------------------------------------


def _files(tmp_path: Path) -> list[str]:
    names = []
    for name, a in zip("qkv", qkv(), strict=True):
        np.save(tmp_path / f"{name}.npy", a)
        names.append(str(tmp_path / f"{name}.npy"))
    return names


def test_cli_passes_fails_and_refuses(tmp_path: Path) -> None:
    files = _files(tmp_path)
    ok = invoke("check", *files, "--causal", "--causal-align", "lower-right", "--decode")
    assert ok.exit_code == ExitCode.OK, ok.output
    assert "decode.output.close" in ok.stdout
    bad = invoke("check", *files, "--causal", "--decode", "--format", "json")
    assert bad.exit_code == ExitCode.CHECK_FAILED
    (case,) = json.loads(bad.stdout)["cases"]
    [decode] = [c for c in case["checks"] if c["name"] == "decode.output.close"]
    assert decode["passed"] is False
    assert "lower-right" in decode["hint"]
    line = assert_one_error_line(invoke("check", *files, "--decode"))
    assert line.startswith("sdpa: error: --decode: compares a causal prefill")


def test_cli_judges_an_exported_decode_run_against_the_prefill(tmp_path: Path) -> None:
    """PyTorch's SDPA, one query at a time over the cache: a decode run's export."""
    torch = pytest.importorskip("torch")
    files = _files(tmp_path)
    q, k, v = (torch.from_numpy(a) for a in qkv())
    steps = [
        torch.nn.functional.scaled_dot_product_attention(
            q[:, :, i : i + 1], k[:, :, : S - L + i + 1], v[:, :, : S - L + i + 1]
        )
        for i in range(L)
    ]
    np.save(tmp_path / "decoded.npy", torch.cat(steps, dim=2).numpy())
    args = [*files, "--causal", "--decode", "--expect-output", str(tmp_path / "decoded.npy")]
    ok = invoke("check", *args, "--causal-align", "lower-right")
    assert ok.exit_code == ExitCode.OK, ok.output
    bad = invoke("check", *args)
    assert bad.exit_code == ExitCode.CHECK_FAILED
    assert "output.close" in bad.stdout
    assert "decode.output.close" in bad.stdout
