"""Tests of ``sdpa grad`` and ``sdpa explain --backward`` from the command line.

Every gradient is checked against a float64 reference written here from the formulas
(numpy; PyTorch autograd where importable): the weights A, then for ℓ = Σ O ⊙ dO

    dV = Aᵀ · dO,  dA = dO · Vᵀ,  dS = A ⊙ (dA − rowsum(dA ⊙ A)),
    dQ = dS · K · scale,  dK = dSᵀ · Q · scale,  d(bias) = dS,

with dK and dV summed over the query heads sharing a key/value head (GQA) and d(bias)
over the axes the bias broadcasts along. dS is taken in the centred form
dSᵢ = Aᵢ Σⱼ Aⱼ (dAᵢ − dAⱼ), which keeps a saturated row's tiny dS to full precision.

The command runs in-process through click's ``CliRunner`` (``clirunner.invoke``) in a
fresh working directory; inputs are small arrays written with ``np.save``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from click.testing import Result
from clirunner import ANSI, assert_one_error_line, decode_non_finite, invoke, strict_json
from numpy.typing import NDArray

from sdpa_cli.errors import ExitCode
from sdpa_cli.files.samples import samples_dir

F64 = NDArray[np.float64]
Bool = NDArray[np.bool_]

H, L, S, E, EV = 2, 4, 5, 3, 2
QKV = ("q.npy", "k.npy", "v.npy")
NARROW = {"COLUMNS": "80"}
SAMPLES = samples_dir()
SQRT_E = 1 / np.sqrt(E)


# --- the reference ----------------------------------------------------------------------


def softmax(s: F64) -> F64:
    """Row softmax; hidden logits are -inf (every row here sees at least one key)."""
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    out: F64 = e / e.sum(axis=-1, keepdims=True)
    return out


def sum_to(x: F64, shape: tuple[int, ...]) -> F64:
    """``x`` summed over the axes a ``shape``-d array broadcasts along to reach it."""
    extra = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(extra))) if extra else x
    ones = tuple(i for i, d in enumerate(shape) if d == 1 and x.shape[i] != 1)
    out: F64 = x.sum(axis=ones, keepdims=True) if ones else x
    return out


def reference(
    q: F64,
    k: F64,
    v: F64,
    *,
    scale: float,
    dout: F64 | None = None,
    bias: F64 | None = None,
    visible: Bool | None = None,
    softcap: float | None = None,
) -> dict[str, F64]:
    """Forward and backward of attention in float64, q (..., H, L, E), k/v (..., G, S, ·);
    the softcap C·tanh(x/C) acts on the scaled scores, before the bias."""
    group = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    kk = np.repeat(k, group, axis=-3) if group > 1 else k
    vv = np.repeat(v, group, axis=-3) if group > 1 else v
    s = np.einsum("...LE,...SE->...LS", q, kk) * scale
    slope = 1.0
    if softcap is not None:
        t = np.tanh(s / softcap)
        s, slope = softcap * t, 1 - t * t
    if bias is not None:
        s = s + bias
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    a = softmax(s)
    o = np.einsum("...LS,...SD->...LD", a, vv)
    do = np.ones_like(o) if dout is None else dout
    da = np.einsum("...LD,...SD->...LS", do, vv)
    # Centred: dSᵢ = Aᵢ Σⱼ Aⱼ (dAᵢ − dAⱼ), exact for a saturated row (no 1 − 0.99999999).
    diff = da[..., :, None] - da[..., None, :]
    ds = a * np.sum(diff * a[..., None, :], axis=-1)
    dscaled = ds * slope
    dq = np.einsum("...LS,...SE->...LE", dscaled, kk) * scale
    dk = np.einsum("...LS,...LE->...SE", dscaled, q) * scale
    dv = np.einsum("...LS,...LD->...SD", a, do)
    if group > 1:
        dk = dk.reshape(*k.shape[:-3], k.shape[-3], group, *k.shape[-2:]).sum(axis=-3)
        dv = dv.reshape(*v.shape[:-3], v.shape[-3], group, *v.shape[-2:]).sum(axis=-3)
    out = {"weights": a, "output": o, "dq": dq, "dk": dk, "dv": dv, "d_weights": da, "ds": ds}
    if bias is not None:
        out["dbias"] = sum_to(ds, bias.shape)
    return out


def split_heads(x: F64, n: int) -> F64:
    """(B, L, n·D) → (B, n, L, D)."""
    b, rows, d = x.shape
    return np.moveaxis(x.reshape(b, rows, n, d // n), -2, -3)


def merge_heads(x: F64) -> F64:
    """(B, n, L, D) → (B, L, n·D)."""
    b, n, rows, d = x.shape
    return np.moveaxis(x, -3, -2).reshape(b, rows, n * d)


def causal(rows: int, keys: int) -> Bool:
    """Key j visible to query i when j ≤ i (upper-left)."""
    return np.arange(keys)[None, :] <= np.arange(rows)[:, None]


def jacobian_bound(w: F64) -> float:
    """1 − Σ w² of one row, without 1 − (nearly 1): Σ over the other keys of w (1 − w)
    plus w_top times the weight on the other keys."""
    top = int(np.argmax(w))
    rest = np.delete(w, top)
    return float(np.sum(rest * (1 - rest)) + w[top] * np.sum(rest))


def assert_equal_f64(actual: F64, expected: F64) -> None:
    """Equal to float64 rounding (summation order differs)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    atol = 1e-13 * max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(actual, expected, rtol=1e-10, atol=atol)


# --- running the command ------------------------------------------------------------------


def ok(*args: str, env: Mapping[str, str | None] | None = None) -> Result:
    """``sdpa ARGS``, which must succeed with a silent stderr."""
    result = invoke(*args, env=env)
    assert result.exit_code == ExitCode.OK, (result.exit_code, result.stderr)
    assert result.stderr == ""
    return result


def grad_json(*args: str, code: int = ExitCode.OK) -> dict[str, Any]:
    """``sdpa grad ARGS --format json``: one strict JSON object on one line."""
    result = invoke("grad", *args, "--format", "json")
    assert result.exit_code == code, (result.exit_code, result.stderr)
    assert result.stderr == ""
    assert result.stdout.count("\n") == 1
    data = strict_json(result.stdout)
    assert isinstance(data, dict)
    return data


