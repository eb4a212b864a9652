"""The blocked engine equals the one-shot computation, to rounding.

The engine computes attention one block of query rows at a time (``attend_block``),
skips the keys a causal mask, a window or key padding hides from a whole block
(``key_range``), may run blocks on several threads (``sweep``), and sets exp's
arguments below the denormal floor to −inf (``DENORMAL_FLOOR``). None of this may
show in the answer. Each test below states one way it could, and rules it out
against a whole-array computation written here in plain numpy (``one_shot``), or
against the engine run another way (no skipping, one thread, no guard).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from clirunner import invoke
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray
from reference import paper_alibi_slopes

import sdpa_cli.check.compare
import sdpa_cli.engine.block
import sdpa_cli.engine.driver
import sdpa_cli.engine.softmax
from sdpa_cli.check.compare import Mismatch, compare
from sdpa_cli.check.elements import v_range
from sdpa_cli.check.records import CheckReport, Expected
from sdpa_cli.check.run import run_checks
from sdpa_cli.diagnosis.rules import diagnose
from sdpa_cli.engine.block import attend_block, block_lse, key_range, native_dtype, visibility
from sdpa_cli.engine.driver import block_rows, iter_blocks
from sdpa_cli.engine.options import Options
from sdpa_cli.engine.records import product_moments
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.engine.stats import Stats
from sdpa_cli.engine.trace import Trace, trace
from sdpa_cli.errors import ExitCode

F64 = NDArray[np.float64]
RTOL = 1e-12
ATOL = 1e-14
BLOCKINGS = (1, 3, 7, None)
"""Query rows per block: one row (BLAS's gemv path), blocks cut inside every mask, the default."""

BOUNDED = settings(max_examples=40, deadline=None)
ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted(p.name for p in (ROOT / "samples").glob("*.yaml"))

FLOAT32_RUN: dict[str, Any] = {
    "dtype": "float32",
    "accumulate": "float32",
    "softmax_dtype": "float32",
    "logits_dtype": "float32",
}
"""Options of a run in float32 throughout: the engine computes in float32 directly."""


def normal(seed: int, *shape: int) -> F64:
    return np.random.default_rng(seed).normal(size=shape)


# --- the one-shot reference ---------------------------------------------------------------


@dataclass(frozen=True)
class OneShot:
    """Whole arrays: the masked logits (B, H, L, S), which keys each row may see (a
    float mask's sentinels, ≤ −1e4, hide theirs), the weights and the output (B, H, L, Ev)."""

    masked: F64
    visible: NDArray[np.bool_]
    weights: F64
    output: F64


def one_shot(
    q: F64,
    k: F64,
    v: F64,
    *,
    bias: F64 | None = None,
    mask: NDArray[Any] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    alibi: bool = False,
    causal: bool = False,
    causal_align: str = "upper-left",
    window: tuple[int, int] | None = None,
    key_lengths: tuple[int, ...] | None = None,
    mask_true_means: str = "attend",
    mask_value: float = -math.inf,
) -> OneShot:
    """Attention over whole arrays in float64: Q (B, H, L, E), K and V (B, G, S, ·) with
    G dividing H; ``bias`` and ``mask`` broadcast to (B, H, L, S)."""
    B, H, L, E = q.shape
    S = k.shape[-2]
    group = H // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # head h reads h // group
    factor = 1 / math.sqrt(E) if scale is None else scale
    logits = np.einsum("BHLE,BHSE->BHLS", q, k) * factor
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    if bias is not None:
        logits = logits + bias
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    if alibi:
        slopes = np.array(paper_alibi_slopes(H))
        logits = logits - slopes[:, None, None] * np.abs(i + S - L - j)

    offset = S - L if causal_align == "lower-right" else 0
    visible = np.ones((B, H, L, S), dtype=np.bool_)
    if causal:
        visible &= np.tril(np.ones((L, S), dtype=np.bool_), k=offset)
    if window is not None:
        left, right = window
        in_window = np.zeros((L, S), dtype=np.bool_)
        for row in range(L):
            for key in range(S):
                in_window[row, key] = -left <= key - row - offset <= right
        visible &= in_window
    if key_lengths is not None:
        for b in range(B):
            n = key_lengths[b if len(key_lengths) > 1 else 0]
            visible[b, :, :, n:] = False
    if mask is not None and mask.dtype == np.bool_:
        visible &= ~mask if mask_true_means == "masked" else mask
    elif mask is not None:
        logits = logits + mask
    masked = np.where(visible, logits, mask_value)
    if mask is not None and mask.dtype != np.bool_:
        visible = visible & ~(mask <= -1e4)  # a sentinel hides its key, added as given

    top = masked.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        e = np.exp(masked - np.where(top == -math.inf, 0.0, top))  # a row of −inf: exp → 0
    total = e.sum(axis=-1, keepdims=True)
    weights = e / np.where(total == 0, 1.0, total)  # no visible key: zeros, not 0/0
    return OneShot(masked, visible, weights, weights @ v)


def assert_matches_one_shot(got: Trace, want: OneShot, label: str = "") -> None:
    """Masked logits on the visible keys, hidden ones at the mask value, weights, output."""
    assert got.visible is not None
    assert got.masked is not None
    assert got.weights is not None
    assert got.output is not None
    np.testing.assert_array_equal(got.visible, want.visible, err_msg=label)
    np.testing.assert_allclose(
        got.masked[want.visible], want.masked[want.visible], rtol=RTOL, atol=ATOL, err_msg=label
    )
    hidden = ~want.visible  # at the mask value, or a float mask's sentinel added
    np.testing.assert_allclose(
        got.masked[hidden], want.masked[hidden], rtol=RTOL, atol=ATOL, err_msg=label
    )
    np.testing.assert_allclose(got.weights, want.weights, rtol=RTOL, atol=ATOL, err_msg=label)
    np.testing.assert_allclose(got.output, want.output, rtol=RTOL, atol=ATOL, err_msg=label)


@dataclass(frozen=True)
class Problem:
    """Inputs and options, for the engine (``spec``) and for :func:`one_shot` (``kwargs``)."""

    q: F64
    k: F64
    v: F64
    bias: F64 | None
    mask: NDArray[Any] | None
    options: dict[str, Any]

    @property
    def spec(self) -> AttentionSpec:
        return build_spec(
            self.q, self.k, self.v, bias=self.bias, mask=self.mask, options=Options(**self.options)
        )

    def one_shot(self) -> OneShot:
        return one_shot(self.q, self.k, self.v, bias=self.bias, mask=self.mask, **self.options)


MASK_KINDS = ("none", "bool", "bool-masked", "float")


def make_problem(
    data_seed: int,
    /,
    *,
    B: int = 2,
    H: int = 2,
    G: int = 2,
    L: int = 6,
    S: int = 7,
    E: int = 3,
    Ev: int = 2,
    mask_kind: str = "none",
    bias: bool = False,
    **options: Any,
) -> Problem:
    """Random Q (B, H, L, E), K and V (B, G, S, ·) (G < H: grouped-query attention); a boolean mask (``bool``: True
    attends, ``bool-masked``: True hides) or a float mask with −inf entries; a bias."""
    rng = np.random.default_rng(data_seed)
    q, k, v = (
        rng.normal(size=(B, H, L, E)),
        rng.normal(size=(B, G, S, E)),
        rng.normal(size=(B, G, S, Ev)),
    )
    mask: NDArray[Any] | None = None
    if mask_kind in ("bool", "bool-masked"):
        mask = rng.random((B, H, L, S)) > 0.3
        if mask_kind == "bool-masked":
            mask = ~mask
            options["mask_true_means"] = "masked"
    elif mask_kind == "float":
        mask = rng.normal(size=(L, S))
        mask[rng.random((L, S)) < 0.25] = -math.inf
    return Problem(q, k, v, rng.normal(size=(H, L, S)) if bias else None, mask, options)


@st.composite
def problems(draw: st.DrawFn) -> Problem:
    """Small random problems with any combination of the mask options."""
    G, group = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    B, L, S = draw(st.integers(1, 2)), draw(st.integers(1, 9)), draw(st.integers(1, 9))
    options: dict[str, Any] = {
        "causal": draw(st.booleans()),
        "causal_align": draw(st.sampled_from(["upper-left", "lower-right"])),
        "window": draw(st.none() | st.tuples(st.integers(0, 4), st.integers(0, 4))),
        "alibi": draw(st.booleans()),
        "softcap": draw(st.sampled_from([None, 2.0])),
        "mask_value": draw(st.sampled_from([-math.inf, -1e9])),
    }
    if draw(st.booleans()):
        options["key_lengths"] = tuple(draw(st.lists(st.integers(0, S), min_size=B, max_size=B)))
    return make_problem(
        draw(st.integers(0, 2**32 - 1)),
        B=B,
        H=G * group,
        G=G,
        L=L,
        S=S,
        E=draw(st.integers(1, 4)),
        Ev=draw(st.integers(1, 3)),
        mask_kind=draw(st.sampled_from(MASK_KINDS)),
        bias=draw(st.booleans()),
        **options,
    )


# --- 1. any blocking equals the one-shot computation --------------------------------------


def test_one_shot_reference_agrees_with_the_loop_reference() -> None:
    """The test's own reference is checked once against ``reference.py``'s loops."""
    from reference import attention

    p = make_problem(
        1,
        G=1,
        L=5,
        S=7,
        mask_kind="float",
        bias=True,
        causal=True,
        alibi=True,
        softcap=2.0,
        window=(2, 1),
        key_lengths=(3, 7),
        causal_align="lower-right",
    )
    loops = attention(p.q, p.k, p.v, bias=p.bias, mask=p.mask, **p.options)
    mine = p.one_shot()
    np.testing.assert_array_equal(mine.visible, loops.visible)
    np.testing.assert_allclose(mine.weights, loops.weights, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(mine.output, loops.output, rtol=1e-13, atol=1e-15)


BLOCKED_CASES: dict[str, dict[str, Any]] = {
    # L < S and L > S, both alignments: under lower-right with L > S the first L − S
    # rows see no key at all, and blocks of 3 or 7 rows end inside them.
    "causal-upper-left-L<S": {"L": 10, "S": 13, "causal": True},
    "causal-upper-left-L>S": {"L": 13, "S": 6, "causal": True},
    "causal-lower-right-L<S": {"L": 10, "S": 13, "causal": True, "causal_align": "lower-right"},
    "causal-lower-right-L>S": {"L": 13, "S": 6, "causal": True, "causal_align": "lower-right"},
    # Windows narrower than a block, wider than a block, one-sided, off the keys' end.
    "window-cut-by-blocks": {"L": 12, "S": 12, "window": (2, 1)},
    "window-wide": {"L": 9, "S": 14, "window": (8, 5)},
    "window-left-only": {"L": 11, "S": 8, "window": (3, 0), "causal_align": "lower-right"},
    "window-beyond-keys": {"L": 12, "S": 5, "window": (0, 0)},
    "window-and-causal": {"L": 11, "S": 11, "window": (4, 4), "causal": True},
    "key-lengths-with-0": {"L": 8, "S": 9, "key_lengths": (0, 4)},
    "key-lengths-and-causal": {"L": 8, "S": 9, "key_lengths": (9, 2), "causal": True},
    "bool-mask": {"L": 9, "S": 8, "mask_kind": "bool"},
    "bool-mask-true-means-masked": {"L": 9, "S": 8, "mask_kind": "bool-masked", "causal": True},
    "float-mask-with-inf": {"L": 9, "S": 8, "mask_kind": "float"},
    "alibi": {"L": 7, "S": 11, "alibi": True},
    "softcap-and-bias": {"L": 7, "S": 11, "softcap": 1.5, "bias": True},
    "gqa": {"L": 8, "S": 10, "G": 1, "causal": True, "causal_align": "lower-right"},
    "finite-mask-value": {
        "L": 13,
        "S": 6,
        "causal": True,
        "causal_align": "lower-right",
        "mask_value": -1e9,
    },
    "everything": {
        "L": 10,
        "S": 12,
        "G": 1,
        "causal": True,
        "causal_align": "lower-right",
        "window": (3, 1),
        "key_lengths": (12, 5),
        "mask_kind": "float",
        "alibi": True,
        "softcap": 3.0,
        "bias": True,
    },
}


@pytest.mark.parametrize("case", BLOCKED_CASES.values(), ids=BLOCKED_CASES.keys())
def test_every_blocking_equals_the_one_shot_computation(case: dict[str, Any]) -> None:
    p = make_problem(11, **case)
    want = p.one_shot()
    spec = p.spec
    for rows in BLOCKINGS:
        assert_matches_one_shot(trace(spec, rows=rows), want, f"rows={rows}")


@BOUNDED
@given(problems())
def test_random_problems_equal_the_one_shot_computation(p: Problem) -> None:
    want, spec = p.one_shot(), p.spec
    for rows in BLOCKINGS:
        assert_matches_one_shot(trace(spec, rows=rows), want, f"rows={rows}")


def test_dropout_keep_mask_is_by_position_whatever_the_blocking() -> None:
    """Dropout is not in the one-shot reference (its keep-mask is the engine's Philox
    stream), so blockings are compared to each other: the same elements dropped, the
    same values to rounding, and without dropout the same weights."""
    p = make_problem(
        12,
        H=4,
        L=11,
        S=9,
        causal=True,
        causal_align="lower-right",
        window=(5, 2),
        key_lengths=(9, 3),
        dropout=0.3,
        seed=5,
    )
    spec = p.spec
    runs = [trace(spec, rows=rows) for rows in BLOCKINGS]
    first = runs[0]
    assert first.dropped is not None
    assert first.weights is not None
    assert (first.dropped == 0).any()
    before = dataclasses.replace(
        p, options={k: v for k, v in p.options.items() if k not in ("dropout", "seed")}
    ).one_shot()
    np.testing.assert_allclose(first.weights, before.weights, rtol=RTOL, atol=ATOL)
    for other in runs[1:]:
        assert other.dropped is not None
        np.testing.assert_array_equal(other.dropped == 0, first.dropped == 0)
        for name in ("weights", "dropped", "output"):
            a, b = other.stage(name), first.stage(name)
            assert a is not None
            assert b is not None
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=name)


# --- 2. key skipping --------------------------------------------------------------------


def finding_keys(t: Trace | Stats) -> list[tuple[Any, ...]]:
    """What identifies a finding: kind, severity, index, stage, dtype and count."""
    return [(f.kind, f.severity, f.index, f.stage, f.dtype, f.count) for f in diagnose(t).findings]


def assert_same_row_stats(skipped: Stats, dense: Stats) -> None:
    """Row statistics of a pass that skipped keys against one that computed them all:
    the same counts and keys, the same weights and entropies to rounding."""
    np.testing.assert_array_equal(skipped.n_visible, dense.n_visible)
    np.testing.assert_allclose(skipped.max_weight, dense.max_weight, rtol=1e-13, atol=0)
    np.testing.assert_array_equal(skipped.argmax, dense.argmax)
    np.testing.assert_allclose(skipped.entropy, dense.entropy, rtol=1e-9, atol=1e-12)


def assert_skipping_changes_nothing(spec: AttentionSpec, rows: int | None) -> None:
    skipped = trace(spec, stages=(), rows=rows)
    dense = trace(spec, rows=rows)
    assert finding_keys(skipped) == finding_keys(dense)
    assert_same_row_stats(skipped.stats, dense.stats)


SKIPPING_CASES: dict[str, dict[str, Any]] = {
    "causal": {"L": 16, "S": 16, "causal": True},
    "causal-lower-right-L>S": {"L": 16, "S": 9, "causal": True, "causal_align": "lower-right"},
    "window": {"L": 16, "S": 20, "window": (3, 2)},
    "window-lower-right": {"L": 12, "S": 20, "window": (0, 4), "causal_align": "lower-right"},
    "key-padding": {"L": 10, "S": 16, "key_lengths": (5, 16)},
    "key-padding-0": {"L": 10, "S": 16, "key_lengths": (0, 7), "causal": True},
    "everything": {
        "L": 14,
        "S": 18,
        "causal": True,
        "window": (6, 0),
        "key_lengths": (11, 18),
        "alibi": True,
        "mask_kind": "bool",
    },
}


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("case", SKIPPING_CASES.values(), ids=SKIPPING_CASES.keys())
def test_skipping_hidden_keys_gives_the_same_diagnosis(case: dict[str, Any], rows: int) -> None:
    p = make_problem(21, E=4, **case)
    spec = p.spec
    assert any(
        key_range(spec, lead, r) != slice(0, spec.S) for lead, r in iter_blocks(spec, rows)
    ), "the case must skip keys"
    assert_skipping_changes_nothing(spec, rows)


@BOUNDED
@given(problems(), st.sampled_from([1, 2, 5]))
def test_skipping_hidden_keys_on_random_problems(p: Problem, rows: int) -> None:
    assert_skipping_changes_nothing(p.spec, rows)


@pytest.mark.parametrize("extra", [{}, {"causal": True}], ids=["padding", "padding-causal"])
def test_padded_nan_keys_poison_the_output_when_skipped_as_when_computed(
    extra: dict[str, Any],
) -> None:
    """samples/padded_nan.yaml, longer: the padded keys' K and V rows are NaN. A dense
    kernel multiplies the padded V rows by zero weights, 0 · NaN = NaN, so every
    output is NaN; a block that never computes those keys must say the same."""
    rng = np.random.default_rng(22)
    q, k, v = rng.normal(size=(9, 2)), rng.normal(size=(8, 2)), rng.normal(size=(8, 3))
    k[5:] = np.nan
    v[5:] = np.nan
    spec = build_spec(q, k, v, options=Options(key_lengths=(5,), **extra))
    assert key_range(spec, (), slice(0, 1)).stop <= 5
    skipped, dense = trace(spec, stages=(), rows=2), trace(spec)
    assert dense.output is not None
    assert np.isnan(dense.output).all()
    found = finding_keys(skipped)
    assert found == finding_keys(dense)
    assert found[0][:2] == ("nonfinite", "error")
    assert any(f[0] == "nonfinite" and f[3] == "output" for f in found)
    assert_same_row_stats(skipped.stats, dense.stats)


def test_padded_nan_sample_file_gives_an_output_finding() -> None:
    from sdpa_cli.engine.inputs import load_spec

    spec, _ = load_spec((str(ROOT / "samples" / "padded_nan.yaml"),))
    skipped, dense = trace(spec, stages=(), rows=1), trace(spec)
    assert finding_keys(skipped) == finding_keys(dense)
    assert any(f[0] == "nonfinite" and f[3] == "output" for f in finding_keys(skipped))


def test_regression_argmax_of_a_row_with_no_visible_key_does_not_depend_on_skipping() -> None:
    q, k, v = normal(23, 5, 2), normal(24, 3, 2), normal(25, 3, 2)
    spec = build_spec(q, k, v, options=Options(window=(0, 0)))  # rows 3, 4 see no key
    skipped, dense = trace(spec, stages=(), rows=2), trace(spec, rows=2)
    assert list(dense.stats.n_visible) == [1, 1, 1, 0, 0]
    np.testing.assert_array_equal(skipped.stats.argmax, dense.stats.argmax)


@settings(max_examples=150, deadline=None)
@given(
    L=st.integers(1, 20),
    S=st.integers(1, 20),
    rows=st.integers(1, 8),
    causal=st.booleans(),
    window=st.none() | st.tuples(st.integers(0, 6), st.integers(0, 6)),
    align=st.sampled_from(["upper-left", "lower-right"]),
    n_valid=st.none() | st.integers(0, 20),
)
def test_key_range_holds_every_key_a_block_can_see(
    L: int,
    S: int,
    rows: int,
    causal: bool,
    window: tuple[int, int] | None,
    align: str,
    n_valid: int | None,
) -> None:
    """Every key outside the range is hidden from every row of the block, and the
    range is no wider than it must be: its first and last keys are seen by some row."""
    key_lengths = None if n_valid is None else (min(n_valid, S),)
    options = Options(causal=causal, window=window, causal_align=align, key_lengths=key_lengths)
    spec = build_spec(np.zeros((L, 2)), np.zeros((S, 2)), np.zeros((S, 1)), options=options)
    for lead, r in iter_blocks(spec, rows):
        keys = key_range(spec, lead, r)
        seen = visibility(spec, lead, r)
        if seen is None:
            assert keys == slice(0, S)
            continue
        outside = np.ones(S, dtype=np.bool_)
        outside[keys] = False
        assert not seen[:, outside].any(), (r, keys)
        if keys.stop > keys.start:
            assert seen[:, keys.start].any()
            assert seen[:, keys.stop - 1].any()


def test_key_range_is_everything_under_a_finite_mask_value() -> None:
    """A finite mask value spreads a row with no visible key over every key, so no
    key may be skipped."""
    spec = build_spec(
        normal(26, 6, 2),
        normal(27, 9, 2),
        normal(28, 9, 2),
        options=Options(causal=True, window=(1, 1), key_lengths=(3,), mask_value=-1e9),
    )
    assert all(key_range(spec, lead, r) == slice(0, 9) for lead, r in iter_blocks(spec, 2))


# --- 3. threads ---------------------------------------------------------------------------


def assert_same_stats(a: Stats, b: Stats) -> None:
    """Every statistic equal, exactly: arrays, records (first and largest places), moments."""
    for f in dataclasses.fields(Stats):
        if f.name == "spec" or f.name.startswith("_"):
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y, err_msg=f.name)
        elif isinstance(x, dict):
            assert x.keys() == y.keys(), f.name
            for key in x:
                if isinstance(x[key], np.ndarray):
                    np.testing.assert_array_equal(x[key], y[key], err_msg=f"{f.name}[{key}]")
                else:
                    assert x[key] == y[key], f"{f.name}[{key}]"
        else:
            assert x == y, f.name


