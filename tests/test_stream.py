"""Tests of the streamed trace documents (:mod:`sdpa_cli.stream`): the JSON, YAML and
.npz written block by block are what the in-memory report writes for a trace kept whole
(:func:`sdpa_cli.report.payload`, ``np.savez`` of the whole trace), byte for byte; the
.npz appears whole or not at all; a disk too small is refused up front; memory does not
grow with the output."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import yaml
from clirunner import assert_one_error_line, invoke
from numpy.typing import NDArray

from sdpa_cli import stream, stream_save
from sdpa_cli.diagnosis.findings import Diagnosis
from sdpa_cli.diagnosis.rules import diagnose
from sdpa_cli.engine import driver
from sdpa_cli.engine.block import applicable_stages
from sdpa_cli.engine.options import Options, parse_options
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.engine.trace import Trace, trace
from sdpa_cli.errors import InputError
from sdpa_cli.names import STAGES
from sdpa_cli.report import diagnosis_payload, payload, to_json, to_yaml
from sdpa_cli.text import json_number

QKV = ("q.npy", "k.npy", "v.npy")

# --- cases -------------------------------------------------------------------------------


class Case(NamedTuple):
    spec: Callable[[np.random.Generator], AttentionSpec]
    stages: tuple[str, ...] | None = None  # None: every stage
    skips_keys: bool = False  # blocks skip keys: the statistics' sums may differ in an ulp


def _qkv(rng: np.random.Generator, q: tuple[int, ...], s: int, ev: int | None = None) -> Any:
    *lead, _, e = q
    return (
        rng.standard_normal(q),
        rng.standard_normal((*lead, s, e)),
        rng.standard_normal((*lead, s, ev or e)),
    )


def _spec(q: Any, k: Any, v: Any, **options: Any) -> AttentionSpec:
    bias, mask = options.pop("bias", None), options.pop("mask", None)
    return build_spec(q, k, v, bias=bias, mask=mask, options=Options(**options))


def _nonfinite(rng: np.random.Generator) -> AttentionSpec:
    q, k, v = _qkv(rng, (2, 3, 2), 4)
    q[0, 0, 0], q[1, 2, 1], v[0, 1, 0] = np.inf, -np.inf, np.nan
    return _spec(q, k, v)


def _exact_values(rng: np.random.Generator) -> AttentionSpec:
    # Q = 0 makes the biased logits the bias itself: bare exponents (1e-05 is 1.0e-05
    # in YAML), -0.0, huge and subnormal values reach the document unchanged.
    bias = np.array([[1e-05, -0.0, 1e16, -5e-324], [2e-300, 1.5e-07, -1e20, 0.1]])
    return _spec(np.zeros((2, 3)), rng.standard_normal((4, 3)), np.ones((4, 1)), bias=bias)


def _float_mask(rng: np.random.Generator) -> AttentionSpec:
    q, k, v = _qkv(rng, (2, 4, 3), 5)
    mask = rng.standard_normal((4, 5))
    mask[rng.random((4, 5)) < 0.3] = -np.inf
    return _spec(q, k, v, mask=mask)


CASES: dict[str, Case] = {
    "plain": Case(lambda r: _spec(*_qkv(r, (2, 3, 4), 5, 3))),
    "causal-batched": Case(
        lambda r: _spec(*_qkv(r, (2, 2, 6, 3), 6), causal=True), skips_keys=True
    ),
    "causal-lower-right-fully-masked": Case(
        lambda r: _spec(*_qkv(r, (2, 7, 2), 4), causal=True, causal_align="lower-right"),
        skips_keys=True,
    ),
    "every-optional-stage": Case(
        lambda r: _spec(
            *_qkv(r, (1, 2, 4, 3), 5),
            softcap=2.0,
            bias=r.standard_normal((4, 5)),
            alibi=True,
            dropout=0.3,
            seed=7,
        )
    ),
    "bool-mask": Case(lambda r: _spec(*_qkv(r, (3, 4, 2), 6), mask=r.random((3, 4, 6)) < 0.6)),
    "float-mask-inf": Case(_float_mask),
    "key-lengths": Case(
        lambda r: _spec(*_qkv(r, (2, 1, 5, 3), 6), key_lengths=(4, 6)), skips_keys=True
    ),
    "window": Case(lambda r: _spec(*_qkv(r, (1, 9, 2), 9), window=(2, 0)), skips_keys=True),
    "float16-overflow": Case(
        lambda r: _spec(*(a * 60 for a in _qkv(r, (2, 3, 8), 4)), dtype="float16")
    ),
    "float32-native": Case(
        lambda r: _spec(
            *_qkv(r, (2, 3, 4), 5),
            dtype="float32",
            accumulate="float32",
            softmax_dtype="float32",
            logits_dtype="float32",
        )
    ),
    "heads": Case(lambda r: _spec(*_qkv(r, (2, 5, 4), 6, 6), heads=2)),
    "heads-output-only": Case(
        lambda r: _spec(*_qkv(r, (3, 2, 6), 4), heads=3, causal=True), stages=("output",)
    ),
    "grouped-query": Case(
        lambda r: _spec(r.standard_normal((1, 4, 3, 2)), *_qkv(r, (1, 2, 5, 2), 5)[1:])
    ),
    "one-element-dims": Case(lambda r: _spec(*_qkv(r, (1, 1, 1, 1), 1))),
    "nonfinite": Case(_nonfinite),
    "exact-values": Case(_exact_values),
    "no-queries": Case(lambda r: _spec(*_qkv(r, (2, 0, 3), 4))),
    "no-keys": Case(lambda r: _spec(*_qkv(r, (2, 3, 3), 0, 2))),
    "weights-and-output": Case(
        lambda r: _spec(*_qkv(r, (2, 4, 3), 4), causal=True), stages=("weights", "output")
    ),
    "output-only-masked": Case(
        lambda r: _spec(*_qkv(r, (2, 4, 3), 4), key_lengths=(2,)),
        stages=("output",),
        skips_keys=True,
    ),
    "a-stage-not-brought-about": Case(
        lambda r: _spec(*_qkv(r, (2, 3, 2), 3)), stages=("capped", "masked")
    ),
}

BLOCKS = {"blocks-default": driver.BLOCK_ELEMENTS, "blocks-of-a-few-rows": 11}


@pytest.fixture(params=list(BLOCKS))
def block_elements(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Blocks as the engine makes them, and blocks of one or two rows (several blocks
    per slice, so that every seam between blocks and slices is written)."""
    n = BLOCKS[request.param]
    monkeypatch.setattr(driver, "BLOCK_ELEMENTS", n)
    return n


