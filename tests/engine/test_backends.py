"""numpy and torch compute the same lean pass: one engine, two array libraries.

The lean pass (:func:`~sdpa_cli.engine.online.attend_online`) and every row statistic
are written once against numpy's API; ``xp`` is numpy, or the torch adapter of a
device (:mod:`sdpa_cli.engine.arrays`). What is proven here, on torch's CPU and, where
one is present, on a CUDA device:

1. Block by block, on every mask option of the shared cases, under −inf and finite
   mask values, with key blocks of 7 keys (boundaries inside every mask): the output,
   the LSE and every row statistic agree with numpy's to 1e-12 in float64 (float32
   runs to float32 rounding: torch sums its products in another order), counts and
   top keys exactly, and the records (what overflows, where first) equal.
2. Whole runs: ``sdpa check``'s report is the same on both backends (every check's
   status and summary) for a correct float16 export and two broken ones, and says
   which backend computed it.
3. Choosing: ``auto`` is torch for torch tensors, numpy otherwise; a bad backend or
   device is one clear error.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from attention_cases import CASES, make_spec

from sdpa_cli.check.records import Expected
from sdpa_cli.check.run import run_checks
from sdpa_cli.engine import arrays, online, precision
from sdpa_cli.engine.arrays import NUMPY, Backend, current, namespace, resolve, using
from sdpa_cli.engine.block import key_range, operands
from sdpa_cli.engine.online import Online, attend_online
from sdpa_cli.engine.options import FINFO_MIN, Options
from sdpa_cli.engine.precision import numpy_dtype
from sdpa_cli.engine.records import Records
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.engine.trace import trace
from sdpa_cli.errors import SpecError

torch = pytest.importorskip("torch")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FINITE: dict[str, dict[str, Any]] = {
    "-inf": {},
    "finfo-min": {"mask_value": FINFO_MIN},
    "-1e9": {"mask_value": -1e9},
}


def lean_blocks(spec: AttentionSpec, xp: Any, rows: int = 5) -> list[Online | None]:
    """The lean pass over every row block of every slice, in key blocks of 7 keys."""
    found = []
    for lead in np.ndindex(*spec.lead):
        at = tuple(int(i) for i in lead)
        inputs = operands(spec, at)
        for i0 in range(0, spec.L, rows):
            r = slice(i0, min(i0 + rows, spec.L))
            records = Records.empty(spec, precision.CHECKED, ("float16",))
            found.append(
                attend_online(
                    spec, at, r, key_range(spec, at, r), inputs, records, key_block=7, xp=xp
                )
            )
    return found


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_value", FINITE.values(), ids=FINITE.keys())
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_torch_computes_every_block_as_numpy_does(
    case: dict[str, Any], mask_value: dict[str, Any], device: str
) -> None:
    spec = make_spec(11, **case, **mask_value)
    float32 = case.get("float32", False)
    rtol, atol = (1e-5, 1e-6) if float32 else (1e-12, 1e-13)
    mine = lean_blocks(spec, namespace(resolve("torch", device)))
    theirs = lean_blocks(spec, np)
    assert [m is None for m in mine] == [t is None for t in theirs]
    assert any(t is not None for t in theirs)
    for got, want in zip(mine, theirs, strict=True):
        if got is None or want is None:
            continue
        assert isinstance(got.output, np.ndarray)
        assert got.output.dtype == want.output.dtype
        np.testing.assert_allclose(got.output, want.output, rtol=rtol, atol=atol)
        np.testing.assert_allclose(got.lse, want.lse, rtol=rtol, atol=atol)
        assert got.rows.keys() == want.rows.keys()
        for name, values in want.rows.items():
            if values.dtype.kind in "iu" and not float32:
                np.testing.assert_array_equal(got.rows[name], values, err_msg=name)
            elif values.dtype.kind == "f":
                np.testing.assert_allclose(
                    got.rows[name], values, rtol=rtol, atol=atol, err_msg=name
                )
        for stage, record in want.records.absmax.items():
            assert got.records.absmax[stage].count == record.count
        for kind in ("exp_overflow", "mask_add_overflow"):
            for fmt, record in getattr(want.records, kind).items():
                other = getattr(got.records, kind)[fmt]
                assert (other.count, other.first) == (record.count, record.first), kind


OTHER_OPTIONS: dict[str, dict[str, Any]] = {
    "softcap": {"softcap": 5.0, "causal": True},
    "alibi": {"alibi": True},
    "float-mask": {"mask": "float"},
    "bfloat16-emulated": {"dtype": "bfloat16", "causal": True},
}
"""Options the lean pass does not take: the per-stage path computes them, on numpy's
threads whatever the backend."""


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "case", [*CASES.values(), *OTHER_OPTIONS.values()], ids=[*CASES, *OTHER_OPTIONS]
)
def test_every_option_traces_the_same_on_both_backends(case: dict[str, Any], device: str) -> None:
    """What ``compute`` finds: the output, every row statistic and the score moments."""
    spec = make_spec(12, **case)
    float32 = case.get("float32", False)
    rtol, atol = (1e-5, 1e-6) if float32 else (1e-12, 1e-13)
    found = []
    for backend in (NUMPY, resolve("torch", device)):
        with using(backend):
            found.append(trace(spec, stages=("output",), summarize=("output",)))
    mine, theirs = found[1], found[0]
    assert mine.output is not None
    assert theirs.output is not None
    np.testing.assert_allclose(mine.output, theirs.output, rtol=rtol, atol=atol)
    a, b = mine.stats, theirs.stats
    if not float32:
        np.testing.assert_array_equal(a.n_visible, b.n_visible)
        np.testing.assert_array_equal(a.argmax, b.argmax)
    np.testing.assert_allclose(a.max_weight, b.max_weight, rtol=rtol, atol=atol)
    np.testing.assert_allclose(a.entropy, b.entropy, rtol=rtol, atol=max(atol, 1e-12))
    assert a.moments.count == b.moments.count
    assert a.moments.mean_ == pytest.approx(b.moments.mean_, rel=1e-9, abs=1e-12)
    assert a.moments.m2 == pytest.approx(b.moments.m2, rel=1e-9)


# --- whole runs ---------------------------------------------------------------------------


def float16_exports() -> tuple[AttentionSpec, dict[str, np.ndarray]]:
    """A causal float16 case, its output as torch's kernel gives it, and two slips."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.normal(size=(1, 4, 96, 32)).astype(np.float16) for _ in range(3))
    spec = causal_spec(q, k, v)
    f = torch.nn.functional.scaled_dot_product_attention
    t = [torch.from_numpy(a.astype(np.float32)) for a in (q, k, v)]
    good = f(*t, is_causal=True).half().numpy()
    no_mask = f(*t).half().numpy()
    no_scale = f(*t, is_causal=True, scale=1.0).half().numpy()
    return spec, {"correct": good, "no causal mask": no_mask, "no scale": no_scale}