def as_json(value: Any) -> str:
    """A record as JSON text, NaN included, for exact comparison (NaN != NaN)."""
    return json.dumps(value, sort_keys=True, default=repr)


def spread_out_trouble() -> AttentionSpec:
    """NaN and overflow in many blocks of many slices: NaN query rows, a K row of inf
    at a visible key, a NaN padded V row, and rows whose raw scores overflow float16."""
    rng = np.random.default_rng(31)
    q, k, v = (
        rng.normal(size=(2, 2, 24, 4)),
        rng.normal(size=(2, 2, 20, 4)),
        rng.normal(size=(2, 2, 20, 3)),
    )
    q[0, 1, 6] = np.nan
    q[0, 1, 17] = np.nan
    q[1, 0, 9] = np.nan
    q[0, 0, [5, 14, 22]] *= 1e5  # QKᵀ beyond float16's 65504
    q[1, 1, 20] *= 1e5
    k[1, 0, 11] = np.inf
    v[0, 1, 19] = np.nan  # a padded key of item 0
    options = Options(causal=True, causal_align="lower-right", key_lengths=(18, 20))
    return build_spec(q, k, v, options=options)


def test_threads_give_the_statistics_of_one_thread() -> None:
    """Blocks finish in any order on two threads but merge in block order: every
    count, largest value and first place is that of one thread."""
    spec = spread_out_trouble()
    one = trace(spec, stages=(), rows=2, jobs=1)
    two = trace(spec, stages=(), rows=2, jobs=2)
    assert_same_stats(two.stats, one.stats)
    found = diagnose(one).findings
    assert {"nonfinite", "overflow"} <= {f.kind for f in found}
    assert as_json([f.to_dict() for f in diagnose(two).findings]) == as_json(
        [f.to_dict() for f in found]
    )


