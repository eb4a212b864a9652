"""The model grid's statistics per head, on hand-built heads whose answers are known:
a head whose queries all attend key 0 (a saturated sink), a head of equal logits
(entropy 1, dead), a causal head, fully masked rows, heads pooled over the batch, GQA;
the sink mass against the float64 loop reference on both engine paths; the output's
error; the notable heads and the JSON contract."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray
from reference import attention

from sdpa_cli.diagnosis.findings import Thresholds
from sdpa_cli.diagnosis.model import (
    FLAT_MAX_WEIGHT,
    CaseHeads,
    GridRow,
    Notable,
    head_metrics,
    model_grid,
)
from sdpa_cli.engine.options import parse_options
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.engine.types import F64
from sdpa_cli.names import MODEL_METRICS as METRICS
from sdpa_cli.text import NON_FINITE_JSON

TH = Thresholds()


def spec_of(
    q: NDArray[Any], k: NDArray[Any], v: NDArray[Any] | None = None, **options: Any
) -> AttentionSpec:
    if v is None:
        v = np.ones((*k.shape[:-1], 2))
    mask = options.pop("mask", None)
    bias = options.pop("bias", None)
    return build_spec(q, k, v, mask=mask, bias=bias, options=parse_options(options))


def three_heads(L: int = 4, S: int = 4) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any]]:
    """(1, 3, L, E = 2) heads: 0 attends key 0 alone (logit 50 against 0), 1 has every
    logit 0 (Q = 0), 2 is seeded noise."""
    q, k = np.zeros((1, 3, L, 2)), np.zeros((1, 3, S, 2))
    q[0, 0, :, 0] = 10.0
    k[0, 0, 0, 0] = 10.0  # logit q·k0 / √2 = 70.7 against 0: the others weigh e^−70.7
    rng = np.random.default_rng(7)
    q[0, 2], k[0, 2] = rng.standard_normal((L, 2)), rng.standard_normal((S, 2))
    v = rng.standard_normal((1, 3, S, 3))
    return q, k, v


# --- the statistics of known heads ----------------------------------------------------------


def test_a_head_whose_queries_all_attend_key_0_is_a_saturated_sink() -> None:
    q, k, v = three_heads()
    heads = head_metrics(spec_of(q, k, v), TH)
    m = heads.metrics
    assert m["sink_mass"][0] == pytest.approx(1.0, abs=1e-12)
    assert m["max_weight"][0] == pytest.approx(1.0, abs=1e-12)
    assert m["entropy"][0] == pytest.approx(0.0, abs=1e-12)
    assert m["saturated"][0] == 1.0
    assert m["near_uniform"][0] == 0.0
    assert heads.rows.tolist() == [4, 4, 4]
    grid = model_grid([GridRow("layer", heads=heads)], TH)
    assert [(n.head, n.kind) for n in grid.notable if n.head == 0] == [
        (0, "sink"),
        (0, "saturated"),
    ]


def test_a_head_of_equal_logits_has_entropy_1_and_is_dead() -> None:
    q, k, v = three_heads(L=4, S=5)
    heads = head_metrics(spec_of(q, k, v), TH)
    m = heads.metrics
    assert m["entropy"][1] == pytest.approx(1.0, abs=1e-12)
    assert m["max_weight"][1] == pytest.approx(1 / 5, abs=1e-12)
    assert m["sink_mass"][1] == pytest.approx(1 / 5, abs=1e-12)
    assert m["near_uniform"][1] == 1.0
    assert m["saturated"][1] == 0.0
    assert heads.flatness[1] == pytest.approx(1.0)
    grid = model_grid([GridRow("layer", heads=heads)], TH)
    assert [n for n in grid.notable if n.head == 1] == [Notable("layer", 1, "dead", 1.0)]


def test_a_causal_head_of_equal_logits() -> None:
    # Row i sees keys 0..i, each weighing 1/(i + 1); row 0 (one key) is not judged.
    q, k = np.zeros((4, 2)), np.zeros((4, 2))
    heads = head_metrics(spec_of(q, k, causal=True), TH)
    m = heads.metrics
    expected = (1 / 2 + 1 / 3 + 1 / 4) / 3  # 13/36
    assert heads.rows.tolist() == [3]
    assert m["max_weight"][0] == pytest.approx(expected)
    assert m["sink_mass"][0] == pytest.approx(expected)
    assert m["entropy"][0] == pytest.approx(1.0)
    assert m["fully_masked"][0] == 0.0
    assert m["near_uniform"][0] == 1.0


def test_a_causal_head_attending_its_own_key_is_saturated_not_a_sink() -> None:
    # q_i = k_i = 5·e_i: logit 25/√4 = 12.5 on the diagonal, 0 elsewhere.
    q = k = 5 * np.eye(4)
    heads = head_metrics(spec_of(q, k, causal=True), TH)
    m = heads.metrics
    w_self = [math.exp(12.5) / (math.exp(12.5) + i) for i in (1, 2, 3)]  # rows 1..3
    assert m["saturated"][0] == 1.0
    assert m["max_weight"][0] == pytest.approx(np.mean(w_self))
    assert m["sink_mass"][0] == pytest.approx(
        np.mean([(1 - w) / i for w, i in zip(w_self, (1, 2, 3), strict=True)])
    )
    grid = model_grid([GridRow("c", heads=heads)], TH)
    assert [n.kind for n in grid.notable] == ["saturated"]


def test_fully_masked_rows_count_among_all_rows_and_are_not_judged() -> None:
    q, k = np.zeros((2, 4, 2)), np.zeros((2, 3, 2))  # 2 heads, L = 4, S = 3
    mask = np.ones((4, 3), dtype=np.bool_)
    mask[2] = False  # row 2 sees no key
    heads = head_metrics(spec_of(q, k, mask=mask), TH)
    m = heads.metrics
    assert m["fully_masked"].tolist() == [0.25, 0.25]
    assert heads.rows.tolist() == [3, 3]
    assert m["sink_mass"].tolist() == pytest.approx([1 / 3, 1 / 3])  # the 3 rows seeing keys


def test_heads_pool_their_rows_over_the_batch() -> None:
    # Head 0 is uniform in batch item 0 and one-hot on key 1 in item 1.
    q, k = np.zeros((2, 1, 4, 1)), np.zeros((2, 1, 4, 1))
    q[1, 0] = 10.0
    k[1, 0, 1] = 10.0
    heads = head_metrics(spec_of(q, k, scale="none"), TH)
    m = heads.metrics
    assert heads.rows.tolist() == [8]
    assert m["near_uniform"][0] == 0.5
    assert m["saturated"][0] == 0.5
    assert m["sink_mass"][0] == pytest.approx((0.25 + 0.0) / 2, abs=1e-12)
    assert m["entropy"][0] == pytest.approx(0.5, abs=1e-12)


def test_gqa_columns_are_the_query_heads() -> None:
    rng = np.random.default_rng(3)
    q, k, v = (
        rng.standard_normal((1, 4, 5, 2)),
        rng.standard_normal((1, 2, 5, 2)),
        rng.standard_normal((1, 2, 5, 2)),
    )
    heads = head_metrics(spec_of(q, k, v), TH)
    assert heads.heads == 4
    w = attention(q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)).weights
    assert heads.metrics["sink_mass"] == pytest.approx(w[0, :, :, 0].mean(axis=-1))


@pytest.mark.parametrize(
    "options",
    [
        {},  # the lean pass
        {"causal": True, "window": 2},  # the lean pass skipping keys
        {"softcap": 2.0, "alibi": True},  # the per-stage path
        {"bias": True, "mask_value": -1e9},  # per stage, a finite mask value
    ],
    ids=["lean", "lean-window", "per-stage", "finite-mask"],
)
def test_sink_mass_is_the_references_mean_weight_on_key_0(options: dict[str, Any]) -> None:
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((2, 3, 6, 4)) for _ in range(3))
    opts = dict(options)
    ref_opts: dict[str, Any] = {}
    if opts.pop("bias", False):
        opts["bias"] = ref_opts["bias"] = rng.standard_normal((6, 6))
    for key in ("causal", "softcap", "alibi", "mask_value"):
        if key in opts:
            ref_opts[key] = opts[key]
    if "window" in opts:
        ref_opts["window"] = (2, 2)
    spec = spec_of(q, k, v, **opts)
    heads = head_metrics(spec, TH, jobs=2)
    ref = attention(q, k, v, **ref_opts)
    n = ref.visible.sum(axis=-1)
    judged = n >= 2
    w0 = np.where(judged, ref.weights[..., 0], 0.0).sum(axis=(0, 2)) / judged.sum(axis=(0, 2))
    assert heads.metrics["sink_mass"] == pytest.approx(w0, abs=1e-12)


def test_the_answers_do_not_depend_on_threads() -> None:
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 4, 300, 8)) for _ in range(3))
    spec = spec_of(q, k, v, causal=True)
    expected = attention(q, k, v, causal=True).output * 1.01
    one = head_metrics(spec, TH, expected, jobs=1)
    many = head_metrics(spec, TH, expected, jobs=3)
    for m in METRICS:
        assert np.array_equal(one.metrics[m], many.metrics[m], equal_nan=True), m


# --- the error against the reference --------------------------------------------------------


def test_error_is_the_rms_error_over_the_references_rms_per_head() -> None:
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 3, 5, 4)) for _ in range(3))
    out = attention(q, k, v).output
    expected = out.copy()
    expected[:, 1] *= 1.1  # head 1 off by 10 % everywhere: RMS error 0.1 of the RMS
    expected[1, 2, 3, 0] = np.nan  # a NaN where the reference has a number
    heads = head_metrics(spec_of(q, k, v), TH, expected)
    err = heads.metrics["error"]
    assert err[0] == pytest.approx(0.0, abs=1e-14)
    assert err[1] == pytest.approx(0.1, rel=1e-12)
    assert err[2] == math.inf


def test_error_is_against_float64_under_an_emulated_dtype() -> None:
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 8, 4)) for _ in range(3))
    exact = attention(q, k, v).output
    heads = head_metrics(spec_of(q, k, v, dtype="float16"), TH, exact)
    assert heads.metrics["error"] == pytest.approx([0.0, 0.0], abs=1e-14)


def test_no_expected_output_leaves_the_error_out() -> None:
    q, k, v = three_heads()
    assert "error" not in head_metrics(spec_of(q, k, v), TH).metrics


# --- notable heads and the JSON --------------------------------------------------------------


def heads_of(**metrics: list[float]) -> CaseHeads:
    """A case's statistics set by hand (the others 0)."""
    n = len(next(iter(metrics.values())))
    flatness = np.array(metrics.pop("flatness", [2.0] * n))
    rows = np.array(metrics.pop("rows", [10] * n))
    full = {
        m: np.array(metrics.get(m, [0.0] * n), dtype=np.float64) for m in METRICS if m != "error"
    }
    if "error" in metrics:
        full["error"] = np.array(metrics["error"])
    return CaseHeads(full, rows, flatness)