def array(node: Any) -> F64:
    return np.array(decode_non_finite(node), dtype=np.float64)


def grads_of(data: Mapping[str, Any]) -> dict[str, F64]:
    return {name: array(values) for name, values in data["gradients"].items()}


def findings(data: Mapping[str, Any], kind: str) -> list[dict[str, Any]]:
    return [f for f in data["findings"] if f["kind"] == kind]


def lines_of(text: str) -> list[str]:
    return text.splitlines()


def too_wide(text: str, width: int = 80) -> list[str]:
    return [line for line in lines_of(text) if len(line) > width]


def section(text: str, start: str, stop: str) -> str:
    """The lines from the one starting with ``start`` to the next starting with ``stop``
    (or the end)."""
    lines = lines_of(text)
    first = next(i for i, line in enumerate(lines) if line.startswith(start))
    last = next((i for i in range(first + 1, len(lines)) if lines[i].startswith(stop)), None)
    return "\n".join(lines[first:last])


# --- fixtures ----------------------------------------------------------------------------


@pytest.fixture
def qkv(workdir: Path) -> dict[str, F64]:
    """q/k/v.npy (H, L, E)/(H, S, E)/(H, S, Ev), GQA inputs (4 query heads, 2 kv heads),
    --heads inputs (B, L, 2·E), and biases of three broadcast shapes."""
    rng = np.random.default_rng(20240611)
    arrays: dict[str, F64] = {
        "q": rng.standard_normal((H, L, E)),
        "k": rng.standard_normal((H, S, E)),
        "v": rng.standard_normal((H, S, EV)),
        "q4": rng.standard_normal((4, L, E)),
        "kg": rng.standard_normal((2, S, E)),
        "vg": rng.standard_normal((2, S, EV)),
        "qm": rng.standard_normal((2, L, 2 * E)),
        "km": rng.standard_normal((2, S, 2 * E)),
        "vm": rng.standard_normal((2, S, 2 * EV)),
        "bias_ls": rng.standard_normal((L, S)),
        "bias_hls": rng.standard_normal((H, L, S)),
        "bias_s": rng.standard_normal((1, S)),
        "dout": rng.standard_normal((H, L, EV)),
        "dout_m": rng.standard_normal((2, L, 2 * EV)),
    }
    for name, arr in arrays.items():
        np.save(workdir / f"{name}.npy", arr)
    return arrays


SAT_K = [[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0]]
SAT_Q = [[0.3, -0.2], [3.0, 0.0], [20.0, 0.2], [-0.4, 0.6]]
SAT_V = [[0.5, -1.0, 2.0], [1.5, 0.25, -0.5], [-2.0, 1.0, 0.75], [0.1, 3.0, -1.25]]
SAT_ROW = 2
"""Query 2's dot product with key 0 (20) is 100× those with keys 1–3 (0.2): under
--scale none its softmax is saturated (1 − w_top ≈ 7.5e-9). Query 1 ([3, 0, 0, 0])
passes back about 0.24 of its gradient: flagged only with a looser --vanishing."""


@pytest.fixture
def saturated(workdir: Path) -> dict[str, F64]:
    """sat.yaml: one head, L = S = 4, E = 2, Ev = 3, --scale none in the case."""
    (workdir / "sat.yaml").write_text(
        f"q: {SAT_Q}\nk: {SAT_K}\nv: {SAT_V}\nscale: none\n", encoding="utf-8"
    )
    return {"q": np.array(SAT_Q), "k": np.array(SAT_K), "v": np.array(SAT_V)}


# --- gradients against the reference --------------------------------------------------------


def test_default_options_match_the_reference(qkv: dict[str, F64]) -> None:
    data = grad_json(*QKV)
    got = grads_of(data)
    ref = reference(qkv["q"], qkv["k"], qkv["v"], scale=SQRT_E)
    assert set(got) == {"dq", "dk", "dv"}
    for name in ("dq", "dk", "dv"):
        assert_equal_f64(got[name], ref[name])
    assert data["dout"] == {"source": "ones", "seed": None}
    assert data["numeric_check"] is None


def test_causal_matches_the_reference(qkv: dict[str, F64]) -> None:
    got = grads_of(grad_json(*QKV, "--causal"))
    ref = reference(qkv["q"], qkv["k"], qkv["v"], scale=SQRT_E, visible=causal(L, S))
    for name in ("dq", "dk", "dv"):
        assert_equal_f64(got[name], ref[name])
    # Key 4 is after every query (L = 4 < S = 5): hidden from all, it gets nothing.
    assert np.all(got["dk"][:, 4] == 0)
    assert np.all(got["dv"][:, 4] == 0)


@pytest.mark.parametrize("bias", ["bias_ls", "bias_hls", "bias_s"])
def test_bias_and_its_gradient_match_the_reference(qkv: dict[str, F64], bias: str) -> None:
    data = grad_json(*QKV, "--bias", f"{bias}.npy")
    got = grads_of(data)
    ref = reference(qkv["q"], qkv["k"], qkv["v"], scale=SQRT_E, bias=qkv[bias])
    assert set(got) == {"dq", "dk", "dv", "dbias"}
    assert got["dbias"].shape == qkv[bias].shape
    for name in ("dq", "dk", "dv", "dbias"):
        assert_equal_f64(got[name], ref[name])


def test_softcap_matches_the_reference(qkv: dict[str, F64]) -> None:
    data = grad_json(*QKV, "--softcap", "0.5", "--bias", "bias_ls.npy", "--causal")
    got = grads_of(data)
    q, k, v = qkv["q"], qkv["k"], qkv["v"]
    ref = reference(q, k, v, scale=SQRT_E, bias=qkv["bias_ls"], visible=causal(L, S), softcap=0.5)
    for name in ("dq", "dk", "dv", "dbias"):
        assert_equal_f64(got[name], ref[name])


def test_grouped_query_heads_sum_dk_and_dv_over_the_group(qkv: dict[str, F64]) -> None:
    for extra in ((), ("--causal",)):
        data = grad_json("q4.npy", "kg.npy", "vg.npy", *extra)
        assert data["options"]["group"] == 2
        got = grads_of(data)
        visible = causal(L, S) if extra else None
        ref = reference(qkv["q4"], qkv["kg"], qkv["vg"], scale=SQRT_E, visible=visible)
        assert got["dq"].shape == (4, L, E)
        assert got["dk"].shape == (2, S, E)
        assert got["dv"].shape == (2, S, EV)
        for name in ("dq", "dk", "dv"):
            assert_equal_f64(got[name], ref[name])


