"""FlashAttention's ``qv`` term (``--qv``): ``qv · vᵀ`` added to the scores, the
default scale 1/√(E + Ev), checked at 1e-9 in float64 against FlashAttention's
reference rules (``tests/flash_reference.py``), and DeepSeek's multi-head latent
attention computed absorbed (W_UK folded into the queries: the ``qv`` term over the
latent cache) against the naive computation (K and V expanded per head)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from clirunner import invoke
from flash_reference import attention_ref, padding
from numpy.typing import NDArray
from reference import attention

from sdpa_cli.check.records import Expected
from sdpa_cli.check.run import run_checks
from sdpa_cli.engine.options import Options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.engine.trace import trace
from sdpa_cli.errors import ExitCode, SpecError

F64 = NDArray[np.float64]
TOL = 1e-9


def output(q: F64, k: F64, v: F64, qv: F64 | None = None, **options: Any) -> F64:
    spec = build_spec(q, k, v, qv=qv, options=Options(**options))
    out = trace(spec, stages=("output",)).output
    assert out is not None
    return out


CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "causal": {"causal": True},
    "causal-window": {"causal": True, "window_size": (3, 0)},
    "chunks": {"causal": True, "attention_chunk": 4},
}


@pytest.mark.parametrize("name", CASES)
def test_the_qv_term_is_flash_attentions(name: str) -> None:
    """Q (b, t, h, d), K (b, s, h_k, d), V and qv with dv = 6, grouped-query, item 1's
    keys padded: FlashAttention's ``attention_ref(..., qv=qv)``."""
    case = CASES[name]
    rng = np.random.default_rng(11)
    B, L, S, H, G, E, EV = 2, 7, 12, 4, 2, 5, 6
    q, qv = rng.normal(size=(B, L, H, E)), rng.normal(size=(B, L, H, EV))
    k, v = rng.normal(size=(B, S, G, E)), rng.normal(size=(B, S, G, EV))
    lengths = (12, 9)
    window = case.get("window_size", (-1, -1))
    want = attention_ref(
        q,
        k,
        v,
        None,
        padding(lengths, S),
        qv=qv,
        causal=case.get("causal", False),
        window_size=window,
        attention_chunk=case.get("attention_chunk", 0),
    )
    got = output(
        q,
        k,
        v,
        qv,
        layout="bshd",
        causal=case.get("causal", False),
        causal_align="lower-right-per-item",
        key_lengths=lengths,
        window=window if window != (-1, -1) else None,
        attention_chunk=case.get("attention_chunk"),
    )
    np.testing.assert_allclose(np.swapaxes(got, 1, 2), want, rtol=0, atol=TOL)


def test_the_default_scale_counts_qvs_width() -> None:
    rng = np.random.default_rng(2)
    q, k = rng.normal(size=(1, 1, 3, 4)), rng.normal(size=(1, 1, 5, 4))
    v, qv = rng.normal(size=(1, 1, 5, 12)), rng.normal(size=(1, 1, 3, 12))
    spec = build_spec(q, k, v, qv=qv)
    assert (spec.E, spec.qv_width) == (16, 12)
    assert spec.scale == pytest.approx(1 / 4)  # 1/√(4 + 12)


# --- DeepSeek's latent attention: absorbed against naive --------------------------------


def mla(seed: int = 0) -> dict[str, F64]:
    """Random MLA weights and activations: a latent cache c_kv (S, d_c) and a rotary key
    k_rope (S, d_rope) shared by every head; queries q_nope (H, L, d_nope) and q_rope
    (H, L, d_rope); up-projections W_UK (H, d_c, d_nope) and W_UV (H, d_c, dv)."""
    rng = np.random.default_rng(seed)
    H, L, S, d_c, d_nope, d_rope, dv = 4, 6, 10, 16, 8, 4, 6
    return {
        "c_kv": rng.normal(size=(S, d_c)),
        "k_rope": rng.normal(size=(S, d_rope)),
        "q_nope": rng.normal(size=(H, L, d_nope)),
        "q_rope": rng.normal(size=(H, L, d_rope)),
        "w_uk": rng.normal(size=(H, d_c, d_nope)) / 4,
        "w_uv": rng.normal(size=(H, d_c, dv)) / 4,
    }


def naive(m: dict[str, F64], **options: Any) -> F64:
    """Every head's K = [c_kv W_UK | k_rope] and V = c_kv W_UV, expanded: (H, L, dv)."""
    H = m["q_nope"].shape[0]
    k_nope = np.einsum("sc,hcd->hsd", m["c_kv"], m["w_uk"])
    k = np.concatenate([k_nope, np.broadcast_to(m["k_rope"], (H, *m["k_rope"].shape))], -1)
    v = np.einsum("sc,hcd->hsd", m["c_kv"], m["w_uv"])
    q = np.concatenate([m["q_nope"], m["q_rope"]], -1)
    return output(q, k, v, **options)