def test_threads_keep_the_first_place_of_each_finding() -> None:
    """The first NaN query row is in block 3 of slice (0, 1) and the first overflow
    in block 2 of slice (0, 0); a later block's must not win."""
    spec = spread_out_trouble()
    two = trace(spec, stages=(), rows=2, jobs=2)
    assert two.stats.records.nonfinite["raw"].first == (0, 1, 6, 0)
    assert two.stats.records.overflow[("raw", "float16")].first is not None
    assert two.stats.records.overflow[("raw", "float16")].first[:3] == (0, 0, 5)


def check_report(spec: AttentionSpec, jobs: int) -> CheckReport:
    whole = trace(spec)
    assert whole.output is not None
    out = whole.output.copy()
    out[0, 0, 6, 1] += 0.5  # a wrong value, and NaN where the reference is finite
    out[1, 1, 2, 0] = np.nan
    lse = np.zeros((*spec.lead, spec.L))
    expected = [Expected("output", out, "out.npy"), Expected("lse", lse, "lse.npy")]
    return run_checks(spec, expected, jobs=jobs)


def test_threads_give_the_check_results_of_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = spread_out_trouble()
    monkeypatch.setattr(sdpa_cli.engine.driver, "BLOCK_ELEMENTS", 3 * spec.S)  # 3 rows per block
    assert block_rows(spec) == 3
    one, two = check_report(spec, jobs=1), check_report(spec, jobs=2)
    assert not one.passed
    assert as_json([c.to_dict() for c in two.checks]) == as_json([c.to_dict() for c in one.checks])
    assert as_json([f.to_dict() for f in two.diagnosis.findings]) == as_json(
        [f.to_dict() for f in one.diagnosis.findings]
    )


