"""FP8 inputs with descales (``--q-descale``, ``--k-descale``, ``--v-descale``).

In float64 the descales dequantize: plain attention on Q · q_descale, K · k_descale,
V · v_descale, held at 1e-9 to FlashAttention's ``attention_ref`` with its descales
(``tests/flash_reference.py``). Under ``--dtype float8_e4m3fn`` the run is
FlashAttention-3's FP8 forward, held at 1e-9 to the kernel's rules written below step by
step in float64, every rounding an explicit ml_dtypes cast; and the descales are
checked at the entry, one line naming the flag or the file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from clirunner import invoke
from flash_reference import attention_ref, padding
from numpy.typing import NDArray

from sdpa_cli.engine.inputs import load_spec
from sdpa_cli.engine.softmax import softmax_lse
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.trace import trace
from sdpa_cli.errors import ExitCode, SpecError
from sdpa_cli.names import DESCALES

F64 = NDArray[np.float64]
TOL = 1e-9
E4M3 = ml_dtypes.float8_e4m3fn
B, H, G, L, S, E = 2, 4, 2, 6, 24, 8


def fp8_values(rng: np.random.Generator, shape: tuple[int, ...]) -> F64:
    """e4m3 values in ±[1, 4] and zeros: multiples of 1/8 whose products and sums stay
    exact in float32 at these sizes, so a float32 accumulation is the exact sum."""
    x = rng.uniform(1.0, 4.0, shape) * rng.choice([-1.0, 0.0, 1.0], shape, p=[0.45, 0.1, 0.45])
    return np.asarray(x.astype(E4M3), np.float64)


def data(seed: int = 3) -> dict[str, F64]:
    rng = np.random.default_rng(seed)
    return {
        "q": fp8_values(rng, (B, H, L, E)),
        "k": fp8_values(rng, (B, G, S, E)),
        "v": fp8_values(rng, (B, G, S, E)),
        "q_descale": rng.uniform(0.02, 0.2, (B, G)).astype(np.float32).astype(np.float64),
        "k_descale": rng.uniform(0.02, 0.2, (B, G)).astype(np.float32).astype(np.float64),
        "v_descale": rng.uniform(0.5, 2.0, (B, G)).astype(np.float32).astype(np.float64),
    }


def write(tmp_path: Path, arrays: dict[str, Any]) -> dict[str, str]:
    paths = {}
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name, values in arrays.items():
        paths[name] = str(tmp_path / f"{name}.npy")
        np.save(paths[name], np.asarray(values, np.float32))
    return paths


def spec_of(tmp_path: Path, arrays: dict[str, Any], **flags: Any) -> AttentionSpec:
    paths = write(tmp_path, arrays)
    tensors: dict[str, str | None] = {n: paths[n] for n in DESCALES if n in paths}
    spec, _ = load_spec((paths["q"], paths["k"], paths["v"]), tensors, flags)
    return spec


def run(spec: AttentionSpec) -> tuple[F64, F64]:
    """The engine's output and LSE."""
    t = trace(spec, stages=("masked", "weights", "output"), gather_stats=False)
    assert t.output is not None
    assert t.masked is not None
    assert t.weights is not None
    return np.asarray(t.output, np.float64), softmax_lse(t.masked, t.weights)


def r32(x: Any) -> F64:
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def rbf16(x: Any) -> F64:
    return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def fp8_kernel(
    d: dict[str, F64], scale: float, visible: NDArray[np.bool_] | None = None
) -> tuple[F64, F64]:
    """FlashAttention-3's FP8 forward, step by step in float64 with explicit roundings:
    S = Q₈·K₈ᵀ (float32: exact here), x = S · (scale · q_d · k_d) in float32, e =
    exp(x − max x) in float32, ℓ = Σ e rounded once to float32, P = e in e4m3,
    O = (P·V₈) (float32: exact here) × (1/ℓ · v_d), each step in float32, stored in
    bfloat16; LSE = max x + log ℓ."""
    group = H // G
    out = np.zeros((B, H, L, E))
    lse = np.zeros((B, H, L))
    for b in range(B):
        for h in range(H):
            g = h // group
            qd, kd, vd = (float(d[n][b, g]) for n in ("q_descale", "k_descale", "v_descale"))
            raw = d["q"][b, h] @ d["k"][b, g].T
            x = r32(raw * (scale * qd * kd))
            if visible is not None:
                x = np.where(visible, x, -np.inf)
            top = x.max(axis=1, keepdims=True)
            e = r32(np.exp(r32(x - top)))
            ell = r32(e.sum(axis=1, keepdims=True))
            p = e.astype(E4M3).astype(np.float64)
            acc = r32(p @ d["v"][b, g])
            out[b, h] = rbf16(r32(acc * r32(r32(1.0 / ell) * vd)))
            lse[b, h] = top[:, 0] + np.log(ell[:, 0])
    return out, lse