def test_heads_split_and_gradients_come_back_in_the_loaded_shape(qkv: dict[str, F64]) -> None:
    got = grads_of(grad_json("qm.npy", "km.npy", "vm.npy", "--heads", "2"))
    q, k, v = (split_heads(qkv[n], 2) for n in ("qm", "km", "vm"))
    ref = reference(q, k, v, scale=SQRT_E)
    assert got["dq"].shape == qkv["qm"].shape
    assert got["dk"].shape == qkv["km"].shape
    assert got["dv"].shape == qkv["vm"].shape
    for name in ("dq", "dk", "dv"):
        assert_equal_f64(got[name], merge_heads(ref[name]))


def test_dout_ones_is_the_default(qkv: dict[str, F64]) -> None:
    data = grad_json(*QKV, "--dout", "ones")
    assert data["dout"] == {"source": "ones", "seed": None}
    default = grads_of(grad_json(*QKV))
    assert {n: g.tolist() for n, g in grads_of(data).items()} == {
        n: g.tolist() for n, g in default.items()
    }
    ref = reference(qkv["q"], qkv["k"], qkv["v"], scale=SQRT_E, dout=np.ones((H, L, EV)))
    for name, values in grads_of(data).items():
        assert_equal_f64(values, ref[name])


def test_dout_random_is_seeded_and_saved(qkv: dict[str, F64], workdir: Path) -> None:
    data = grad_json(*QKV, "--dout", "random", "--seed", "3", "--save", "g3.npz")
    assert data["dout"] == {"source": "random", "seed": 3}
    with np.load(workdir / "g3.npz") as saved:
        dout = np.array(saved["dout"])
        assert dout.shape == (H, L, EV)
        for name, values in grads_of(data).items():
            np.testing.assert_array_equal(saved[name], values)
    assert np.all(np.isfinite(dout))
    assert len(np.unique(dout)) == dout.size  # standard normal draws, not ones
    ref = reference(qkv["q"], qkv["k"], qkv["v"], scale=SQRT_E, dout=dout)
    for name, values in grads_of(data).items():
        assert_equal_f64(values, ref[name])
    # The same seed draws the same dO; another seed another one.
    again = grad_json(*QKV, "--dout", "random", "--seed", "3", "--save", "again.npz")
    assert grads_of(again)["dq"].tolist() == grads_of(data)["dq"].tolist()
    grad_json(*QKV, "--dout", "random", "--seed", "4", "--save", "g4.npz")
    with np.load(workdir / "g4.npz") as other, np.load(workdir / "again.npz") as same:
        np.testing.assert_array_equal(same["dout"], dout)
        assert not np.allclose(other["dout"], dout)


def test_dout_file_matches_the_reference(qkv: dict[str, F64]) -> None:
    data = grad_json(*QKV, "--dout", "dout.npy")
    assert data["dout"] == {"source": "file", "path": "dout.npy"}
    ref = reference(qkv["q"], qkv["k"], qkv["v"], scale=SQRT_E, dout=qkv["dout"])
    for name, values in grads_of(data).items():
        assert_equal_f64(values, ref[name])


def test_dout_file_has_the_merged_shape_under_heads(qkv: dict[str, F64], workdir: Path) -> None:
    data = grad_json(
        "qm.npy", "km.npy", "vm.npy", "--heads", "2", "--dout", "dout_m.npy", "--save", "m.npz"
    )
    q, k, v = (split_heads(qkv[n], 2) for n in ("qm", "km", "vm"))
    ref = reference(q, k, v, scale=SQRT_E, dout=split_heads(qkv["dout_m"], 2))
    for name, values in grads_of(data).items():
        assert_equal_f64(values, merge_heads(ref[name]))
    with np.load(workdir / "m.npz") as saved:
        np.testing.assert_array_equal(saved["dout"], qkv["dout_m"])
        assert saved["dq"].shape == qkv["qm"].shape


def float16_counts(g: F64) -> dict[str, int]:
    """Overflow, subnormal and flush-to-zero counts of ``g``'s nonzero finite values in
    float16, from the format's constants (max 65504, normal 2⁻¹⁴, subnormal 2⁻²⁴)."""
    mags = np.abs(g[np.isfinite(g)])
    nonzero = mags[mags > 0]
    smallest = 2.0**-24
    with np.errstate(over="ignore"):  # the cast's overflow is what is counted
        overflow = int(np.count_nonzero(np.isinf(nonzero.astype(np.float16))))
    return {
        "nonzero": int(nonzero.size),
        "overflow": overflow,
        "subnormal": int(np.count_nonzero((nonzero < 2.0**-14) & (nonzero >= smallest / 2))),
        "flush_to_zero": int(np.count_nonzero(nonzero < smallest / 2)),
    }


def check_ranges(data: Mapping[str, Any], got: Mapping[str, F64]) -> None:
    float16 = {r["gradient"]: r for r in data["ranges"] if r["dtype"] == "float16"}
    assert set(float16) == set(got)
    for name, g in got.items():
        r = float16[name]
        assert r["max_abs"] == pytest.approx(float(np.abs(g).max()), rel=1e-12, abs=0)
        for key, count in float16_counts(g).items():
            assert r[key] == count, (name, key, r)


FLOAT16 = [
    pytest.param(("--dtype", "float16"), id="float16"),
    # Naming the logits' working format must not change what is judged (a regression:
    # grad once kept logits_dtype float16 beside dtype float64 and refused the run).
    pytest.param(("--dtype", "float16", "--logits-dtype", "float32"), id="logits-float32"),
]


@pytest.mark.parametrize("dtype", FLOAT16)
def test_dtype_float16_keeps_float64_gradients_and_reports_float16_ranges(
    qkv: dict[str, F64], dtype: tuple[str, ...]
) -> None:
    data = grad_json(*QKV, *dtype)
    got = grads_of(data)
    ref = reference(qkv["q"], qkv["k"], qkv["v"], scale=SQRT_E)
    for name in ("dq", "dk", "dv"):
        assert_equal_f64(got[name], ref[name])
    assert {r["dtype"] for r in data["ranges"]} >= {"float16", "bfloat16"}
    check_ranges(data, got)
    assert not findings(data, "gradient_range")