# --- 4. the denormal guard ------------------------------------------------------------------


def peaky(seed: int, spread: float) -> tuple[F64, F64, F64]:
    """Q scaled up so that each row's logits span ``spread`` or more."""
    rng = np.random.default_rng(seed)
    q, k, v = (
        rng.normal(size=(2, 2, 12, 8)),
        rng.normal(size=(2, 2, 40, 8)),
        rng.normal(size=(2, 2, 40, 3)),
    )
    logits = q @ np.swapaxes(k, -1, -2) / math.sqrt(8)
    q *= spread / (logits.max(-1) - logits.min(-1)).min()
    return q, k, v


def softmax_clamped(masked: F64, floor: float) -> F64:
    """Softmax with max-subtraction and exp's arguments below ``floor`` set to −inf."""
    x = masked - masked.max(axis=-1, keepdims=True)
    e = np.where(x < floor, 0.0, np.exp(x))
    return e / e.sum(axis=-1, keepdims=True)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("dtype", "spread"), [("float64", 1500.0), ("float32", 160.0)], ids=["float64", "float32"]
)
def test_denormal_guard_changes_nothing_a_format_can_resolve(
    monkeypatch: pytest.MonkeyPatch, dtype: str, spread: float
) -> None:
    """Weights below exp(floor) are set to 0 instead of a subnormal: a change of at
    most the smallest normal number per weight, S of them at most per output."""
    q, k, v = peaky(41, spread)
    options = Options(**(FLOAT32_RUN if dtype == "float32" else {}))
    spec = build_spec(q.astype(dtype), k.astype(dtype), v.astype(dtype), options=options)
    assert native_dtype(spec) == np.dtype(dtype)
    guarded = trace(spec, rows=5)
    monkeypatch.setattr(sdpa_cli.engine.softmax, "DENORMAL_FLOOR", {})
    bare = trace(spec, rows=5)
    assert guarded.weights is not None
    assert bare.weights is not None
    assert guarded.output is not None
    assert bare.output is not None

    tiny = float(np.finfo(dtype).tiny)
    eps = float(np.finfo(dtype).eps)
    # The guard fires: weights that are 0 with it are subnormal, not 0, without it.
    fired = (guarded.weights == 0) & (bare.weights != 0)
    assert fired.any()
    assert (bare.weights[fired] < tiny).all()
    np.testing.assert_array_less(np.abs(guarded.weights - bare.weights), tiny * (1 + eps))
    atol = spec.S * tiny * float(np.abs(v).max())
    np.testing.assert_allclose(guarded.output, bare.output, rtol=4 * eps, atol=atol)
    np.testing.assert_allclose(guarded.weights.sum(-1), 1.0, rtol=4 * eps)