def causal_lower_right() -> NDArray[np.bool_]:
    i, j = np.ogrid[:L, :S]
    return np.asarray(j <= i + S - L)


@pytest.mark.parametrize("causal", [False, True])
def test_the_fp8_kernel_follows_its_rules_step_by_step(tmp_path: Path, causal: bool) -> None:
    """Per-(batch, kv head) descales, grouped-query, with and without a causal mask."""
    d = data()
    flags: dict[str, Any] = {"dtype": "float8_e4m3fn"}
    if causal:
        flags.update(causal=True, causal_align="lower-right")
    out, lse = run(spec_of(tmp_path, d, **flags))
    want, want_lse = fp8_kernel(d, E**-0.5, causal_lower_right() if causal else None)
    np.testing.assert_allclose(out, want, rtol=0, atol=TOL)
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=TOL)


def test_the_fp8_kernel_is_flash_attentions_reference_with_p_in_e4m3(tmp_path: Path) -> None:
    """FlashAttention's attention_ref with P rounded to e4m3 (its intermediate_dtype),
    in float64: the kernel's output within its own roundings (float32 logits, bfloat16
    output: two bfloat16 units of the row's scale)."""
    d = data(5)
    out, _ = run(spec_of(tmp_path, d, dtype="float8_e4m3fn"))
    q, k, v = (np.swapaxes(d[n], 1, 2) for n in "qkv")
    want = attention_ref(
        q,
        k,
        v,
        q_descale=d["q_descale"],
        k_descale=d["k_descale"],
        v_descale=d["v_descale"],
        p_format=E4M3,
    )
    scale = np.abs(want).max(axis=-1, keepdims=True)
    assert np.all(np.abs(np.swapaxes(out, 1, 2) - want) <= 2 * 2.0**-8 * scale)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_descales_dequantize_as_flash_attentions_reference(tmp_path: Path, layout: str) -> None:
    """In float64 (no --dtype): attention_ref with q_descale, k_descale, v_descale
    ``(b, h_k)``, a causal mask at the bottom right and item 1's keys padded, at 1e-9."""
    d = data(7)
    lengths = (S, 17)
    arrays = dict(d)
    if layout == "bshd":
        arrays.update({n: np.swapaxes(d[n], 1, 2) for n in "qkv"})
    spec = spec_of(
        tmp_path,
        arrays,
        layout=layout,
        causal=True,
        causal_align="lower-right-per-item",
        key_lengths=",".join(map(str, lengths)),
    )
    got = np.asarray(trace(spec, stages=("output",)).output, np.float64)
    q, k, v = (np.swapaxes(d[n], 1, 2) for n in "qkv")
    want = attention_ref(
        q,
        k,
        v,
        None,
        padding(lengths, S),
        causal=True,
        q_descale=d["q_descale"],
        k_descale=d["k_descale"],
        v_descale=d["v_descale"],
    )
    # the trace's output is in the engine's layout, (B, H, L, Ev), whatever was read
    np.testing.assert_allclose(np.swapaxes(got, 1, 2), want, rtol=0, atol=TOL)


def test_a_number_is_a_descale_for_the_whole_tensor(tmp_path: Path) -> None:
    """--k-descale 0.125 (a number), a (1,) file and a (B, G) file of it: one computation."""
    d = data(9)
    del d["q_descale"], d["v_descale"]
    arrays = {n: d[n] for n in "qkv"}
    by_file = spec_of(tmp_path / "a", {**arrays, "k_descale": np.full((B, G), 0.125)})
    one = spec_of(tmp_path / "b", {**arrays, "k_descale": np.array([0.125])})
    paths = write(tmp_path / "c", arrays)
    number, _ = load_spec((paths["q"], paths["k"], paths["v"]), {"k_descale": "0.125"})
    outputs = [run(s)[0] for s in (by_file, one, number)]
    assert np.array_equal(outputs[0], outputs[1])
    assert np.array_equal(outputs[0], outputs[2])
    assert number.descale is not None
    assert number.descale.labels["k_descale"] == "--k-descale"


BAD = [
    ("q_descale", "-0.5", "--q-descale: must be a positive number, finite in float32, got -0.5"),
    ("k_descale", "0", "--k-descale: must be a positive number, finite in float32, got 0.0"),
    ("v_descale", "1e39", "--v-descale: must be a positive number, finite in float32, got 1e+39"),
    ("q_descale", "nan", "--q-descale: must be a positive number, finite in float32, got nan"),
]