def test_notable_heads_by_their_thresholds() -> None:
    heads = heads_of(
        sink_mass=[0.5, 0.51, 0.0, 0.0, 0.9],
        near_uniform=[0.0, 0.0, 0.9, 0.5, 0.0],
        saturated=[0.89, 0.0, 0.0, 0.0, 0.95],
        flatness=[2.0, 2.0, 2.0, FLAT_MAX_WEIGHT, 2.0],
    )
    grid = model_grid([GridRow("l0", heads=heads)], TH)
    assert [(n.head, n.kind, n.value) for n in grid.notable] == [
        (1, "sink", 0.51),
        (2, "dead", 0.9),
        (3, "dead", 0.5),  # max weight within 5 % of 1/visible keys
        (4, "sink", 0.9),
        (4, "saturated", 0.95),
    ]
    stricter = model_grid([GridRow("l0", heads=heads)], Thresholds(head_fraction=0.95))
    assert [(n.head, n.kind) for n in stricter.notable] == [
        (1, "sink"),
        (3, "dead"),
        (4, "sink"),
        (4, "saturated"),
    ]


def test_a_head_with_fewer_than_two_rows_is_neither_dead_nor_saturated() -> None:
    heads = heads_of(near_uniform=[1.0], saturated=[0.0], sink_mass=[1.0], rows=[1])
    assert [n.kind for n in model_grid([GridRow("x", heads=heads)], TH).notable] == ["sink"]