def test_a_guard_at_minus_30_would_exceed_the_tolerance() -> None:
    """The tolerance above is tight: clamping exp's argument at −30 instead (weights
    below 1e-13 set to 0) moves weights and outputs far beyond it."""
    q, k, v = peaky(41, 1500.0)
    spec = build_spec(q, k, v)
    got = trace(spec, rows=5)
    assert got.masked is not None
    assert got.weights is not None
    assert got.output is not None
    w30 = softmax_clamped(got.masked, -30.0)
    tiny = float(np.finfo(np.float64).tiny)
    assert np.abs(w30 - got.weights).max() > 1e6 * tiny
    out30 = w30 @ v
    allowed = 4 * np.finfo(np.float64).eps * np.abs(got.output) + spec.S * tiny * np.abs(v).max()
    assert (np.abs(out30 - got.output) > allowed).any()


def test_peaky_logits_span_the_denormal_floor() -> None:
    """The inputs of the guard tests are what they claim: rows spanning > 800 (float64)
    and > 100 (float32), with logits below each format's floor."""
    for spread, floor in ((1500.0, -708.0), (160.0, -87.0)):
        q, k, _ = peaky(41, spread)
        logits = q @ np.swapaxes(k, -1, -2) / math.sqrt(8)
        gaps = logits - logits.max(-1, keepdims=True)
        assert (gaps.min(-1) < -spread + 1e-6).all()
        assert (gaps < floor).any()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_regression_denormal_guard_never_zeroes_a_normal_weight(dtype: str) -> None:
    """The floor is log(smallest normal): just above it exp is a normal number and
    the weight is kept; just below, exp is subnormal and the weight is 0."""
    floor = sdpa_cli.engine.block.DENORMAL_FLOOR[np.dtype(dtype)]
    tiny = float(np.finfo(dtype).tiny)
    logits = np.array([[0.0, floor + 0.05], [0.0, floor - 0.05]], dtype=dtype)
    assert float(np.exp(logits[0, 1])) > tiny > float(np.exp(logits[1, 1])) > 0
    weights = sdpa_cli.engine.block.softmax(logits, native=True)
    assert weights[0, 1] != 0
    assert weights[1, 1] == 0