def test_json_names_the_format_the_gradients_are_judged_against(qkv: dict[str, F64]) -> None:
    data = grad_json(*QKV, "--dtype", "float16")
    assert data["options"]["dtype"] == "float16"


@pytest.mark.parametrize("dtype", FLOAT16)
def test_gradients_overflowing_float16_are_an_error(
    qkv: dict[str, F64], workdir: Path, dtype: tuple[str, ...]
) -> None:
    # dQ and dK grow with V (dA = dO · Vᵀ); dV = Aᵀ · dO does not.
    np.save(workdir / "v_big.npy", qkv["v"] * 1e6)
    data = grad_json("q.npy", "k.npy", "v_big.npy", *dtype)
    got = grads_of(data)
    ref = reference(qkv["q"], qkv["k"], qkv["v"] * 1e6, scale=SQRT_E)
    for name in ("dq", "dk", "dv"):
        assert_equal_f64(got[name], ref[name])
    check_ranges(data, got)
    over = [f for f in findings(data, "gradient_range") if f["dtype"] == "float16"]
    overflowing = {n for n, g in got.items() if float16_counts(g)["overflow"]}
    assert overflowing  # the case is as meant: dQ or dK passes 65504
    assert {f["stage"] for f in over if "overflow" in f["message"]} == overflowing
    for f in over:
        if "overflow" in f["message"]:
            assert f["severity"] == "error"
            assert f["count"] == float16_counts(got[f["stage"]])["overflow"]


@pytest.mark.parametrize("dtype", FLOAT16)
def test_tiny_gradients_flush_in_float16(
    qkv: dict[str, F64], workdir: Path, dtype: tuple[str, ...]
) -> None:
    np.save(workdir / "v_tiny.npy", qkv["v"] * 1e-6)
    data = grad_json("q.npy", "k.npy", "v_tiny.npy", *dtype)
    got = grads_of(data)
    check_ranges(data, got)
    counts = float16_counts(got["dq"])
    assert counts["subnormal"] + counts["flush_to_zero"] > 0  # the case is as meant
    flushed = [
        f
        for f in findings(data, "gradient_range")
        if f["stage"] == "dq" and "flush" in f["message"]
    ]
    assert len(flushed) == 1
    assert flushed[0]["count"] == counts["flush_to_zero"]
    assert flushed[0]["details"]["subnormal"] == counts["subnormal"]


def test_torch_autograd_agrees(qkv: dict[str, F64]) -> None:
    torch = pytest.importorskip("torch")
    got = grads_of(grad_json("q4.npy", "kg.npy", "vg.npy", "--causal", "--bias", "bias_ls.npy"))
    t = {
        n: torch.tensor(qkv[src], dtype=torch.float64, requires_grad=True)
        for n, src in (("q", "q4"), ("k", "kg"), ("v", "vg"), ("bias", "bias_ls"))
    }
    hidden = torch.tensor(~causal(L, S))
    logits = (t["q"] @ t["k"].repeat_interleave(2, 0).transpose(-1, -2)) * SQRT_E + t["bias"]
    weights = torch.softmax(logits.masked_fill(hidden, -torch.inf), dim=-1)
    out = weights @ t["v"].repeat_interleave(2, 0)
    out.sum().backward()
    for name, tensor in (("dq", "q"), ("dk", "k"), ("dv", "v"), ("dbias", "bias")):
        assert_equal_f64(got[name], t[tensor].grad.numpy())


def test_jobs_do_not_change_the_gradients(qkv: dict[str, F64]) -> None:
    args = ("q4.npy", "kg.npy", "vg.npy", "--causal", "--bias", "bias_ls.npy")
    one = grads_of(grad_json(*args, "--jobs", "1"))
    four = grads_of(grad_json(*args, "--jobs", "4"))
    for name in one:
        assert one[name].tolist() == four[name].tolist()


def test_yaml_holds_the_same_gradients(qkv: dict[str, F64]) -> None:
    result = ok("grad", *QKV, "--bias", "bias_s.npy", "--format", "yaml")
    data = yaml.safe_load(result.stdout)
    for name, values in grads_of(grad_json(*QKV, "--bias", "bias_s.npy")).items():
        assert np.array(data["gradients"][name]).tolist() == values.tolist()