def test_json_shape_with_fewer_heads_an_unread_case_and_no_rows_to_judge() -> None:
    a = heads_of(
        entropy=[0.5, 1.0, math.nan], sink_mass=[0.9, 0.1, math.nan], error=[0.0, 0.25, math.inf]
    )
    b = heads_of(entropy=[0.25], sink_mass=[0.2])
    grid = model_grid(
        [GridRow("a", heads=a), GridRow("b", 3, b), GridRow("c", error="c.npy: no such file")], TH
    )
    doc = json.loads(json.dumps(grid.to_dict(), allow_nan=False))
    assert list(doc) == ["cases", "heads", "metrics", "notable", "errors"]
    assert doc["cases"] == ["a", "b", "c"]
    assert doc["heads"] == 3
    assert list(doc["metrics"]) == list(METRICS)
    assert doc["metrics"]["entropy"] == [[0.5, 1.0, "NaN"], [0.25, None, None], [None, None, None]]
    assert doc["metrics"]["error"] == [
        [0.0, 0.25, "Infinity"],
        [None, None, None],
        [None, None, None],
    ]
    assert NON_FINITE_JSON[doc["metrics"]["error"][0][2]] == math.inf
    assert doc["notable"] == [{"case": "a", "head": 0, "kind": "sink", "value": 0.9}]
    assert doc["errors"] == [{"case": "c", "error": "c.npy: no such file"}]