def _case(name: str) -> tuple[AttentionSpec, tuple[str, ...]]:
    case = CASES[name]
    spec = case.spec(np.random.default_rng(sum(map(ord, name))))
    return spec, case.stages or applicable_stages(spec)


# --- documents, old and new ---------------------------------------------------------------


def streamed(spec: AttentionSpec, stages: tuple[str, ...], fmt: str, jobs: int = 1) -> str:
    """What ``sdpa compute --format json|yaml`` writes: statistics, then the stream."""
    stats = trace(spec, stages=stream.trace_stages(spec, stages), summarize=stages)
    parts: list[str] = []
    stream.write_document(stats, stages, diagnose(stats), parts.append, fmt=fmt, jobs=jobs)
    return "".join(parts)


def in_memory(
    spec: AttentionSpec, stages: tuple[str, ...], fmt: str, diagnosis: Diagnosis | None = None
) -> str:
    """The document as ``sdpa compute`` built it before streaming: the stages kept
    whole, nested lists dumped at once; the findings of that trace unless given."""
    whole = trace(spec, stages=stages, summarize=stages)
    data = payload(whole, stages, diagnosis or diagnose(whole), for_json=fmt == "json")
    return to_json(data) + "\n" if fmt == "json" else to_yaml(data)


@pytest.mark.parametrize("fmt", ["json", "yaml"])
@pytest.mark.parametrize("name", list(CASES))
def test_streamed_document_is_byte_for_byte_the_in_memory_one(
    name: str, fmt: str, block_elements: int
) -> None:
    spec, stages = _case(name)
    expected_findings = None
    if CASES[name].skips_keys:  # the statistics come from blocks that skip hidden keys
        expected_findings = diagnose(trace(spec, stages=(), summarize=stages))
    assert streamed(spec, stages, fmt) == in_memory(spec, stages, fmt, expected_findings)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not c.skips_keys])