def causal_spec(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> AttentionSpec:
    return build_spec(q, k, v, options=Options(causal=True))


def reference_output(spec: AttentionSpec) -> np.ndarray:
    """The output in float64, every stage computed."""
    output = trace(spec, stages=("output",)).output
    assert output is not None
    return output


@pytest.mark.parametrize("device", DEVICES)
def test_a_check_gives_the_same_verdict_on_both_backends(device: str) -> None:
    spec, exports = float16_exports()
    for name, output in exports.items():
        reports = []
        for backend in (NUMPY, resolve("torch", device)):
            with using(backend):
                reports.append(run_checks(spec, [Expected("output", output, "out.npy")]))
        mine, theirs = reports[1], reports[0]
        assert (mine.backend, mine.device) == ("torch", str(torch.device(device)))
        assert (theirs.backend, theirs.device) == ("numpy", "cpu")
        assert mine.passed == theirs.passed == (name == "correct"), name
        assert [(c.name, c.status, c.summary) for c in mine.checks] == [
            (c.name, c.status, c.summary) for c in theirs.checks
        ], name


@pytest.mark.parametrize("fmt", ["bfloat16", "float8_e4m3fn"])
def test_inputs_in_formats_torch_cannot_take_from_numpy_are_computed_the_same(fmt: str) -> None:
    """bfloat16 and float8 files are ml_dtypes arrays, which torch cannot view."""
    rng = np.random.default_rng(6)
    q, k, v = (rng.normal(size=(1, 2, 24, 8)).astype(numpy_dtype(fmt)) for _ in range(3))
    spec = causal_spec(q, k, v)
    out = reference_output(spec).astype(numpy_dtype(fmt))  # an export in the format
    reports = []
    for backend in (NUMPY, resolve("torch")):
        with using(backend):
            reports.append(run_checks(spec, [Expected("output", out, "out.npy")]))
    assert reports[1].backend == "torch"
    assert [(c.name, c.status, c.summary) for c in reports[1].checks] == [
        (c.name, c.status, c.summary) for c in reports[0].checks
    ]


@pytest.mark.parametrize(("L", "S"), [(0, 5), (5, 0), (0, 0), (1, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_no_query_or_no_key_is_judged_the_same_on_both_backends(
    L: int, S: int, causal: bool
) -> None:
    """Regression: an output export of no query rows failed with an internal error."""
    rng = np.random.default_rng(8)
    q = rng.normal(size=(1, 2, L, 4)).astype(np.float16)
    k, v = (rng.normal(size=(1, 2, S, 4)).astype(np.float16) for _ in range(2))
    spec = build_spec(q, k, v, options=Options(causal=causal))
    out = reference_output(spec).astype(np.float16)
    reports = []
    for backend in (NUMPY, resolve("torch")):
        with using(backend):
            reports.append(run_checks(spec, [Expected("output", out, "out.npy")]))
    assert reports[0].passed
    assert [(c.name, c.status, c.summary) for c in reports[1].checks] == [
        (c.name, c.status, c.summary) for c in reports[0].checks
    ]


def test_a_device_without_float64_leaves_a_float64_run_to_numpy_and_computes_float32() -> None:
    """Apple's MPS has no float64: a float16 export's float32 reference is computed
    there, a float32 export's float64 one by numpy, and the report says which."""
    no_float64 = Backend("torch", "cpu", float64=False)
    rng = np.random.default_rng(4)
    q, k, v = (rng.normal(size=(1, 2, 24, 8)) for _ in range(3))
    for dtype, computed in (("float16", "torch"), ("float32", "numpy")):
        spec = causal_spec(*(a.astype(dtype) for a in (q, k, v)))
        out = np.asarray(reference_output(spec), dtype=dtype)
        with using(no_float64):
            report = run_checks(spec, [Expected("output", out, "out.npy")])
        assert report.passed
        assert report.backend == computed, dtype


def test_options_the_lean_pass_does_not_take_run_on_numpy_and_the_report_says_so() -> None:
    spec = make_spec(3, softcap=20.0)
    with using(resolve("torch")):
        report = run_checks(spec, [])
    assert (report.backend, report.device) == ("numpy", "cpu")


def test_a_run_on_torch_keeps_no_block_buffer_once_done() -> None:
    """A kernel test suite's GPU holds none of sdpa's block-sized buffers between calls."""
    with using(resolve("torch")):
        run_checks(make_spec(1, causal=True, L=40, S=40), [])
    pool = getattr(arrays._buffers, "pool", {})
    assert [key for key in pool if key[2] is not np] == []


class _Device:
    """A device with ``free`` bytes free, as :func:`online.block_shape` asks one."""

    def __init__(self, free: int) -> None:
        self.free = free

    def free_bytes(self) -> int:
        return self.free


def test_blocks_on_a_device_are_sized_from_its_free_memory_and_a_case_too_large_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = make_spec(0, L=64, S=30_000, E=64, Ev=64)
    gpu = Backend("torch", "cuda:0")
    monkeypatch.setattr(online, "namespace", lambda backend: _Device(4 << 30))
    rows, keys = online.block_shape(spec, gpu)
    assert keys == online.DEVICE_KEY_BLOCK
    # float64 scores of 8,192 keys: 8 arrays of them a row, in half the memory
    assert rows == min(
        online.DEVICE_ROWS,
        ((2 << 30) - 4 * 8 * 30_000 * 128)
        // (8 * (online.DEVICE_KEY_BLOCK * online.DEVICE_SCORE_ARRAYS + 4 * 128)),
    )
    monkeypatch.setattr(online, "namespace", lambda backend: _Device(40 << 20))
    with pytest.raises(
        SpecError, match=r"^--device: cuda:0 has 40 MiB free; a block of this case needs \d+ MiB"
    ):
        online.block_shape(spec, gpu)
    assert online.block_shape(spec, NUMPY) == (online.QUERY_BLOCK, online.KEY_BLOCK)
    rows, keys = online.block_shape(spec, Backend("torch", "cpu"))  # larger: fewer calls
    assert (rows, keys) == (4 * online.QUERY_BLOCK, 2 * online.KEY_BLOCK)


# --- choosing -----------------------------------------------------------------------------


def test_auto_is_torch_for_a_devices_tensors_and_numpy_on_the_cpu() -> None:
    """numpy computes the lean pass faster than torch on a CPU, whatever holds the
    tensors; torch's tensors on a device are computed there."""
    assert resolve("auto", None, (np.zeros(2),)) == NUMPY
    assert resolve("auto", None, (torch.zeros(2),)) == NUMPY
    assert resolve("torch", None, (torch.zeros(2),)) == Backend("torch", "cpu")
    assert resolve("torch") == Backend("torch", "cpu")
    assert resolve("auto", "cpu") == NUMPY
    if torch.cuda.is_available():
        on_gpu = resolve("auto", None, (torch.zeros(2, device="cuda"),))
        assert on_gpu.name == "torch"
        assert on_gpu.device.startswith("cuda")


def test_a_backend_is_used_only_inside_its_with_block() -> None:
    with using(Backend("torch", "cpu")):
        assert current().name == "torch"
    assert current() == NUMPY


@pytest.mark.parametrize(
    ("backend", "device", "message"),
    [
        ("jax", None, "--backend: expected one of auto, numpy, torch, got 'jax'"),
        ("numpy", "cuda", "--device: 'cuda' needs --backend torch"),
        ("torch", "tpu:7:x", "--device: expected cpu, cuda or cuda:N, got 'tpu:7:x'"),
    ],
)
def test_a_bad_backend_or_device_is_one_clear_error(
    backend: str, device: str | None, message: str
) -> None:
    with pytest.raises(SpecError, match="^" + message.replace("(", r"\(")):
        resolve(backend, device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_cuda_device_where_there_is_none_is_refused() -> None:
    with pytest.raises(SpecError, match="--device: 'cuda': torch sees no cuda device here"):
        resolve("torch", "cuda")