def absorbed(m: dict[str, F64], **options: Any) -> F64:
    """W_UK absorbed into the queries: qv = q_nope W_UKᵀ over the latent cache (V =
    c_kv, one key/value head), the rotary part as Q and K; W_UV applied after."""
    qv = np.einsum("hld,hcd->hlc", m["q_nope"], m["w_uk"])
    latent = output(m["q_rope"], m["k_rope"][None], m["c_kv"][None], qv, **options)
    return np.asarray(np.einsum("hlc,hcd->hld", latent, m["w_uv"]), dtype=np.float64)


@pytest.mark.parametrize("causal", [False, True])
def test_absorbed_mla_is_the_naive_computation(causal: bool) -> None:
    m = mla()
    d_qk = m["q_nope"].shape[-1] + m["q_rope"].shape[-1]
    scale = 1 / math.sqrt(d_qk)  # DeepSeek's scale: the naive head's width, given
    options: dict[str, Any] = {"scale": scale, "causal": causal, "causal_align": "lower-right"}
    want = naive(m, **options)
    np.testing.assert_allclose(absorbed(m, **options), want, rtol=0, atol=TOL)
    H = m["q_nope"].shape[0]
    k_nope = np.einsum("sc,hcd->hsd", m["c_kv"], m["w_uk"])
    k = np.concatenate([k_nope, np.broadcast_to(m["k_rope"], (H, *m["k_rope"].shape))], -1)
    v = np.einsum("sc,hcd->hsd", m["c_kv"], m["w_uv"])
    q = np.concatenate([m["q_nope"], m["q_rope"]], -1)
    loop = attention(q, k, v, **options).output  # the float64 loop, independent
    np.testing.assert_allclose(want, loop, rtol=0, atol=TOL)


# --- judged, and refused ---------------------------------------------------------------------


def inputs(seed: int = 4) -> tuple[F64, F64, F64, F64]:
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(2, 2, 5, 3)),
        rng.normal(size=(2, 1, 9, 3)),
        rng.normal(size=(2, 1, 9, 8)),
        rng.normal(size=(2, 2, 5, 8)),
    )


def test_a_kernel_that_drops_the_qv_term_fails_its_check() -> None:
    q, k, v, qv = inputs()
    spec = build_spec(q, k, v, qv=qv, options=Options(causal=True))
    faithful = output(q, k, v, qv, causal=True).astype(np.float32)
    dropped = output(q, k, v, causal=True, scale=1 / math.sqrt(11)).astype(np.float32)
    verdicts = {}
    for name, export in (("faithful", faithful), ("dropped", dropped)):
        report = run_checks(spec, [Expected("output", export, "out.npy")])
        verdicts[name] = next(c.status for c in report.checks if c.name == "output.close")
    assert verdicts == {"faithful": "pass", "dropped": "fail"}


def test_a_qv_of_the_wrong_shape_is_one_line() -> None:
    q, k, v, qv = inputs()
    with pytest.raises(SpecError, match=r"^--qv: qv has shape \(2, 2, 5, 7\), expected"):
        build_spec(q, k, v, qv=qv[..., :7])


def test_the_cli_takes_qv_and_grad_refuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # short names: the header's line does not wrap
    for name, a in zip(("q", "k", "v", "qv"), inputs(), strict=True):
        np.save(f"{name}.npy", a)
    files, qv = [f"{n}.npy" for n in "qkv"], "qv.npy"
    result = invoke("compute", *files, "--qv", qv, "--format", "json")
    assert result.exit_code == 0, result.stderr
    result = invoke("compute", *files, "--qv", qv)
    assert "qv.npy: scores Q·Kᵀ + qv·Vᵀ (E = 3 + 8)" in result.stdout
    result = invoke("grad", *files, "--qv", qv)
    assert result.exit_code == ExitCode.BAD_INPUT
    assert result.stderr.startswith("sdpa: error: --qv: the backward pass of the qv term")


def test_a_non_finite_qv_is_named_as_qv_not_q() -> None:
    from sdpa_cli.diagnosis.rules import diagnose

    q, k, v, qv = inputs()
    qv[1, 0, 2, 5] = np.nan
    spec = build_spec(q, k, v, qv=qv, names={"qv": "qv.npy"})
    found = [f for f in diagnose(trace(spec)).findings if f.stage == "input"]
    assert [f.message for f in found] == ["qv (qv.npy) holds 1 NaN; the first at [1, 0, 2, 5]"]