def test_findings_are_todays_when_no_block_skips_keys(name: str, block_elements: int) -> None:
    """Where no key is skipped, the whole document is today's: its findings too."""
    spec, stages = _case(name)
    stats_only = diagnose(trace(spec, stages=(), summarize=stages))
    whole = diagnose(trace(spec, stages=stages, summarize=stages))
    assert to_json(diagnosis_payload(stats_only, for_json=True)) == to_json(
        diagnosis_payload(whole, for_json=True)
    )


def test_streamed_document_with_threads(block_elements: int) -> None:
    spec, stages = _case("heads")
    for fmt in ("json", "yaml"):
        assert streamed(spec, stages, fmt, jobs=3) == streamed(spec, stages, fmt, jobs=1)


def _canonical(value: Any) -> Any:
    """Floats as their repr (NaN equals NaN, -0.0 differs from 0.0), recursively."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return ("float", repr(value))
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    return [_canonical(v) for v in value]


@pytest.mark.parametrize(
    "name",
    ["nonfinite", "exact-values", "one-element-dims", "float-mask-inf", "heads", "no-keys"],
)
def test_streamed_yaml_and_json_load_to_the_payload(name: str, block_elements: int) -> None:
    spec, stages = _case(name)
    whole = trace(spec, stages=stages, summarize=stages)
    findings = diagnose(trace(spec, stages=(), summarize=stages))
    for fmt, load in (("yaml", yaml.safe_load), ("json", json.loads)):
        data = payload(whole, stages, findings, for_json=fmt == "json")
        assert _canonical(load(streamed(spec, stages, fmt))) == _canonical(data)
    if name == "exact-values":
        text = streamed(spec, stages, "yaml")
        for word in ("1.0e-05", "-5.0e-324", "1.0e+16"):
            assert word in text


# --- the array writers on arbitrary arrays -------------------------------------------------


def _blocks_of(a: NDArray[Any], rng: np.random.Generator) -> Iterator[stream.Rows]:
    """``a`` (…, L, last) as rows in blocks of random sizes, slice by slice."""
    for lead in np.ndindex(*a.shape[:-2]):
        i = 0
        while i < a.shape[-2]:
            n = int(rng.integers(1, 4))
            yield lead, i, a[lead][i : i + n]
            i += n


def _special(rng: np.random.Generator, shape: tuple[int, ...]) -> NDArray[Any]:
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e16, 1e-05, -2e-07, 5e-324, 1.5e300]
    a = rng.standard_normal(shape) * 10.0 ** rng.integers(-30, 30, shape)
    pick = rng.random(shape) < 0.3
    a[pick] = rng.choice(specials, int(pick.sum()))
    return a


def _json_lists(a: NDArray[Any]) -> str:
    def fix(node: Any) -> Any:
        return [fix(n) for n in node] if isinstance(node, list) else json_number(node)

    return json.dumps(a.tolist() if a.dtype == np.bool_ else fix(a.tolist()))


def _written(write: Callable[[stream._Out], None]) -> str:
    parts: list[str] = []
    out = stream._Out(parts.append)
    write(out)
    out.flush()
    return "".join(parts)


@pytest.mark.parametrize("seed", range(40))
def test_array_writers_are_json_dumps_and_pyyaml(seed: int) -> None:
    """Random shapes (axes of 1 included), blocks of random sizes, floats of every
    magnitude with NaN, ±inf, -0.0, bare exponents; booleans."""
    rng = np.random.default_rng(seed)
    ndim = int(rng.integers(2, 6))
    shape = (*(int(x) for x in rng.integers(1, 4, ndim - 1)), int(rng.integers(1, 60)))
    for a in (_special(rng, shape), rng.random(shape) < 0.5, rng.standard_normal(shape)):
        yaml_text = _written(partial(stream._yaml_array, "x", shape, _blocks_of(a, rng)))
        assert yaml_text == to_yaml({"x": a.tolist()})
        assert _canonical(yaml.safe_load(yaml_text)) == _canonical({"x": a.tolist()})
        json_text = _written(partial(stream._json_array, shape, _blocks_of(a, rng)))
        assert json_text == _json_lists(a)


def test_yaml_rows_nested_deeper_than_the_width() -> None:
    """Past 49 axes a row's flow sequence opens beyond column 100: PyYAML breaks the
    line before its first item too."""
    shape = (1,) * 50 + (3,)
    a = np.arange(3.0).reshape(shape)
    rng = np.random.default_rng(0)
    text = _written(lambda out: stream._yaml_array("x", shape, _blocks_of(a, rng), out))
    assert text == to_yaml({"x": a.tolist()})


# --- --save --------------------------------------------------------------------------------


def save_npz(kept: Trace, path: str) -> None:
    """The reference: every stage of a trace kept whole, and ``visible``, by ``np.savez``."""
    arrays: dict[str, Any] = {}
    for name in STAGES:
        arr = kept.merged_output if name == "output" else kept.stage(name)
        if arr is not None:
            arrays[name] = arr
    assert kept.visible is not None
    np.savez(path, **arrays, visible=kept.visible)


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_npz_holds_what_savez_wrote(
    name: str, tmp_path: Path, block_elements: int
) -> None:
    spec, _ = _case(name)
    save_npz(trace(spec), str(tmp_path / "old.npz"))
    stream_save.save_npz(spec, str(tmp_path / "new.npz"), jobs=2)
    with np.load(tmp_path / "old.npz") as old, np.load(tmp_path / "new.npz") as new:
        assert new.files == old.files
        for member in old.files:
            assert new[member].dtype == old[member].dtype
            assert new[member].shape == old[member].shape
            assert new[member].tobytes() == old[member].tobytes(), member
    # The same .npy members, header and all: only the zip's timestamps differ.
    assert os.path.getsize(tmp_path / "new.npz") == os.path.getsize(tmp_path / "old.npz")
    assert os.path.getsize(tmp_path / "new.npz") <= stream_save.npz_bytes(spec)


def _fails_on_call(n: int, real: Callable[..., Any], exc: BaseException) -> Callable[..., Any]:
    calls = 0

    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == n:
            raise exc
        return real(*args, **kwargs)

    return call


@pytest.mark.parametrize(
    ("where", "exc", "raised"),
    [
        # The disk fills while the blocks are written to the temporary files...
        ("os.pwrite", OSError(28, "No space left on device"), InputError),
        # ... or while the third member is copied into the .npz; or Ctrl-C then.
        ("shutil.copyfileobj", RuntimeError("disk on fire"), RuntimeError),
        ("shutil.copyfileobj", KeyboardInterrupt(), KeyboardInterrupt),
    ],
)
def test_failed_save_leaves_nothing_and_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, exc: BaseException, raised: type
) -> None:
    """A failure midway leaves no file, no temporary file, and the file the .npz
    would replace as it was."""
    spec, _ = _case("causal-batched")
    (tmp_path / "kept.npz").write_bytes(b"old")
    module, name = where.split(".")
    target = {"os": os, "shutil": shutil}[module]
    for path in ("kept.npz", "new.npz"):
        monkeypatch.setattr(target, name, _fails_on_call(3, getattr(target, name), exc))
        with pytest.raises(raised):
            stream_save.save_npz(spec, str(tmp_path / path))
        monkeypatch.undo()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.npz"]
        assert (tmp_path / "kept.npz").read_bytes() == b"old"
    if raised is InputError:  # the disk error names the file, as every write error does
        monkeypatch.setattr(os, "pwrite", _fails_on_call(1, os.pwrite, exc))
        with pytest.raises(InputError, match=r"new\.npz: cannot be written: No space left"):
            stream_save.save_npz(spec, str(tmp_path / "new.npz"))


def test_save_room_holds_the_file_and_its_largest_member_twice() -> None:
    spec, _ = _case("every-optional-stage")
    assert stream_save.save_room(spec) == stream_save.npz_bytes(spec) + 8 * math.prod(
        spec.weights_shape
    )


def test_npz_bytes_counts_every_stage_and_the_visibility() -> None:
    spec, _ = _case("every-optional-stage")
    scores, out = math.prod(spec.weights_shape), math.prod(spec.merged_output_shape)
    values = 8 * scores * (len(STAGES) - 1) + 8 * out + scores
    assert values < stream_save.npz_bytes(spec) <= values + len(STAGES) * 4096 + 4096


def _tiny_disk(free: int) -> Callable[[str], Any]:
    def usage(path: str) -> Any:
        return shutil._ntuple_diskusage(10**12, 10**12 - free, free)

    return usage


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_save_is_refused_up_front_when_the_disk_is_too_small(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    rng = np.random.default_rng(0)
    for name, arr in zip("qkv", _qkv(rng, (2, 30, 4), 40), strict=True):
        np.save(workdir / f"{name}.npy", arr)
    monkeypatch.setattr(shutil, "disk_usage", _tiny_disk(50_000))
    args = ["compute", *QKV, "--save", "t.npz", "--format", fmt]
    line = assert_one_error_line(invoke(*args))
    assert line.startswith("sdpa: error: t.npz: needs 0.0 GiB of disk while it is written ")
    assert "(4 stages of (2, 30, 40) in float64, the output and the visibility, " in line
    assert "but 0.0 GiB is free on its disk" in line
    assert sorted(p.name for p in workdir.iterdir()) == ["k.npy", "q.npy", "v.npy"]
    # With room it is written.
    monkeypatch.setattr(shutil, "disk_usage", _tiny_disk(10**9))
    assert invoke(*args).exit_code == 0
    assert (workdir / "t.npz").exists()


def test_document_is_refused_when_the_file_stdout_goes_to_cannot_hold_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, stages = _case("plain")  # 2 · 3 · 5 scores, 2 · 3 · 3 outputs: 4 · 30 + 18 numbers
    need = stream.DOCUMENT_BYTES_PER_NUMBER * (4 * 30 + 18)
    with open(tmp_path / "out.json", "w") as fh:
        for free, refused in ((need - 1, True), (need, False)):
            monkeypatch.setattr(os, "fstatvfs", lambda fd, n=free: _Disk(n, 1))
            if refused:
                with pytest.raises(InputError, match=r"^stdout: the YAML document needs"):
                    stream.check_document_room(spec, stages, "yaml", fh.fileno())
            else:
                stream.check_document_room(spec, stages, "yaml", fh.fileno())
    # A pipe, a terminal, no file at all: nothing to measure, nothing refused.
    monkeypatch.setattr(os, "fstatvfs", lambda fd: _Disk(0, 1))
    read, write = os.pipe()
    try:
        stream.check_document_room(spec, stages, "json", write)
    finally:
        os.close(read)
        os.close(write)
    stream.check_document_room(spec, stages, "json", -1)


class _Disk(NamedTuple):
    f_bavail: int
    f_frsize: int


@pytest.mark.e2e
def test_e2e_document_too_large_for_the_disk_is_refused_before_any_byte(tmp_path: Path) -> None:
    """Q, K, V of 2,000,000 rows: at least 80 TB of JSON; stdout is a file, which stays
    empty, and the refusal is one line, at once."""
    for name in "qkv":
        np.save(tmp_path / f"{name}.npy", np.zeros((1, 1, 2_000_000, 1), np.float16))
    with open(tmp_path / "out.json", "w") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "sdpa_cli", "compute", *QKV, "--format", "json"],
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2
    assert proc.stderr.startswith("sdpa: error: stdout: the JSON document needs at least ")
    assert proc.stderr.count("\n") == 1
    assert (tmp_path / "out.json").read_text() == ""


@pytest.mark.e2e
@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_e2e_a_reader_that_goes_away_is_not_an_error(tmp_path: Path, fmt: str) -> None:
    """``sdpa compute ... --format json | head -c 100``: exit 0 and nothing on stderr,
    as before the document was streamed (click alone would exit 1)."""
    for name, arr in zip("qkv", _qkv(np.random.default_rng(0), (2, 2, 200, 8), 200), strict=True):
        np.save(tmp_path / f"{name}.npy", arr)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sdpa_cli", "compute", *QKV, "--format", fmt],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    assert len(proc.stdout.read(100)) == 100
    proc.stdout.close()  # the document is 10 MB: the writer is far from done
    assert proc.wait(timeout=60) == 0
    assert proc.stderr.read() == b""
    proc.stderr.close()


# --- the command line ------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        ["--format", "json"],
        ["--format", "yaml", "--causal"],
        ["--format", "json", "--stages", "weights,output", "--save", "t.npz"],
        ["--format", "yaml", "--dtype", "float16", "--heads", "2"],
    ],
)
def test_compute_prints_the_in_memory_document(workdir: Path, extra: list[str]) -> None:
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, (2, 5, 4), 6)
    for name, arr in zip("qkv", (q, k, v), strict=True):
        np.save(workdir / f"{name}.npy", arr)
    result = invoke("compute", *QKV, *extra)
    assert result.exit_code == 0, result.stderr
    options: dict[str, Any] = {"causal": True} if "--causal" in extra else {}
    if "--dtype" in extra:
        options.update(dtype="float16", heads=2)
    # as the command parses them: those given are kept as typed too
    spec = build_spec(q, k, v, options=parse_options(options), names=dict.fromkeys("qkv", ""))
    stages = ("weights", "output") if "--stages" in extra else applicable_stages(spec)
    fmt = extra[1]
    # the command's findings come from the statistics' pass, which skips hidden keys
    # (a trace keeping every stage sums other blocks: the last ulp may move with the
    # CPU's BLAS kernel)
    findings = diagnose(trace(spec, stages=(), summarize=stages))
    assert result.stdout == in_memory(spec, stages, fmt, findings)
    if "--save" in extra:
        with np.load(workdir / "t.npz") as npz:
            assert npz.files == [*applicable_stages(spec), "visible"]


# --- memory --------------------------------------------------------------------------------


def _peak(run: Callable[[], object]) -> int:
    """The peak of Python's allocations while ``run`` runs."""
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_does_not_grow_with_the_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With blocks of 4096 scores (and copies of 64 KiB), the peak of Python's
    allocations while streaming stays the same when the output grows fourfold, and a
    small fraction of a document of 10 MB (held in memory, its numbers cost about 90
    bytes each); the .npz likewise."""
    monkeypatch.setattr(driver, "BLOCK_ELEMENTS", 4096)
    monkeypatch.setattr(stream_save, "_COPY_BYTES", 1 << 16)
    peaks: dict[tuple[str, int], int] = {}
    sizes: dict[tuple[str, int], int] = {}
    for n in (128, 256):
        spec = _spec(*_qkv(np.random.default_rng(1), (2, n, 8), n), causal=True)
        stages = applicable_stages(spec)
        stats = trace(spec, stages=(), summarize=stages)
        findings = diagnose(stats)
        for fmt in ("json", "yaml"):
            size = 0

            def count(text: str) -> None:
                nonlocal size
                size += len(text)

            write = partial(stream.write_document, stats, stages, findings, count, fmt=fmt)
            peaks[fmt, n] = _peak(write)
            sizes[fmt, n] = size
        path = str(tmp_path / f"{n}.npz")
        peaks["npz", n] = _peak(partial(stream_save.save_npz, spec, path))
        sizes["npz", n] = os.path.getsize(path)
    for fmt in ("json", "yaml", "npz"):
        assert sizes[fmt, 256] > 4 * sizes[fmt, 128] * 0.9
        assert peaks[fmt, 256] < 1.25 * peaks[fmt, 128], (fmt, peaks)
        assert peaks[fmt, 256] < sizes[fmt, 256] / 4, (fmt, peaks, sizes)


def test_progress_counts_every_score_once_over_all_sweeps(tmp_path: Path) -> None:
    spec, stages = _case("causal-batched")
    stats = trace(spec, stages=(), summarize=stages)
    told: list[int] = []
    stream.write_document(stats, stages, None, lambda _: None, fmt="json", progress=told.append)
    assert sum(told) == math.prod(spec.weights_shape)
    told.clear()
    stream_save.save_npz(spec, str(tmp_path / "t.npz"), progress=told.append)
    assert sum(told) == math.prod(spec.weights_shape)