# --- 5. native float32 ----------------------------------------------------------------------


def test_float32_run_computes_blocks_in_float32_and_agrees_with_float64() -> None:
    p = make_problem(
        51,
        H=4,
        L=9,
        S=11,
        E=8,
        causal=True,
        causal_align="lower-right",
        window=(6, 2),
        key_lengths=(11, 6),
        alibi=True,
        softcap=4.0,
        bias=True,
    )
    spec64 = p.spec
    spec32 = build_spec(p.q, p.k, p.v, bias=p.bias, options=Options(**p.options, **FLOAT32_RUN))
    assert native_dtype(spec32) == np.dtype(np.float32)
    block = attend_block(spec32, (1, 2), slice(3, 7))
    for name in ("raw", "scaled", "capped", "biased", "masked", "weights", "output"):
        assert getattr(block, name).dtype == np.float32, name
    for rows in (2, None):
        got, want = trace(spec32, rows=rows), trace(spec64, rows=rows)
        assert got.weights is not None
        assert want.weights is not None
        assert got.output is not None
        assert want.output is not None
        np.testing.assert_allclose(got.weights, want.weights, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(got.output, want.output, rtol=1e-5, atol=1e-6)
        assert finding_keys(trace(spec32, stages=(), rows=rows)) == finding_keys(got)


# --- 6. block_lse and v_range -------------------------------------------------------------


def logsumexp(x: F64) -> F64:
    """Row logsumexp of a whole array: −inf for a row of −inf, NaN for a row with NaN."""
    top = np.max(x, axis=-1, initial=-math.inf)
    shift = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(np.exp(x - shift[:, None]).sum(axis=-1)) + shift  # type: ignore[no-any-return]


LSE_CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "rows-with-no-visible-key": {"window": (0, 0)},  # L > S: the last rows see nothing
    "finite-mask-value": {"window": (0, 0), "mask_value": -1e9},
    "causal-lower-right": {"causal": True, "causal_align": "lower-right"},
    "float-mask-inf": {"mask_kind": "float"},
    "nan-rows": {"nan_rows": True, "key_lengths": (5,)},
}


@pytest.mark.parametrize("case", LSE_CASES.values(), ids=LSE_CASES.keys())
def test_block_lse_equals_a_whole_row_logsumexp(case: dict[str, Any]) -> None:
    case = dict(case)
    nan_rows = case.pop("nan_rows", False)
    p = make_problem(61, B=1, L=10, S=7, **case)
    if nan_rows:
        p.q[0, 1, [2, 8]] = np.nan
    spec = p.spec
    whole = trace(spec)
    assert whole.masked is not None
    want = np.stack([logsumexp(whole.masked[0, h]) for h in range(2)])
    for lead, r in iter_blocks(spec, 3):
        for keys in (None, key_range(spec, lead, r)):
            got = block_lse(attend_block(spec, lead, r, keys=keys))
            np.testing.assert_allclose(got, want[lead[-1], r], rtol=RTOL, atol=ATOL)
    if case.get("window") == (0, 0):
        assert np.isneginf(want).any() == (case.get("mask_value", -math.inf) == -math.inf)
        if "mask_value" in case:  # a hidden row is uniform at −1e9: LSE = −1e9 + log S
            np.testing.assert_allclose(want[:, -1], -1e9 + math.log(7), rtol=RTOL)
    if nan_rows:
        assert np.isnan(want[1, [2, 8]]).all()


def brute_v_range(v: F64, support: NDArray[np.bool_] | None, n_rows: int) -> tuple[F64, F64]:
    """Per row, the column minima and maxima of V over the row's keys; 0 with none."""
    lo, hi = np.zeros((n_rows, v.shape[1])), np.zeros((n_rows, v.shape[1]))
    for i in range(n_rows):
        keys = np.ones(v.shape[0], np.bool_) if support is None else support[i]
        if keys.any():
            lo[i], hi[i] = v[keys].min(axis=0), v[keys].max(axis=0)
    return lo, hi


