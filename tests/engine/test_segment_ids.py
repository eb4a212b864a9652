"""Segment ids (``--segment-ids``, ``--segment-ids-kv``), as JAX's and the TPU kernels
take them: a query sees only the keys of its own id, beside causal, window and masks.

The installed ``jax.nn.dot_product_attention`` takes no segment ids, so the reference is
JAX's own rule, ``q_ids[:, None] == kv_ids[None, :]``, built by hand into a boolean mask
for the float64 loop of ``tests/reference.py`` and PyTorch's SDPA; and the lean pass
against the per-stage path. At 1e-9 in float64.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from clirunner import assert_one_error_line, invoke
from numpy.typing import NDArray
from reference import attention

from sdpa_cli.engine.block import common_keys
from sdpa_cli.engine.inputs import load_spec
from sdpa_cli.engine.online import applies
from sdpa_cli.engine.options import Options
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.engine.trace import trace
from sdpa_cli.errors import SpecError

F64 = NDArray[np.float64]
B, H, L, E = 2, 2, 9, 4
TOL = 1e-9
IDS = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2], [7, 7, 3, 3, 3, 3, 3, 9, 9]])
KV_IDS = np.array([[0, 1, 1, 2, 2, 2], [8, 8, 3, 4, 9, 9]])  # S = 6: rows of id 7 see no key

CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (2, 1)},
    "causal-lower-right": {"causal": True, "causal_align": "lower-right"},
}


def inputs(S: int = L, seed: int = 0) -> tuple[F64, F64, F64]:
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(B, H, L, E)),
        rng.normal(size=(B, H, S, E)),
        rng.normal(size=(B, H, S, E)),
    )


def same(ids_q: NDArray[Any], ids_kv: NDArray[Any]) -> NDArray[np.bool_]:
    """JAX's segment mask, (B, 1, L, S)."""
    m: NDArray[np.bool_] = ids_q[..., :, None] == ids_kv[..., None, :]
    return m.reshape(-1, 1, m.shape[-2], m.shape[-1])


def spec_of(opts: dict[str, Any], kv: bool = False, **ids: Any) -> AttentionSpec:
    S = KV_IDS.shape[-1] if kv else L
    return build_spec(
        *inputs(S),
        options=Options(**opts),
        segment_ids=ids.get("q", IDS),
        segment_ids_kv=KV_IDS if kv else None,
    )


def output(
    spec: AttentionSpec, stages: tuple[str, ...] = ("output",), rows: int | None = None
) -> F64:
    out = trace(spec, stages=stages, rows=rows).output
    assert out is not None
    return out


@pytest.mark.parametrize("kv", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_the_float64_loop_with_jax_segment_mask_agrees(name: str, kv: bool) -> None:
    opts = CASES[name]
    spec = spec_of(opts, kv)
    mask = same(IDS, KV_IDS if kv else IDS)
    ref = attention(*inputs(spec.S), mask=mask, **opts).output
    np.testing.assert_allclose(output(spec), ref, rtol=0, atol=TOL)


@pytest.mark.parametrize("name", list(CASES))
def test_torch_sdpa_with_the_segment_mask_agrees(name: str) -> None:
    torch = pytest.importorskip("torch")
    opts = CASES[name]
    ok = same(IDS, IDS) & np.ones((L, L), dtype=np.bool_)
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    if opts.get("causal"):
        ok = ok & (j <= i)
    if "window" in opts:
        left, right = opts["window"]
        ok = ok & (j - i >= -left) & (j - i <= right)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in inputs()), attn_mask=torch.from_numpy(ok)
    ).numpy()
    np.testing.assert_allclose(output(spec_of(opts)), ref, rtol=0, atol=TOL)


def test_one_row_of_ids_serves_every_batch_item() -> None:
    spec = spec_of({"causal": True}, q=IDS[1])
    ref = attention(*inputs(), mask=same(IDS[1], IDS[1])[0], causal=True).output
    np.testing.assert_allclose(output(spec), ref, rtol=0, atol=TOL)


@pytest.mark.parametrize("kv", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_the_lean_pass_equals_the_per_stage_path(kv: bool, rows: int) -> None:
    spec = spec_of({"causal": True}, kv)
    assert applies(spec)
    staged = output(spec, ("weights", "output"))
    np.testing.assert_allclose(output(spec, rows=rows), staged, rtol=0, atol=TOL)


def test_no_key_is_common_to_every_row_under_segment_ids() -> None:
    spec = spec_of({})
    assert common_keys(spec, (0, 0), slice(0, 2)) == slice(0, 0)


@pytest.mark.parametrize(
    ("ids", "kv", "message"),
    [
        (
            np.zeros(L - 1, dtype=np.int64),
            None,
            "--segment-ids: shape (8,), expected (L,) = (9,) or (B, L) = (2, 9)",
        ),
        (
            np.zeros((3, L), dtype=np.int64),
            None,
            "--segment-ids: shape (3, 9), expected (L,) = (9,) or (B, L) = (2, 9)",
        ),
        (np.zeros(L), None, "--segment-ids: holds float64 values; segment ids are integers"),
        (
            None,
            np.zeros(L, dtype=np.int64),
            "--segment-ids-kv: needs --segment-ids (the queries' segments)",
        ),
        (
            IDS,
            np.zeros(4, dtype=np.int64),
            "--segment-ids-kv: shape (4,), expected (S,) = (9,) or (B, S) = (2, 9)",
        ),
    ],
)
def test_bad_segment_ids_are_one_line_naming_the_flag(
    ids: NDArray[Any] | None, kv: NDArray[Any] | None, message: str
) -> None:
    with pytest.raises(SpecError) as err:
        build_spec(*inputs(), segment_ids=ids, segment_ids_kv=kv)
    assert str(err.value) == message


def test_query_ids_serve_the_keys_only_when_l_equals_s() -> None:
    with pytest.raises(
        SpecError, match="serves the keys too without --segment-ids-kv, but L = 9, S = 6"
    ):
        build_spec(*inputs(6), segment_ids=IDS)


def test_the_cli_reads_segment_ids_and_refuses_bad_ones(tmp_path: Path) -> None:
    paths = []
    for name, a in zip("qkv", inputs(), strict=True):
        np.save(tmp_path / f"{name}.npy", a)
        paths.append(str(tmp_path / f"{name}.npy"))
    np.save(tmp_path / "ids.npy", IDS)
    np.save(tmp_path / "out.npy", attention(*inputs(), mask=same(IDS, IDS)).output)
    ok = invoke(
        "check",
        *paths,
        "--segment-ids",
        str(tmp_path / "ids.npy"),
        "--expect-output",
        str(tmp_path / "out.npy"),
    )
    assert ok.exit_code == 0, ok.output
    np.save(tmp_path / "short.npy", IDS[:, :4])
    line = assert_one_error_line(
        invoke("compute", *paths, "--segment-ids", str(tmp_path / "short.npy"))
    )
    assert (
        line == "sdpa: error: --segment-ids: shape (2, 4), expected (L,) = (9,) or (B, L) = (2, 9)"
    )


def test_a_case_file_holds_segment_ids(tmp_path: Path) -> None:
    q = [[1, 0], [2, 0], [3, 0]]
    case = tmp_path / "case.json"
    case.write_text(
        json.dumps({"q": q, "k": q, "v": q, "causal": True, "segment_ids": [0, 0, 1]}),
        encoding="utf-8",
    )
    spec, _ = load_spec((str(case),))
    assert spec.segment_ids is not None
    weights = trace(spec, stages=("weights",)).weights
    assert weights is not None
    np.testing.assert_array_equal(weights[2], [0.0, 0.0, 1.0])