@pytest.mark.parametrize(("name", "value", "line"), BAD)
def test_a_bad_descale_number_is_refused_naming_its_flag(
    tmp_path: Path, name: str, value: str, line: str
) -> None:
    paths = write(tmp_path, {n: v for n, v in data().items() if n in "qkv"})
    flag = "--" + name.replace("_", "-")
    result = invoke("compute", paths["q"], paths["k"], paths["v"], flag, value)
    assert result.exit_code == ExitCode.BAD_INPUT
    assert result.stderr.strip().splitlines()[-1] == f"sdpa: error: {line}"


def test_a_descale_file_of_the_wrong_shape_is_refused_naming_it(tmp_path: Path) -> None:
    d = data()
    paths = write(tmp_path, {**{n: d[n] for n in "qkv"}, "k_descale": np.ones((B, H))})
    result = invoke(
        "compute", paths["q"], paths["k"], paths["v"], "--k-descale", paths["k_descale"]
    )
    assert result.exit_code == ExitCode.BAD_INPUT
    assert result.stderr.strip().splitlines()[-1] == (
        f"sdpa: error: {paths['k_descale']}: k_descale should be a number, (G,) = (2,) or "
        "(B, G) = (2, 2) (batch, kv heads): but got shape (2, 4)"
    )


def test_a_descale_file_holding_a_negative_value_is_refused_where(tmp_path: Path) -> None:
    d = data()
    bad = np.ones((B, G))
    bad[1, 0] = -2.0
    spec_paths = write(tmp_path, {**{n: d[n] for n in "qkv"}, "v_descale": bad})
    with pytest.raises(SpecError) as raised:
        load_spec(
            (spec_paths["q"], spec_paths["k"], spec_paths["v"]),
            {"v_descale": spec_paths["v_descale"]},
        )
    assert str(raised.value) == (
        f"{spec_paths['v_descale']}: v_descale must hold numbers positive, finite in float32 "
        "(the kernels' format): got -2.0 at [1, 0]"
    )


def test_values_beyond_fp8_are_refused(tmp_path: Path) -> None:
    """With descales Q holds the FP8 values: 1000 is past e4m3's 448."""
    d = data()
    d["q"][0, 1, 2, 3] = 1000.0
    with pytest.raises(SpecError, match=r"Q holds 1000.0 at \[0, 1, 2, 3\], beyond float8_e4m3fn"):
        spec_of(tmp_path, d)


def test_dropout_is_refused_with_descales(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="descales are not taken with --dropout"):
        spec_of(tmp_path, data(), dropout="0.1")


def test_a_case_file_takes_descales_as_numbers_and_nested_lists(tmp_path: Path) -> None:
    d = data(11)
    paths = write(tmp_path, {n: d[n] for n in "qkv"})
    case = tmp_path / "case.yaml"
    kd = [[float(x) for x in row] for row in d["k_descale"]]
    case.write_text(
        f"q: {paths['q']}\nk: {paths['k']}\nv: {paths['v']}\n"
        f"q_descale: 0.0625\nk_descale: {kd}\ndtype: float8_e4m3fn\n"
    )
    from_case, _ = load_spec((str(case),))
    given = {**{n: d[n] for n in "qkv"}, "q_descale": np.full((B, G), 0.0625)}
    given["k_descale"] = d["k_descale"]
    direct = spec_of(tmp_path / "a", given, dtype="float8_e4m3fn")
    assert np.array_equal(run(from_case)[0], run(direct)[0])
    assert from_case.descale is not None
    assert from_case.descale.payload()["q_descale"] == 0.0625


def test_descales_show_in_the_header_and_the_json(tmp_path: Path) -> None:
    d = data()
    paths = write(tmp_path, d)
    args = ["compute", paths["q"], paths["k"], paths["v"], "--dtype", "float8_e4m3fn"]
    args += ["--q-descale", "0.5", "--k-descale", paths["k_descale"]]
    table = invoke(*args, "--no-color").stdout
    assert "q_descale 0.5, k_descale" in table
    assert "v_descale 1" in table
    assert "FlashAttention-3's FP8 forward" in table
    document = json.loads(invoke(*args, "--format", "json").stdout)
    descale = document["options"]["descale"]
    assert descale["format"] == "float8_e4m3fn"
    assert descale["q_descale"] == 0.5
    assert descale["v_descale"] is None
    assert np.allclose(descale["k_descale"], d["k_descale"])


def test_the_real_values_are_what_float64_findings_read(tmp_path: Path) -> None:
    """The spec keeps Q dequantized; the FP8 kernel divides it back exactly."""
    d = data()
    spec = spec_of(tmp_path, d, dtype="float8_e4m3fn")
    qd = np.repeat(d["q_descale"], H // G, axis=1)[..., None, None]
    assert np.array_equal(spec.q, d["q"] * qd)
    assert np.array_equal(spec.q / qd, d["q"])
    assert math.isclose(spec.descale.at((1, 3), spec.group)[0], d["q_descale"][1, 1])  # type: ignore[union-attr]