def test_the_error_metric_is_left_out_when_no_case_has_an_expected_output() -> None:
    grid = model_grid([GridRow("a", heads=heads_of(entropy=[0.5]))], TH)
    assert grid.metrics == METRICS[:-1]
    assert "error" not in grid.to_dict()["metrics"]


def test_a_grid_of_no_readable_case() -> None:
    grid = model_grid([GridRow("a", error="bad")], TH)
    assert grid.heads == 0
    assert grid.to_dict()["metrics"] == {}


# --- each head's pattern, pooled by max ----------------------------------------------------


def pooled_reference(weights: F64, pool: int) -> F64:
    """The float64 loop's weights ``(*lead, L, S)`` pooled per query head over the
    batch and over ``pool`` × ``pool`` positions, by their largest."""
    *_, L, S = weights.shape
    heads = weights.reshape(-1, weights.shape[-3], L, S).max(axis=0)  # over the batch
    g, h = -(-L // pool), -(-S // pool)
    padded = np.pad(heads, ((0, 0), (0, g * pool - L), (0, h * pool - S)))
    out: F64 = padded.reshape(len(heads), g, pool, h, pool).max(axis=(2, 4))
    return out


@pytest.mark.parametrize(
    "options",
    [{}, {"causal": True, "window": 2}, {"softcap": 2.0, "alibi": True}, {"mask_value": -1e9}],
    ids=["lean", "lean-window", "per-stage", "finite-mask"],
)
@pytest.mark.parametrize("pool", [1, 4, 16])
def test_each_heads_pattern_is_its_largest_weight_per_cell(
    options: dict[str, Any], pool: int
) -> None:
    """A page draws each head's attention pattern: the largest weight of every
    ``pool`` × ``pool`` (query, key) cell over the batch, from the scores the lean pass
    holds anyway, on both engine paths, equal to the float64 loop's to float32."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 3, 37, 4)) for _ in range(3))
    opts = dict(options)
    ref_opts = {key: value for key, value in opts.items() if key != "window"}
    if "window" in opts:
        ref_opts["window"] = (2, 2)
    heads = head_metrics(spec_of(q, k, v, **opts), TH, jobs=2, pool=pool)
    assert heads.patterns is not None
    assert heads.pool == pool
    assert heads.lengths == (37, 37)
    want = pooled_reference(attention(q, k, v, **ref_opts).weights, pool)
    assert heads.patterns.dtype == np.float32
    np.testing.assert_allclose(heads.patterns, want, rtol=1e-6, atol=1e-7)


def test_a_grid_without_pages_keeps_no_pattern() -> None:
    q, k, v = three_heads()
    assert head_metrics(spec_of(q, k, v), TH).patterns is None