@pytest.mark.e2e
def test_the_installed_command_in_a_pipe(saturated: dict[str, F64]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    run = subprocess.run(
        [sys.executable, "-m", "sdpa_cli", "grad", "sat.yaml", "--dout", "random"],
        capture_output=True,
        text=True,
        env={**env, "COLUMNS": "80"},
        check=False,
    )
    assert run.returncode == ExitCode.OK, run.stderr
    assert run.stderr == ""
    assert ANSI not in run.stdout
    assert not too_wide(run.stdout), too_wide(run.stdout)
    assert "dO standard normal, seed 0" in run.stdout


# --- --save --------------------------------------------------------------------------------


def test_save_writes_every_gradient_in_its_loaded_shape(qkv: dict[str, F64], workdir: Path) -> None:
    data = grad_json(*QKV, "--bias", "bias_s.npy", "--save", "out.npz")
    with np.load(workdir / "out.npz") as saved:
        assert sorted(saved.files) == ["dbias", "dk", "dout", "dq", "dv"]
        assert saved["dq"].shape == (H, L, E)
        assert saved["dk"].shape == (H, S, E)
        assert saved["dv"].shape == (H, S, EV)
        assert saved["dbias"].shape == (1, S)
        np.testing.assert_array_equal(saved["dout"], np.ones((H, L, EV)))
        for name, values in grads_of(data).items():
            np.testing.assert_array_equal(saved[name], values)
    ok("grad", "qm.npy", "km.npy", "vm.npy", "--heads", "2", "--save", "m.npz")
    with np.load(workdir / "m.npz") as saved:
        assert sorted(saved.files) == ["dk", "dout", "dq", "dv"]
        assert saved["dq"].shape == qkv["qm"].shape
        assert saved["dk"].shape == qkv["km"].shape
        assert saved["dv"].shape == qkv["vm"].shape
        assert saved["dout"].shape == (2, L, 2 * EV)


def test_a_failing_run_leaves_an_earlier_save_alone(qkv: dict[str, F64], workdir: Path) -> None:
    np.save(workdir / "dout_bad.npy", np.ones((H, L, E)))
    (workdir / "out.npz").write_bytes(b"an earlier result that must survive")
    before = sorted(p.name for p in workdir.iterdir())
    result = invoke("grad", *QKV, "--dout", "dout_bad.npy", "--save", "out.npz")
    line = assert_one_error_line(result)
    assert line.startswith("sdpa: error: dout_bad.npy: ")
    assert f"{(H, L, EV)}" in line  # the output's shape
    assert f"{(H, L, E)}" in line  # the file's
    assert (workdir / "out.npz").read_bytes() == b"an earlier result that must survive"
    assert sorted(p.name for p in workdir.iterdir()) == before


# --- the numeric check ---------------------------------------------------------------------


def test_numeric_check_passes(qkv: dict[str, F64]) -> None:
    args = (*QKV, "--bias", "bias_ls.npy", "--causal", "--check-numeric", "--samples", "10")
    data = grad_json(*args)
    check = data["numeric_check"]
    assert check["passed"] is True
    assert check["tolerance"] == 1e-5
    assert [c["name"] for c in check["tensors"]] == ["dq", "dk", "dv", "dbias"]
    for c in check["tensors"]:
        assert c["samples"] == 10
        assert c["max_rel_error"] < 1e-6
    table = ok("grad", *args, env=NARROW).stdout
    numeric = section(table, "numeric check", "╭")
    assert "FAIL" not in numeric
    assert len(re.findall(r"\bok$", numeric, flags=re.MULTILINE)) == 4


def test_numeric_check_fails_a_gradient_past_the_tolerance(
    qkv: dict[str, F64], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backward pass whose dQ is 1% off fails: exit 1, its worst entry named."""
    import dataclasses

    from sdpa_cli.diagnosis.grad import backward_health

    def one_percent_off(*args: Any, **kwargs: Any) -> Any:
        grads, health = backward_health(*args, **kwargs)
        return dataclasses.replace(grads, dq=grads.dq * 1.01), health

    monkeypatch.setattr("sdpa_cli.api.grad.backward_health", one_percent_off)
    args = (*QKV, "--check-numeric", "--samples", "10", "--tolerance", "1e-30")
    data = grad_json(*args, code=ExitCode.CHECK_FAILED)
    check = data["numeric_check"]
    assert check["passed"] is False
    assert any(c["max_rel_error"] > 1e-30 for c in check["tensors"])
    dq, dk, dv = check["tensors"]
    assert dq["max_rel_error"] == pytest.approx(0.01 / 1.01, rel=1e-4)
    assert dq["analytic"] == pytest.approx(1.01 * dq["numeric"], rel=1e-7)
    assert dk["max_rel_error"] == dv["max_rel_error"] == 0.0
    result = invoke("grad", *args, env=NARROW)
    assert result.exit_code == ExitCode.CHECK_FAILED
    assert result.stderr == ""
    assert "FAIL" in section(result.stdout, "numeric check", "╭")


def test_rounding_of_the_differences_is_no_error(qkv: dict[str, F64]) -> None:
    """Exact gradients pass any tolerance, a one-hot row's too: its dQ (~1e-9 against
    outputs ~1) is resolved by central differences to a few digits only (it was 7e-3
    off, and the run exited 1), yet the analytic value is the 50-digit one."""
    exact = grad_json(*QKV, "--check-numeric", "--tolerance", "1e-30")["numeric_check"]
    assert exact["passed"] is True
    assert [c["max_rel_error"] for c in exact["tensors"]] == [0.0, 0.0, 0.0]
    data = grad_json(str(SAMPLES / "vanishing.yaml"), "--check-numeric")
    dq = data["numeric_check"]["tensors"][0]
    assert data["numeric_check"]["passed"] is True
    assert dq["worst_at"] == [1, 3]  # the one-hot row, its smallest entry
    assert abs(dq["numeric"] - dq["analytic"]) > 1e-3 * abs(dq["analytic"])
    assert dq["analytic"] == pytest.approx(one_hot_row_dq()[3], rel=1e-12)


def one_hot_row_dq() -> F64:
    """dQ of the vanishing sample's one-hot row (query 1) for dO = 1, in exact rational
    steps but for the exponentials, which are taken with 50 digits."""
    from decimal import Decimal, getcontext

    getcontext().prec = 50
    case = yaml.safe_load((SAMPLES / "vanishing.yaml").read_text())
    q = [Decimal(str(x)) for x in case["q"][1]]
    k = [[Decimal(str(x)) for x in row] for row in case["k"]]
    v = [[Decimal(str(x)) for x in row] for row in case["v"]]
    scale = 1 / Decimal(len(q)).sqrt()
    logits = [sum(a * b for a, b in zip(q, key, strict=True)) * scale for key in k]
    top = max(logits)
    e = [(x - top).exp() for x in logits]
    w = [x / sum(e) for x in e]
    da = [sum(row) for row in v]
    mean = sum(a * b for a, b in zip(w, da, strict=True))
    ds = [a * (b - mean) for a, b in zip(w, da, strict=True)]
    dq = [sum(ds[j] * k[j][e] for j in range(len(k))) * scale for e in range(len(q))]
    return np.array([float(x) for x in dq])


# --- gradient health -----------------------------------------------------------------------


def test_a_saturated_row_has_a_vanishing_gradient(saturated: dict[str, F64]) -> None:
    data = grad_json("sat.yaml")
    flagged = findings(data, "vanishing_gradient")
    assert [f["index"] for f in flagged] == [[SAT_ROW]]
    (f,) = flagged
    assert f["severity"] == "warning"
    ref = reference(saturated["q"], saturated["k"], saturated["v"], scale=1.0)
    w = ref["weights"][SAT_ROW]
    bound = jacobian_bound(w)
    assert 1e-9 < bound < 1e-3
    assert f["details"]["jacobian_bound"] == pytest.approx(bound, rel=1e-6, abs=0)
    assert f["details"]["key"] == 0
    assert f["details"]["visible"] == len(SAT_K)
    ds_norm = float(np.linalg.norm(ref["ds"][SAT_ROW]))
    assert f["details"]["ds_norm"] == pytest.approx(ds_norm, rel=1e-6, abs=1e-300)
    assert f["details"]["da_norm"] == pytest.approx(
        float(np.linalg.norm(ref["d_weights"][SAT_ROW])), rel=1e-12, abs=0
    )
    assert ds_norm <= bound * f["details"]["da_norm"]  # the bound holds
    assert_equal_f64(grads_of(data)["dq"], ref["dq"])


def scaled_norm(x: F64) -> float:
    """‖x‖ without squaring tiny values into 0: max |x| · ‖x / max |x|‖."""
    top = float(np.abs(x).max())
    return 0.0 if top == 0 else top * float(np.sqrt(np.sum((x / top) ** 2)))


@pytest.fixture
def deep(workdir: Path) -> dict[str, F64]:
    """deep.yaml: one query whose logit on key 0 is 460, on keys 1–3 0: its other
    weights are e⁻⁴⁶⁰ ≈ 1e-200, so dS ≈ 1e-200, whose square underflows float64."""
    (workdir / "deep.yaml").write_text(
        f"q: [[460.0, 0.0]]\nk: {SAT_K}\nv: {SAT_V}\nscale: none\n", encoding="utf-8"
    )
    return {"q": np.array([[460.0, 0.0]]), "k": np.array(SAT_K), "v": np.array(SAT_V)}


def test_a_deeply_saturated_row_keeps_its_tiny_gradient(deep: dict[str, F64]) -> None:
    data = grad_json("deep.yaml")
    ref = reference(deep["q"], deep["k"], deep["v"], scale=1.0)
    got = grads_of(data)
    assert 1e-201 < float(np.abs(ref["dq"]).max()) < 1e-199
    assert_equal_f64(got["dq"] / 1e-200, ref["dq"] / 1e-200)  # to full relative precision
    (f,) = findings(data, "vanishing_gradient")
    assert f["index"] == [0]
    assert f["details"]["jacobian_bound"] == pytest.approx(
        jacobian_bound(ref["weights"][0]), rel=1e-6, abs=0
    )


def test_the_ds_norm_of_a_deeply_saturated_row_does_not_underflow(
    deep: dict[str, F64],
) -> None:
    data = grad_json("deep.yaml")
    ref = reference(deep["q"], deep["k"], deep["v"], scale=1.0)
    (f,) = findings(data, "vanishing_gradient")
    expected = scaled_norm(ref["ds"][0])
    assert expected > 1e-201
    assert f["details"]["ds_norm"] == pytest.approx(expected, rel=1e-6, abs=1e-300)


def test_the_norms_of_tiny_gradients_do_not_underflow(deep: dict[str, F64]) -> None:
    data = grad_json("deep.yaml")
    got = grads_of(data)
    # abs=0: pytest.approx's default absolute tolerance (1e-12) would take 0 for 1e-200.
    for name in ("dq", "dk"):
        assert data["norms"][name] == pytest.approx(scaled_norm(got[name]), rel=1e-12, abs=0)
    dq_norm = data["query_heads"][0]["dq_norm"]
    assert dq_norm == pytest.approx(scaled_norm(got["dq"]), rel=1e-12, abs=0)


def test_a_row_with_one_visible_key_is_not_vanishing(saturated: dict[str, F64]) -> None:
    data = grad_json("sat.yaml", "--causal")
    rows = [f["index"] for f in findings(data, "vanishing_gradient")]
    assert rows == [[SAT_ROW]]  # row 0 sees key 0 alone: weight 1, nothing to pass back
    ref = reference(saturated["q"], saturated["k"], saturated["v"], scale=1.0, visible=causal(4, 4))
    (f,) = findings(data, "vanishing_gradient")
    assert f["details"]["visible"] == SAT_ROW + 1
    assert f["details"]["jacobian_bound"] == pytest.approx(
        jacobian_bound(ref["weights"][SAT_ROW][: SAT_ROW + 1]), rel=1e-6, abs=0
    )


def test_a_looser_vanishing_threshold_flags_more_rows(saturated: dict[str, F64]) -> None:
    default = grad_json("sat.yaml")
    loose = grad_json("sat.yaml", "--vanishing", "0.5")
    assert default["finding_counts"]["vanishing_gradient"] == 1
    assert loose["finding_counts"]["vanishing_gradient"] == 2
    assert [f["index"] for f in findings(loose, "vanishing_gradient")] == [[1], [SAT_ROW]]
    ref = reference(saturated["q"], saturated["k"], saturated["v"], scale=1.0)
    (row1,) = (f for f in findings(loose, "vanishing_gradient") if f["index"] == [1])
    assert row1["details"]["jacobian_bound"] == pytest.approx(
        1 - float(np.sum(ref["weights"][1] ** 2)), rel=1e-12, abs=0
    )


def test_padding_keys_get_no_gradient(qkv: dict[str, F64]) -> None:
    data = grad_json(*QKV, "--key-lengths", "3")
    got = grads_of(data)
    visible = np.arange(S)[None, :] < 3
    ref = reference(qkv["q"], qkv["k"], qkv["v"], scale=SQRT_E, visible=visible)
    for name in ("dq", "dk", "dv"):
        assert_equal_f64(got[name], ref[name])
    assert np.all(got["dk"][:, 3:] == 0)
    assert np.all(got["dv"][:, 3:] == 0)
    assert np.all(got["dk"][:, :3] != 0)
    no_gradient = findings(data, "no_gradient_keys")
    assert [f["index"] for f in no_gradient] == [[0], [1]]  # one per K/V head
    for f in no_gradient:
        assert f["severity"] == "info"
        assert f["details"]["keys"] == [3, 4]
        assert f["count"] == 2
        assert "keys 3, 4" in f["message"]
    assert [h["keys_hidden"] for h in data["kv_heads"]] == [2, 2]


def test_per_head_norms_are_the_norms_of_the_gradients(qkv: dict[str, F64]) -> None:
    for args in (QKV, ("q4.npy", "kg.npy", "vg.npy", "--causal")):
        data = grad_json(*args)
        got = grads_of(data)
        n_q, n_kv = got["dq"].shape[0], got["dk"].shape[0]
        assert [h["index"] for h in data["query_heads"]] == [[i] for i in range(n_q)]
        assert [h["index"] for h in data["kv_heads"]] == [[i] for i in range(n_kv)]
        for h in data["query_heads"]:
            (i,) = h["index"]
            assert h["dq_norm"] == pytest.approx(
                float(np.linalg.norm(got["dq"][i])), rel=1e-12, abs=0
            )
        for h in data["kv_heads"]:
            (i,) = h["index"]
            assert h["dk_norm"] == pytest.approx(
                float(np.linalg.norm(got["dk"][i])), rel=1e-12, abs=0
            )
            assert h["dv_norm"] == pytest.approx(
                float(np.linalg.norm(got["dv"][i])), rel=1e-12, abs=0
            )
        for name, g in got.items():
            assert data["norms"][name] == pytest.approx(float(np.linalg.norm(g)), rel=1e-12, abs=0)


# --- the table ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(QKV, id="plain"),
        pytest.param(("sat.yaml",), id="saturated"),
        pytest.param(("q4.npy", "kg.npy", "vg.npy", "--bias", "bias_ls.npy"), id="gqa-bias"),
        pytest.param(("qm.npy", "km.npy", "vm.npy", "--heads", "2"), id="heads"),
        pytest.param(("qw.npy", "kw.npy", "vw.npy", "--causal"), id="wide"),
        pytest.param((*QKV, "--check-numeric", "--key-lengths", "3"), id="numeric"),
    ],
)
def test_the_table_fits_80_columns_without_escape_codes(
    qkv: dict[str, F64], saturated: dict[str, F64], workdir: Path, args: Sequence[str]
) -> None:
    rng = np.random.default_rng(7)
    for name, shape in (("qw", (1, 24, 40)), ("kw", (1, 30, 40)), ("vw", (1, 30, 40))):
        np.save(workdir / f"{name}.npy", rng.standard_normal(shape))
    out = ok("grad", *args, env=NARROW).stdout
    assert ANSI not in out
    assert not too_wide(out), too_wide(out)
    for word in ("dQ", "dK", "dV", "gradient norms"):
        assert word in out
    if "--bias" in args:
        assert "d(bias)" in out


def test_the_dq_table_flags_a_vanishing_row(saturated: dict[str, F64]) -> None:
    out = ok("grad", "sat.yaml", env=NARROW).stdout
    dq = section(out, "dQ", "dK")
    flagged = [line.split()[0] for line in lines_of(dq) if line.endswith("vanishing")]
    assert flagged == [f"q{SAT_ROW}"]
    panel = out[out.index("╭─ findings") :]
    assert "vanishing gradient (1 row)" in panel
    assert f"row [{SAT_ROW}] passes back at most 1.5e-08 of its gradient" in panel


def test_no_color_removes_every_escape_code(qkv: dict[str, F64]) -> None:
    forced = ok("grad", *QKV, env={**NARROW, "FORCE_COLOR": "1"}).stdout
    assert ANSI in forced  # the check below can see escape codes
    out = ok("grad", *QKV, env={**NARROW, "FORCE_COLOR": "1", "NO_COLOR": "1"}).stdout
    assert ANSI not in out
    assert "dQ" in out
    assert ANSI not in ok("grad", *QKV, "--no-color", env={"FORCE_COLOR": "1"}).stdout


# --- bad input ----------------------------------------------------------------------------

# (id, arguments after `grad`, how the line starts after "sdpa: error: ", a fragment)
BAD: list[tuple[str, list[str], str, str]] = [
    ("dout-missing", [*QKV, "--dout", "nosuchfile.npy"], "nosuchfile.npy: ", "no such file"),
    ("dout-word", [*QKV, "--dout", "zeros"], "--dout: ", "expected a file, ones or random"),
    ("samples-zero", [*QKV, "--samples", "0"], "Invalid value for '--samples'", "0"),
    ("tolerance-negative", [*QKV, "--tolerance", "-1"], "Invalid value for '--tolerance'", "-1"),
    ("tolerance-zero", [*QKV, "--tolerance", "0"], "Invalid value for '--tolerance'", "0"),
    ("vanishing-two", [*QKV, "--vanishing", "2"], "--vanishing: ", "'2'"),
    ("vanishing-word", [*QKV, "--vanishing", "lots"], "--vanishing: ", "'lots'"),
    ("head-out-of-range", [*QKV, "--head", "9"], "--head: ", "9 is out of range"),
    ("batch-missing", [*QKV, "--batch", "0"], "--batch: ", "no batch item axis"),
    ("rows-out-of-range", [*QKV, "--rows", "7"], "--rows: ", "'7'"),
]


@pytest.mark.parametrize(
    ("args", "start", "fragment"), [pytest.param(a, s, f, id=i) for i, a, s, f in BAD]
)
def test_bad_input_is_one_error_line(
    qkv: dict[str, F64], args: list[str], start: str, fragment: str
) -> None:
    line = assert_one_error_line(invoke("grad", *args))
    assert line.startswith(f"sdpa: error: {start}"), line
    assert fragment in line, line


# --- sdpa explain --backward ------------------------------------------------------------------


def explain_json(*args: str) -> dict[str, Any]:
    result = ok("explain", *args, "--format", "json")
    data = strict_json(result.stdout)
    assert isinstance(data, dict)
    return data


def backward_stages(data: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {st["name"]: st for st in data["backward"]["stages"]}


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        pytest.param((), (), id="plain"),
        pytest.param(("--softcap", "5"), ("d_scaled",), id="softcap"),
        pytest.param(("--bias", "bias_ls.npy"), ("d_bias",), id="bias"),
        pytest.param(
            ("--softcap", "5", "--bias", "bias_hls.npy"),
            ("d_scaled", "d_bias"),
            id="softcap-bias",
        ),
    ],
)
def test_explain_backward_stages_in_order(
    qkv: dict[str, F64], extra: tuple[str, ...], names: tuple[str, ...]
) -> None:
    data = explain_json(*QKV, "--backward", "--dout", "random", *extra)
    order = ["d_output", "d_weights", "d_scores", "d_scaled", "d_query", "d_key", "d_value"]
    order += ["d_bias"]
    expected = [n for n in order if n not in ("d_scaled", "d_bias") or n in names]
    assert [st["name"] for st in data["backward"]["stages"]] == expected
    for st in data["backward"]["stages"]:
        assert st["note"]


def test_explain_backward_matches_sdpa_grad(qkv: dict[str, F64], workdir: Path) -> None:
    (workdir / "case.yaml").write_text("q: q.npy\nk: k.npy\nv: v.npy\ncausal: true\n")
    data = explain_json("case.yaml", "--backward", "--dout", "random", "--rows", "1:3")
    ok("grad", "case.yaml", "--dout", "random", "--save", "g.npz")
    stages = backward_stages(data)
    with np.load(workdir / "g.npz") as saved:
        assert_equal_f64(array(stages["d_query"]["values"]), saved["dq"][0, 1:3])
        assert_equal_f64(array(stages["d_key"]["values"]), saved["dk"][0])
        assert_equal_f64(array(stages["d_value"]["values"]), saved["dv"][0])
        assert_equal_f64(array(stages["d_output"]["values"]), saved["dout"][0, 1:3])
        dout = np.array(saved["dout"])
    ref = reference(qkv["q"], qkv["k"], qkv["v"], scale=SQRT_E, dout=dout, visible=causal(L, S))
    assert_equal_f64(array(stages["d_weights"]["values"]), ref["d_weights"][0, 1:3])
    assert_equal_f64(array(stages["d_scores"]["values"]), ref["ds"][0, 1:3])


def test_explain_d_scores_rows_sum_to_zero(qkv: dict[str, F64]) -> None:
    data = explain_json(*QKV, "--backward", "--dout", "random", "--causal")
    ds = array(backward_stages(data)["d_scores"]["values"])
    assert ds.shape == (L, S)
    scale = float(np.abs(ds).max())
    assert scale > 0
    np.testing.assert_allclose(ds.sum(axis=1), 0.0, atol=1e-14 * scale)


def test_explain_places_the_vanishing_gradient_at_d_scores(saturated: dict[str, F64]) -> None:
    data = explain_json("sat.yaml", "--backward", "--dout", "random")
    stages = backward_stages(data)
    found = [f for f in stages["d_scores"]["findings"] if f["kind"] == "vanishing_gradient"]
    assert [f["index"] for f in found] == [[SAT_ROW]]
    for name, st in stages.items():
        if name != "d_scores":
            assert not [f for f in st["findings"] if f["kind"] == "vanishing_gradient"]


@pytest.mark.parametrize(
    ("args", "names"),
    [
        pytest.param(("sat.yaml",), (), id="saturated"),
        pytest.param((*QKV, "--bias", "bias_ls.npy"), ("d_bias",), id="bias"),
        pytest.param(
            (*QKV, "--softcap", "5", "--bias", "bias_ls.npy"),
            ("d_scaled", "d_bias"),
            id="softcap-bias",
        ),
    ],
)
def test_explain_backward_table(
    qkv: dict[str, F64], saturated: dict[str, F64], args: tuple[str, ...], names: tuple[str, ...]
) -> None:
    out = ok("explain", *args, "--backward", "--dout", "random", env=NARROW).stdout
    assert ANSI not in out
    assert not too_wide(out), too_wide(out)
    backward = out[out.index("── backward") :]
    for name in ("d_output", "d_weights", "d_scores", "d_query", "d_key", "d_value", *names):
        assert re.search(rf"^{name}\b", backward, flags=re.MULTILINE), name


def test_explain_backward_shows_the_head_asked_for(qkv: dict[str, F64], workdir: Path) -> None:
    data = explain_json(*QKV, "--backward", "--dout", "random", "--head", "1")
    assert data["slice"]["head"] == 1
    stages = backward_stages(data)
    ok("grad", *QKV, "--dout", "random", "--save", "g.npz")
    with np.load(workdir / "g.npz") as saved:
        assert_equal_f64(array(stages["d_query"]["values"]), saved["dq"][1])
        assert_equal_f64(array(stages["d_key"]["values"]), saved["dk"][1])
        assert_equal_f64(array(stages["d_output"]["values"]), saved["dout"][1])
        assert not np.allclose(saved["dq"][0], saved["dq"][1])


# --- help --------------------------------------------------------------------------------


def test_help_lists_grad_and_grad_has_an_example() -> None:
    top = ok("--help").stdout
    assert re.search(r"^\s+grad\s+\S", top, flags=re.MULTILINE), top
    text = ok("grad", "--help-all").stdout
    assert "Examples:" in text
    assert re.search(r"^\s+sdpa grad \S", text, flags=re.MULTILINE)
    for option in ("--dout", "--check-numeric", "--samples", "--tolerance", "--vanishing"):
        assert option in text
    assert "Exit codes:" in text


def test_explain_backward_writes_an_infinite_norm_as_the_forward_notes_do(workdir: Path) -> None:
    """One way to write an infinite number in prose (text.prose): ``∞``, as the forward
    notes write it (the backward notes printed ``inf`` before they shared it)."""
    np.save("q.npy", np.array([[1e-308]]))
    np.save("k.npy", np.array([[1e308], [-1e308]]))
    np.save("v.npy", np.array([[10.0], [-10.0]]))
    data = explain_json("q.npy", "k.npy", "v.npy", "--scale", "none", "--backward")
    assert data["backward"]["norms"]["dq"] is None  # JSON holds no infinity: null
    assert backward_stages(data)["d_query"]["note"].endswith("‖dQ‖ of this head: ∞.")


def test_gradients_that_cannot_fit_in_memory_are_refused_before_the_pass(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A document keeps every gradient whole: refused in one line when memory cannot
    hold them; the tables keep the slice they show (of 8 heads), and run."""
    from sdpa_cli.files import limits

    rng = np.random.default_rng(5)
    for name in "qkv":
        np.save(f"{name}8.npy", rng.standard_normal((8, 16, 4)))
    files = ("q8.npy", "k8.npy", "v8.npy")
    whole = 8 * 3 * 8 * 16 * 4  # dQ, dK and dV in float64
    monkeypatch.setattr(limits, "available_memory", lambda: whole)
    line = assert_one_error_line(invoke("grad", *files, "--format", "json"))
    assert line.startswith("sdpa: error: gradients of Q (8, 16, 4): keeping every gradient")
    assert "slice the inputs" in line
    assert "dQ" in ok("grad", *files).stdout
    monkeypatch.setattr(limits, "available_memory", lambda: 2 * whole)
    grad_json(*files)