def supports(rng: np.random.Generator, n: int, S: int, kind: str) -> NDArray[np.bool_]:
    j = np.arange(S)[None, :]
    ends = rng.integers(0, S + 1, size=(n, 1))
    starts = rng.integers(0, S + 1, size=(n, 1))
    if kind == "prefix":
        return j < ends
    if kind == "suffix":
        return j >= starts
    if kind == "window":
        return (j >= np.minimum(starts, ends)) & (j < np.maximum(starts, ends))
    if kind == "empty":
        return np.zeros((n, S), np.bool_)
    return rng.random((n, S)) < 0.5


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    S=st.integers(0, 9),
    Ev=st.integers(1, 3),
    n=st.integers(1, 8),
    kind=st.sampled_from(["prefix", "suffix", "window", "empty", "arbitrary", "mixed", "all"]),
)
def test_v_range_equals_a_brute_force_min_and_max(
    seed: int, S: int, Ev: int, n: int, kind: str
) -> None:
    rng = np.random.default_rng(seed)
    v = rng.normal(size=(S, Ev))
    support: NDArray[np.bool_] | None
    if kind == "all":
        support = None
    elif kind == "mixed":  # every kind of row in one block
        support = np.concatenate(
            [supports(rng, n, S, k) for k in ("prefix", "suffix", "window", "empty", "arbitrary")]
        )
    else:
        support = supports(rng, n, S, kind)
    rows = n if support is None else support.shape[0]
    want = brute_v_range(v, support, rows)
    running = (np.minimum.accumulate(v, axis=0), np.maximum.accumulate(v, axis=0))
    for given_running in (None, running):
        lo, hi = v_range(v, support, rows, given_running)
        np.testing.assert_array_equal(lo, want[0])
        np.testing.assert_array_equal(hi, want[1])


# --- 7. chunked comparison ------------------------------------------------------------------


def same_mismatch(a: Mismatch, b: Mismatch) -> None:
    assert as_json(a.to_dict()) == as_json(b.to_dict())


def compare_chunked(
    monkeypatch: pytest.MonkeyPatch, actual: F64, reference: F64, rtol: float, atol: float
) -> tuple[Mismatch, Mismatch]:
    """``compare`` in one chunk, then in chunks of 7 elements."""
    with monkeypatch.context() as m:
        m.setattr(sdpa_cli.check.compare, "CHUNK", 1 << 40)
        whole = compare(actual, reference, rtol, atol)
        m.setattr(sdpa_cli.check.compare, "CHUNK", 7)
        chunked = compare(actual, reference, rtol, atol)
    return whole, chunked


def test_chunks_find_the_first_non_finite_mismatch_in_c_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A large finite mismatch in chunk 0, an inf in chunk 2, NaN in chunks 2 and 3:
    the worst is the first non-finite one, (2, 3) = flat 15."""
    ref = normal(71, 5, 6)
    got = ref.copy()
    got[0, 1] += 100.0
    got[2, 3] = np.inf
    got[2, 5] = np.nan
    got[3, 4] = np.nan
    whole, chunked = compare_chunked(monkeypatch, got, ref, 1e-5, 1e-8)
    same_mismatch(chunked, whole)
    assert chunked.worst_at == (2, 3)
    assert (chunked.nan_mismatches, chunked.inf_mismatches, chunked.mismatched) == (2, 1, 4)
    assert chunked.max_abs_at == (0, 1)
    assert chunked.passing_atol is None


def test_chunks_find_the_largest_ratio_when_all_finite(monkeypatch: pytest.MonkeyPatch) -> None:
    ref = normal(72, 3, 4, 5)
    got = ref + 1e-6
    got[0, 0, 2] += 1e-3  # chunk 0
    got[2, 1, 3] += 5e-3 * (1 + abs(ref[2, 1, 3]))  # chunk 6: the worst ratio
    whole, chunked = compare_chunked(monkeypatch, got, ref, 1e-5, 1e-8)
    same_mismatch(chunked, whole)
    ratio = np.abs(got - ref) / (1e-8 + 1e-5 * np.abs(ref))
    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(ratio)), ratio.shape))
    assert chunked.worst_at == worst == (2, 1, 3)


@pytest.mark.parametrize(
    "shape", [(), (0,), (3, 0, 2), (1,), (23,), (2, 3, 2, 4)], ids=lambda s: f"shape{s}"
)
def test_chunks_agree_on_every_shape(
    monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...]
) -> None:
    ref = normal(73, *shape)
    got = ref * (1 + 1e-4) + 1e-7
    whole, chunked = compare_chunked(monkeypatch, got, ref, 1e-5, 1e-8)
    same_mismatch(chunked, whole)
    assert chunked.total == math.prod(shape)
    if chunked.total == 0:
        assert chunked.worst_at is None
        assert chunked.mismatched == 0
    else:
        assert chunked.worst_at is not None
        assert len(chunked.worst_at) == len(shape)


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    shape=st.lists(st.integers(0, 6), max_size=4).map(tuple),
    n_bad=st.integers(0, 3),
    zeros=st.booleans(),
)
def test_chunks_agree_on_random_arrays(
    seed: int, shape: tuple[int, ...], n_bad: int, zeros: bool
) -> None:
    rng = np.random.default_rng(seed)
    ref = rng.normal(size=shape)
    got = ref + rng.normal(size=shape) * 10.0 ** rng.integers(-9, -2)
    if ref.size:
        if zeros:
            ref.reshape(-1)[rng.integers(ref.size)] = 0.0
        for _ in range(n_bad):
            got.reshape(-1)[rng.integers(got.size)] = rng.choice([np.nan, np.inf, -np.inf])
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sdpa_cli.check.compare, "CHUNK", 1 << 40)
        whole = compare(got, ref, 1e-4, 1e-6)
        m.setattr(sdpa_cli.check.compare, "CHUNK", 7)
        chunked = compare(got, ref, 1e-4, 1e-6)
    same_mismatch(chunked, whole)
    bad = (np.isnan(got) | np.isnan(ref) | (np.isinf(got) & (got != ref))).reshape(-1)
    if bad.any():
        first = np.unravel_index(int(np.argmax(bad)), shape) if shape else ()
        assert chunked.worst_at == tuple(int(i) for i in first)


def test_regression_chunks_agree_when_only_non_finite_elements_differ(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ref = normal(74, 3, 5)
    got = ref.copy()
    got.reshape(-1)[:8] = np.nan  # chunk 0 (7 elements) holds no finite pair
    whole, chunked = compare_chunked(monkeypatch, got, ref, 1e-5, 1e-8)
    same_mismatch(chunked, whole)


# --- 8. moments of the scores -------------------------------------------------------------


@pytest.mark.parametrize(
    ("offset", "nan_q", "nan_k"),
    [(0.0, (), ()), (0.0, (1, 4), (2,)), (500.0, (), ()), (500.0, (0,), (3, 5))],
    ids=["plain", "nan-rows", "offset-1e6", "offset-and-nan"],
)
def test_product_moments_equal_those_of_the_explicit_scores(
    offset: float, nan_q: tuple[int, ...], nan_k: tuple[int, ...]
) -> None:
    """mean and np.std of factor · QKᵀ over its finite elements, NaN rows of Q or K
    left out. With every element of Q and K near 500 (E = 4), every score is about
    1e6 with a spread of about 0.04: E[x²] − E[x]² loses percents of it to cancellation."""
    rng = np.random.default_rng(81)
    spread = 1e-4 if offset else 1.0
    q, k = offset + spread * rng.normal(size=(7, 4)), offset + spread * rng.normal(size=(9, 4))
    q[list(nan_q)] = np.nan
    k[list(nan_k)] = np.nan
    factor = 1.0 if offset else 0.35
    scores = factor * (q @ k.T)
    finite = scores[np.isfinite(scores)]
    got = product_moments(q, k, factor)
    assert got.count == finite.size
    assert got.nonfinite == scores.size - finite.size
    np.testing.assert_allclose(got.mean, finite.mean(), rtol=1e-12)
    np.testing.assert_allclose(got.std, finite.std(), rtol=1e-8)
    if offset:
        assert 9e5 < finite.mean() < 1.1e6
        naive = math.sqrt(max(float(np.mean(finite**2) - finite.mean() ** 2), 0.0))
        assert abs(naive - finite.std()) > 1e-4 * finite.std()  # the naive formula fails


@pytest.mark.parametrize(("L", "S", "E"), [(7, 9, 4), (3, 5, 300), (40, 2, 1500)])
def test_product_moments_of_a_long_head_dimension_equal_the_explicit_scores(
    L: int, S: int, E: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (what declared sizes cost): ⟨AᵀA, BᵀB⟩ through (E, E) Gram matrices
    cost a 640 KB file declaring E = 40,000 12.8 GB; where E × E is the larger, A·Bᵀ is
    summed a block of rows at a time (blocks of 1 row here), to the same moments."""
    import sdpa_cli.engine.records as records

    monkeypatch.setattr(records, "GRAM_ELEMENTS", S)  # one row of A·Bᵀ per block
    rng = np.random.default_rng(E)
    q, k = 3.0 + rng.normal(size=(L, E)), rng.normal(size=(S, E))
    scores = 0.5 * (q @ k.T)
    got = product_moments(q, k, 0.5)
    np.testing.assert_allclose(got.mean, scores.mean(), rtol=1e-12)
    np.testing.assert_allclose(got.std, scores.std(), rtol=1e-10)


# --- 9. the command line --------------------------------------------------------------------


def sample(*names: str) -> list[str]:
    return [str(ROOT / "samples" / name) for name in names]


CLI_RUNS = [
    *(sample(name) for name in SAMPLES),
    [*sample("batched_q.npy", "batched_k.npy", "batched_v.npy"), "--causal"],
    [*sample("long_q.npy", "long_k.npy", "long_v.npy"), "--causal", "--window", "40,0"],
]


@pytest.mark.parametrize("command", ["check", "compute", "explain"])
def test_cli_jobs_2_prints_exactly_what_jobs_1_prints(
    monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """Every sample, one query row per block (so that two threads interleave blocks)."""
    monkeypatch.setattr(sdpa_cli.engine.driver, "BLOCK_ELEMENTS", 1)
    for args in CLI_RUNS:
        one = invoke(command, *args, "--jobs", "1")
        two = invoke(command, *args, "--jobs", "2")
        assert one.exit_code in (ExitCode.OK, ExitCode.CHECK_FAILED), (args, one.stderr)
        assert one.stdout
        assert (two.exit_code, two.stdout, two.stderr) == (one.exit_code, one.stdout, one.stderr)


@pytest.mark.parametrize("command", ["check", "compute", "explain"])
def test_cli_jobs_0_is_a_usage_error(command: str) -> None:
    result = invoke(command, str(ROOT / "samples" / "causal.yaml"), "--jobs", "0")
    assert result.exit_code == ExitCode.BAD_INPUT
    assert "'--jobs': 0 is not in the range x>=1" in result.stderr
    assert result.stdout == ""


# --- 10. PyTorch ----------------------------------------------------------------------------


@pytest.mark.parametrize(("L", "S"), [(7, 12), (12, 7)])
def test_blocked_causal_output_equals_pytorch_sdpa(L: int, S: int) -> None:
    """PyTorch's ``is_causal`` aligns the mask upper-left (key j ≤ query i), L ≠ S."""
    torch = pytest.importorskip("torch")
    q, k, v = normal(91, 2, 3, L, 8), normal(92, 2, 3, S, 8), normal(93, 2, 3, S, 5)
    want = torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), is_causal=True
    ).numpy()
    got = trace(build_spec(q, k, v, options=Options(causal=True)), rows=5).output
    assert got is not None
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)
