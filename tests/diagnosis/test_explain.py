"""``sdpa explain``: one (batch, head) slice, stage by stage, checked number by number.

What is checked, in order:

1. The seeds' worked examples (samples/*.yaml) give the values the seeds print, to
   the digits printed, and the exact values worked out here in float64.
2. Every stage's values are the engine's (``trace``) at the slice and rows shown,
   and the weights and output are those of the independent loop reference
   (``tests/reference.py``), for batched grouped-query inputs under every option.
3. The notes and summaries are true numbers: each is recomputed here from the
   trace's arrays, or by hand.
4. Properties of attention, with hypothesis.
5. Findings sit at the stage where they arose, in this slice or "elsewhere".
6. A scorecard over many keys lists the heaviest ones.
7. The ``--format json`` document.
8. PyTorch agrees (skipped without torch).
9. Edge cases: no queries, no keys, emulated float16.

Expected values are never copied from sdpa's own output: they come from the seeds,
from ``math.exp`` in this file, from numpy on the trace's arrays, or from the loops
of ``reference.py``. Tests of known bugs are strict xfails whose reason names the line.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from numpy.typing import NDArray
from reference import attention

from sdpa_cli.diagnosis.explain import elsewhere_summary, explain, slice_at
from sdpa_cli.diagnosis.explained import Explanation, StageExplained
from sdpa_cli.diagnosis.findings import Diagnosis, Thresholds
from sdpa_cli.diagnosis.rules import diagnose
from sdpa_cli.engine.block import applicable_stages
from sdpa_cli.engine.options import OPTION_NAMES, parse_options
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.engine.trace import Trace, trace
from sdpa_cli.files.cases import load_case
from sdpa_cli.report import explain_payload

F64 = NDArray[np.float64]
ROOT = Path(__file__).resolve().parents[2]
SQRT2 = math.sqrt(2.0)
BOUNDED = settings(max_examples=30, deadline=None)
EXPLAIN_NAME = {"dropped": "dropout"}


# --- helpers ------------------------------------------------------------------------------


def sample_spec(name: str, **overrides: object) -> AttentionSpec:
    """A spec from ``samples/NAME``, with options overridden (as in test_render.py)."""
    case = load_case(str(ROOT / "samples" / name), OPTION_NAMES)
    options = parse_options({**case.options, **overrides})
    t = case.tensors
    return build_spec(t["q"], t["k"], t["v"], options=options, names={n: "" for n in t})


def make_spec(
    q: NDArray[Any],
    k: NDArray[Any],
    v: NDArray[Any],
    *,
    bias: NDArray[Any] | None = None,
    mask: NDArray[Any] | None = None,
    names: dict[str, str] | None = None,
    **options: Any,
) -> AttentionSpec:
    return build_spec(q, k, v, bias=bias, mask=mask, options=parse_options(options), names=names)


@dataclass(frozen=True)
class Run:
    """A spec, its whole trace and diagnosis, and the explanation of one slice."""

    spec: AttentionSpec
    trace: Trace
    diagnosis: Diagnosis
    ex: Explanation

    @property
    def lead(self) -> tuple[int, ...]:
        return self.ex.lead

    def whole(self, step: str) -> F64:
        """The trace's array of stage ``step`` at the explained slice (every row)."""
        arr = self.trace.stage(step)
        assert arr is not None
        return np.asarray(arr[self.lead], dtype=np.float64)

    @property
    def visible(self) -> NDArray[np.bool_]:
        assert self.trace.visible is not None
        return np.asarray(self.trace.visible[self.lead], dtype=np.bool_)


def run_explain(
    spec: AttentionSpec,
    batch: int = 0,
    head: int = 0,
    rows: range | None = None,
    *,
    thresholds: Thresholds | None = None,
    query: int | None = None,
    scales: bool = False,
    key_limit: int = 16,
) -> Run:
    """The CLI's pipeline (trace, diagnose, explain), keeping every stage of the trace."""
    result = trace(spec)
    diagnosis = diagnose(result, thresholds or Thresholds())
    ex = explain(
        spec,
        result.stats,
        diagnosis,
        slice_at(spec, batch, head),
        range(spec.L) if rows is None else rows,
        query=query,
        scales=scales,
        key_limit=key_limit,
    )
    return Run(spec, result, diagnosis, ex)


def shown_steps(spec: AttentionSpec) -> list[str]:
    """The engine's stages that apply, less ``masked`` when nothing masks."""
    o = spec.options
    masks = o.causal or o.window is not None or o.key_lengths is not None or spec.mask is not None
    return [s for s in applicable_stages(spec) if s != "masked" or masks]


def stage(ex: Explanation, name: str) -> StageExplained:
    found = ex.stage(name)
    assert found is not None, f"no stage {name!r} in {[s.name for s in ex.stages]}"
    return found


def json_document(ex: Explanation) -> dict[str, Any]:
    """The ``--format json`` document, through a strict (no NaN, no inf) dump."""
    text = json.dumps(explain_payload(ex, for_json=True), allow_nan=False)
    data: dict[str, Any] = json.loads(text)
    return data


def printed(values: float | list[float] | F64, decimals: int) -> Any:
    """Equal to ``values`` as a seed prints them, rounded to ``decimals`` places."""
    return pytest.approx(values, abs=0.5 * 10.0**-decimals)


def number(text: str) -> float:
    """A number as a note writes it (true minus sign, thousands separators)."""
    return float(text.replace("−", "-").replace(",", ""))


def find(pattern: str, text: str) -> tuple[str, ...]:
    match = re.search(pattern, text)
    assert match is not None, f"{pattern!r} not in {text!r}"
    return match.groups()


def softmax(xs: list[float]) -> list[float]:
    """Softmax of a list of finite logits, by math.exp."""
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [x / sum(e) for x in e]


def normal(seed: int, *shape: int) -> F64:
    return np.random.default_rng(seed).normal(size=shape)


def gqa_inputs(seed: int = 0) -> tuple[F64, F64, F64]:
    """Q with 4 heads, K and V with 2 (group 2), batch 2, L = 5, S = 7."""
    return normal(seed, 2, 4, 5, 6), normal(seed + 1, 2, 2, 7, 6), normal(seed + 2, 2, 2, 7, 3)


def entropy_by_hand(w: F64, visible: NDArray[np.bool_]) -> float:
    total = sum(float(x) for x, ok in zip(w, visible, strict=True) if ok)
    if total <= 0:
        return 0.0
    ps = [float(x) / total for x, ok in zip(w, visible, strict=True) if ok and x > 0]
    return -sum(p * math.log(p) for p in ps)


# --- 1. the seeds' worked examples ----------------------------------------------------------


def test_seed_003_scorecard_stage_values() -> None:
    """q = [2, 1] against three keys, d_k = 2: raw, scaled, weights, output."""
    ex = run_explain(sample_spec("scorecard.yaml"), query=0).ex
    assert [s.name for s in ex.stages] == ["raw", "scaled", "weights", "output"]  # nothing masks
    raw = stage(ex, "raw").values[0].tolist()
    scaled = stage(ex, "scaled").values[0].tolist()
    weights = stage(ex, "weights").values[0].tolist()
    output = stage(ex, "output").values[0].tolist()

    assert raw == [5.0, 2.0, -1.0]  # 2·2 + 1·1, 2·1 + 1·0, 2·0 + 1·(−1): exact
    assert scaled == printed([3.5355, 1.4142, -0.7071], 4)
    assert weights == printed([0.88165, 0.10569, 0.01267], 5)
    assert output == printed([8.82912, 0.85815], 5)

    exact_scaled = [x / SQRT2 for x in (5.0, 2.0, -1.0)]
    exact_weights = softmax(exact_scaled)
    v = [[10.0, 0.0], [0.0, 8.0], [1.0, 1.0]]
    exact_output = [
        sum(w * row[c] for w, row in zip(exact_weights, v, strict=True)) for c in (0, 1)
    ]
    assert scaled == pytest.approx(exact_scaled, rel=1e-12)
    assert weights == pytest.approx(exact_weights, rel=1e-12)
    assert output == pytest.approx(exact_output, rel=1e-12)


def test_seed_003_printed_output_comes_from_rounded_weights() -> None:
    """The seed's [8.81, 0.89] is V mixed by [0.88, 0.11, 0.01]; sdpa gives the exact mix."""
    ex = run_explain(sample_spec("scorecard.yaml")).ex
    rounded = [0.88 * 10 + 0.11 * 0 + 0.01 * 1, 0.88 * 0 + 0.11 * 8 + 0.01 * 1]
    assert rounded == pytest.approx([8.81, 0.89], abs=1e-12)
    output = stage(ex, "output").values[0]
    assert output.tolist() != pytest.approx([8.81, 0.89], abs=5e-3)
    assert abs(output[0] - 8.81) > 0.015
    assert abs(output[1] - 0.89) > 0.03


def test_seed_003_scorecard_terms_contributions_and_sums() -> None:
    ex = run_explain(sample_spec("scorecard.yaml"), query=0).ex
    card = ex.scorecard
    assert card is not None
    assert card.query == 0
    assert card.q.tolist() == [2.0, 1.0]
    assert [k.terms for k in card.keys] == [
        ((2.0, 2.0), (1.0, 1.0)),
        ((2.0, 1.0), (1.0, 0.0)),
        ((2.0, 0.0), (1.0, -1.0)),
    ]
    # Each raw score is the sum of its terms' products.
    for key in card.keys:
        assert key.terms is not None
        assert key.raw == sum(a * b for a, b in key.terms)
    assert [k.raw for k in card.keys] == [5.0, 2.0, -1.0]
    assert [k.visible for k in card.keys] == [True, True, True]

    logits = [x / SQRT2 for x in (5.0, 2.0, -1.0)]
    m = max(logits)
    assert card.logit_max == pytest.approx(m, rel=1e-15)
    assert [k.logit for k in card.keys] == pytest.approx(logits, rel=1e-12)
    assert [k.exp for k in card.keys] == pytest.approx([math.exp(x - m) for x in logits], rel=1e-12)
    z = sum(math.exp(x - m) for x in logits)
    assert card.z == pytest.approx(z, rel=1e-12)
    assert card.sum_exp == pytest.approx(sum(math.exp(x) for x in logits), rel=1e-12)
    assert card.sum_exp == pytest.approx(38.9196, abs=5e-5)  # e^3.5355 + e^1.4142 + e^−0.7071

    # w_j = e^(x_j − m) / Z, and the contributions w_j · v_j add up to the output.
    v = [[10.0, 0.0], [0.0, 8.0], [1.0, 1.0]]
    for key, row in zip(card.keys, v, strict=True):
        assert key.weight == pytest.approx(key.exp / z, rel=1e-12)
        assert key.contribution.tolist() == pytest.approx([key.weight * x for x in row], rel=1e-12)
    total = np.sum([k.contribution for k in card.keys], axis=0)
    np.testing.assert_allclose(total, card.output, rtol=1e-12)
    assert card.output.tolist() == printed([8.82912, 0.85815], 5)
    assert card.shown == (0, 1, 2)
    assert card.rest_weight == 0.0


def test_seed_002_causal_stage_values() -> None:
    """Q = K = V = [[1,0],[2,0],[3,0]], causal, d_k = 2 (seed 002, example 2)."""
    run = run_explain(sample_spec("causal.yaml"))
    ex = run.ex
    gram = [[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [3.0, 6.0, 9.0]]
    assert stage(ex, "raw").values.tolist() == gram
    scaled = stage(ex, "scaled").values
    assert scaled == pytest.approx(np.array(gram) / SQRT2, rel=1e-12)
    # The seed's S ≈ [[0.707, 1.414, 2.121], [1.414, 2.828, 4.243], [2.121, 4.243, 6.364]]
    seed_s = [[0.707, 1.414, 2.121], [1.414, 2.828, 4.243], [2.121, 4.243, 6.364]]
    assert scaled == printed(np.array(seed_s), 3)

    masked = stage(ex, "masked").values
    above = np.triu(np.ones((3, 3), dtype=bool), k=1)
    assert np.all(masked[above] == -math.inf)
    assert masked[~above] == pytest.approx(scaled[~above], rel=1e-15)
    np.testing.assert_array_equal(ex.visible, ~above)

    weights = stage(ex, "weights").values
    assert weights[0].tolist() == [1.0, 0.0, 0.0]
    assert weights[1].tolist() == printed([0.196, 0.804, 0.0], 3)  # the seed's row 1
    assert weights[1].tolist() == printed([0.19557, 0.80443, 0.0], 5)
    assert weights[2].tolist() == printed([0.01267, 0.10569, 0.88165], 5)
    for i in (1, 2):
        exact = softmax([g / SQRT2 for g in gram[i][: i + 1]]) + [0.0] * (2 - i)
        assert weights[i].tolist() == pytest.approx(exact, rel=1e-12)

    output = stage(ex, "output").values
    assert output.tolist()[0] == [1.0, 0.0]
    assert output[:, 0].tolist() == printed([1.0, 1.80443, 2.86898], 5)
    assert output[:, 1].tolist() == [0.0, 0.0, 0.0]
    assert output[1, 0] == printed(1.804, 3)  # the seed's O[1]
    # Output = weights · V, V's first column being 1, 2, 3.
    assert output[:, 0].tolist() == pytest.approx((weights @ [1.0, 2.0, 3.0]).tolist(), rel=1e-12)


def test_seed_002_row_2_as_printed_is_not_a_softmax() -> None:
    """The seed's row 2 [0.063, 0.262, 0.675] → 2.612 is an arithmetic slip."""
    weights = stage(run_explain(sample_spec("causal.yaml")).ex, "weights").values[2]
    seed_row = [0.063, 0.262, 0.675]
    assert weights.tolist() != pytest.approx(seed_row, abs=0.01)
    # A softmax's ratios are e^(logit gaps): w1 / w0 = e^(4.243 − 2.121) = e^(3/√2) ≈ 8.34.
    assert weights[1] / weights[0] == pytest.approx(math.exp(3 / SQRT2), rel=1e-12)
    assert seed_row[1] / seed_row[0] == pytest.approx(4.16, abs=0.01)  # far from 8.34
    output = stage(run_explain(sample_spec("causal.yaml")).ex, "output").values[2, 0]
    assert output == printed(2.86898, 5)
    assert abs(output - 2.612) > 0.25


def test_seed_002_scale_comparison() -> None:
    """Raw scores [0, 64, 128] at d_k = 64 under no scaling, 1/√d_k and 1/d_k (example 3)."""
    ex = run_explain(sample_spec("scale_comparison.yaml"), scales=True).ex
    by_rule = {run.rule: run for run in ex.scales}
    assert list(by_rule) == ["none", "sqrt-dk", "dk"]
    assert [by_rule[r].factor for r in by_rule] == [1.0, 0.125, 0.015625]
    assert [by_rule[r].current for r in by_rule] == [False, True, False]  # the sample's default

    none, sqrt_dk, dk = (by_rule[r].weights[0].tolist() for r in ("none", "sqrt-dk", "dk"))
    assert none == pytest.approx([0.0, 0.0, 1.0], abs=1e-27)  # ≈ [0, 0, 1]
    assert none == pytest.approx(softmax([0.0, 64.0, 128.0]), rel=1e-12)
    assert sqrt_dk[0] == pytest.approx(1.125e-7, rel=5e-4)
    assert sqrt_dk[1] == pytest.approx(3.354e-4, rel=2e-4)
    assert sqrt_dk[2] == printed(0.99966, 5)
    assert sqrt_dk == pytest.approx(softmax([0.0, 8.0, 16.0]), rel=1e-12)
    assert dk == printed([0.0900, 0.2447, 0.6652], 4)
    assert dk == pytest.approx(softmax([0.0, 1.0, 2.0]), rel=1e-12)

    assert by_rule["none"].verdict.startswith("saturated")
    assert by_rule["sqrt-dk"].verdict.startswith("saturated")  # 0.99966 ≥ 0.99: still one-hot
    assert by_rule["dk"].verdict.startswith("balanced")
    assert [by_rule[r].saturated for r in by_rule] == [1, 1, 0]
    assert by_rule["sqrt-dk"].max_weight.tolist() == pytest.approx([max(sqrt_dk)], rel=1e-12)

    assert ex.scales_verdict is not None
    balanced_part = ex.scales_verdict.split(";")[0]
    assert "1/d_k" in balanced_part
    assert "√" not in balanced_part
    assert "none" not in balanced_part


def test_scale_comparison_adds_the_runs_own_scale() -> None:
    """A given scale that is none of the three rules is compared as a fourth run."""
    ex = run_explain(sample_spec("scale_comparison.yaml", scale=0.05), scales=True).ex
    assert [run.rule for run in ex.scales] == ["none", "sqrt-dk", "dk", 0.05]
    assert [run.current for run in ex.scales] == [False, False, False, True]
    own = ex.scales[3]
    assert own.factor == 0.05
    assert own.weights[0].tolist() == pytest.approx(softmax([0.0, 3.2, 6.4]), rel=1e-12)
    assert own.weights[0].tolist() == pytest.approx(
        stage(ex, "weights").values[0].tolist(), rel=1e-15
    )


def test_scale_runs_are_the_references_weights_under_each_scale() -> None:
    q, k, v = gqa_inputs(12)
    spec = make_spec(q, k, v, causal=True, key_lengths=(7, 6))
    ex = run_explain(spec, 1, 2, range(1, 4), scales=True).ex
    for run in ex.scales:
        assert isinstance(run.rule, str)
        ref = attention(q, k, v, scale=run.rule, causal=True, key_lengths=(7, 6))
        np.testing.assert_allclose(run.weights, ref.weights[1, 2, 1:4], rtol=1e-12, atol=1e-15)
        visible = ref.visible[1, 2, 1:4]
        top = np.where(visible, ref.weights[1, 2, 1:4], 0.0).max(axis=1)
        np.testing.assert_allclose(run.max_weight, top, rtol=1e-12)
        assert run.factor == pytest.approx({"none": 1.0, "sqrt-dk": 6**-0.5, "dk": 1 / 6}[run.rule])


def test_seed_001_four_scores() -> None:
    """Scores [1.0, 0.5, 2.5, −0.1], scale none; V is the identity, so output = weights."""
    ex = run_explain(sample_spec("four_scores.yaml"), query=0).ex
    card = ex.scorecard
    assert card is not None
    scores = [1.0, 0.5, 2.5, -0.1]
    assert [k.logit for k in card.keys] == scores
    assert [k.weight for k in card.keys] == printed([0.15574, 0.09446, 0.69796, 0.05184], 5)
    assert [k.weight for k in card.keys] == pytest.approx(softmax(scores), rel=1e-12)
    assert card.sum_exp == printed(17.4543, 4)
    assert card.sum_exp == pytest.approx(sum(math.exp(s) for s in scores), rel=1e-12)
    # The seed's exponentials 2.718 + 1.649 + 12.182 + 0.905.
    e_x = [k.exp * math.exp(card.logit_max) for k in card.keys]
    assert e_x == printed([2.718, 1.649, 12.182, 0.905], 3)
    assert card.output.tolist() == pytest.approx(softmax(scores), rel=1e-12)
    assert stage(ex, "output").values[0].tolist() == pytest.approx(softmax(scores), rel=1e-12)


# --- 2. the values are the engine's and the reference's ------------------------------------

# Options as Python values: the same dict configures sdpa and the loop reference.
ENGINE_CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "causal": {"causal": True},
    "causal-lower-right-window": {"causal": True, "causal_align": "lower-right", "window": (2, 1)},
    "key-lengths-per-item": {"key_lengths": (6, 3)},
    "softcap-alibi-unscaled": {"scale": "none", "softcap": 1.5, "alibi": True},
    "everything": {
        "causal": True,
        "window": (3, 0),
        "key_lengths": (7, 4),
        "softcap": 2.0,
        "alibi": True,
        "temperature": 1.7,
    },
    "dropout": {"causal": True, "dropout": 0.3, "seed": 11},
}
TENSOR_CASES = ("none", "bias", "bool-mask", "float-mask")


def engine_case(name: str, tensors: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors for build_spec, options) of one batched GQA case."""
    q, k, v = gqa_inputs(3)
    extra: dict[str, Any] = {"q": q, "k": k, "v": v}
    if tensors == "bias":
        extra["bias"] = normal(9, 2, 4, 5, 7)
    elif tensors == "bool-mask":
        mask = np.random.default_rng(10).random((5, 7)) < 0.7
        mask[:, 0] = True  # every row keeps a key
        extra["mask"] = mask
    elif tensors == "float-mask":
        extra["mask"] = normal(11, 4, 5, 7)
    return extra, ENGINE_CASES[name]


@pytest.mark.parametrize("tensors", TENSOR_CASES)
@pytest.mark.parametrize("name", sorted(ENGINE_CASES))
def test_stage_values_are_the_traces_and_the_references(name: str, tensors: str) -> None:
    extra, options = engine_case(name, tensors)
    spec = make_spec(
        extra["q"],
        extra["k"],
        extra["v"],
        bias=extra.get("bias"),
        mask=extra.get("mask"),
        **options,
    )
    batch, head, rows = 1, 3, range(1, 4)
    run = run_explain(spec, batch, head, rows)
    ex = run.ex

    steps = shown_steps(spec)
    assert [s.step for s in ex.stages] == steps
    assert [s.name for s in ex.stages] == [EXPLAIN_NAME.get(s, s) for s in steps]
    for st_ in ex.stages:
        want = run.trace.stage(st_.step)
        assert want is not None
        np.testing.assert_allclose(
            st_.values, want[batch, head, 1:4], rtol=1e-12, atol=1e-12, err_msg=st_.step
        )
    assert run.trace.visible is not None
    np.testing.assert_array_equal(ex.visible, run.trace.visible[batch, head, 1:4])
    json_document(ex)  # a strict JSON document, whatever the case

    ref_options = {k: v for k, v in options.items() if k not in ("dropout", "seed")}
    ref = attention(
        extra["q"],
        extra["k"],
        extra["v"],
        bias=extra.get("bias"),
        mask=extra.get("mask"),
        **ref_options,
    )
    at = (batch, head, slice(1, 4))
    np.testing.assert_array_equal(ex.visible, ref.visible[at])
    for step in ("raw", "scaled", "capped", "biased", "masked", "weights"):
        if step in steps:
            np.testing.assert_allclose(
                stage(ex, step).values, getattr(ref, step)[at], rtol=1e-12, atol=1e-12, err_msg=step
            )
    v_slice = extra["v"][batch, head // 2]  # group 2: query head 3 reads K/V head 1
    if "dropped" in steps:
        p = options["dropout"]
        weights, dropped = stage(ex, "weights").values, stage(ex, "dropout").values
        kept = dropped != 0
        np.testing.assert_allclose(dropped[kept], weights[kept] / (1 - p), rtol=1e-12)
        mixing = dropped
    else:
        np.testing.assert_allclose(
            stage(ex, "output").values, ref.output[at], rtol=1e-12, atol=1e-12
        )
        mixing = ref.weights[at]
    by_loops = [
        [sum(mixing[i, j] * v_slice[j, c] for j in range(spec.S)) for c in range(spec.Ev)]
        for i in range(3)
    ]
    np.testing.assert_allclose(stage(ex, "output").values, by_loops, rtol=1e-12, atol=1e-12)


def test_a_gqa_head_reads_kv_head_h_over_group() -> None:
    q, k, v = gqa_inputs(5)
    spec = make_spec(q, k, v)
    assert spec.group == 2
    for head in range(4):
        run = run_explain(spec, 1, head)
        kv = head // 2
        raw = stage(run.ex, "raw").values
        np.testing.assert_allclose(raw, q[1, head] @ k[1, kv].T, rtol=1e-12, atol=1e-12)
        other = k[1, 1 - kv]
        assert not np.allclose(raw, q[1, head] @ other.T)
        assert run.ex.variance is not None
        assert run.ex.variance.sigma_k == pytest.approx(float(np.std(k[1, kv])), rel=1e-12)
        out = stage(run.ex, "output").values
        np.testing.assert_allclose(
            out, stage(run.ex, "weights").values @ v[1, kv], rtol=1e-12, atol=1e-12
        )


def test_slice_at_puts_batch_and_head_on_the_last_two_lead_axes() -> None:
    x = np.zeros((3, 2, 4, 1, 2))
    assert slice_at(make_spec(x, x, x), 1, 3) == (0, 1, 3)
    y = np.zeros((4, 1, 2))
    assert slice_at(make_spec(y, y, y), 1, 3) == (3,)
    z = np.zeros((1, 2))
    assert slice_at(make_spec(z, z, z), 1, 3) == ()


# --- 3. notes and summaries are true numbers ------------------------------------------------

NOTE_CASES: dict[str, dict[str, Any]] = {
    "causal": {"causal": True},
    "window-key-lengths": {"window": (1, 1), "key_lengths": (6, 2)},
    "everything-dropout": {
        "causal": True,
        "causal_align": "lower-right",
        "key_lengths": (7, 5),
        "softcap": 1.0,
        "alibi": True,
        "dropout": 0.4,
        "seed": 3,
    },
}


def note_run(name: str, batch: int = 1, head: int = 2) -> Run:
    q, k, v = gqa_inputs(20)
    return run_explain(make_spec(q, k, v, **NOTE_CASES[name]), batch, head, range(0, 3))


def pre_mask(run: Run) -> F64:
    for step in ("biased", "capped", "scaled"):
        if run.trace.stage(step) is not None:
            return run.whole(step)
    raise AssertionError("no logits")


@pytest.mark.parametrize("name", sorted(NOTE_CASES))
def test_masked_note_counts_what_the_trace_hides(name: str) -> None:
    run = note_run(name)
    note = stage(run.ex, "masked").note
    visible = run.visible
    hidden, cells, pct = find(r"hid ([\d,]+) of ([\d,]+) scores \(([\d.]+)%\)", note)
    assert int(number(hidden)) == int(np.count_nonzero(~visible)) > 0
    assert int(number(cells)) == visible.size == run.spec.L * run.spec.S
    assert float(pct) == pytest.approx(100 * np.count_nonzero(~visible) / visible.size, rel=5e-3)
    fewest, most = find(r"rows see (\d+) … (\d+) keys", note)
    per_row = visible.sum(axis=1)
    assert (int(fewest), int(most)) == (per_row.min(), per_row.max())

    # The weight the mask took away: a softmax of the logits before the mask, by hand.
    mass = []
    for logits, vis in zip(pre_mask(run), visible, strict=True):
        w = softmax(logits.tolist())
        mass.append(sum(x for x, ok in zip(w, vis, strict=True) if not ok))
    mean, worst, row = find(
        r"would have taken ([\d.]+)% of a row's weight on average \(at most ([\d.]+)%, row q(\d+)\)",
        note,
    )
    assert float(mean) == pytest.approx(100 * float(np.mean(mass)), rel=5e-3)
    assert float(worst) == pytest.approx(100 * max(mass), rel=5e-3)
    assert int(row) == int(np.argmax(mass))


def test_masked_note_counts_rows_with_no_key() -> None:
    run = note_run("window-key-lengths")  # batch 1 keeps keys 0 and 1; the window ±1
    empty = int((run.visible.sum(axis=1) == 0).sum())
    assert empty == 2  # rows 3 and 4 see neither key 0 nor key 1
    assert "rows see 0 … 2 keys, 2 rows none." in stage(run.ex, "masked").note


@pytest.mark.parametrize("name", sorted(NOTE_CASES))
def test_summaries_are_numpy_on_the_whole_slice(name: str) -> None:
    run = note_run(name)
    for st_ in run.ex.stages:
        values = run.whole(st_.step)
        if st_.step == "masked":
            values = values[run.visible]  # the masked logits over the keys let through
        finite = values[np.isfinite(values)]
        s = st_.summary
        assert s["count"] == finite.size, st_.step
        assert s["nonfinite"] == values.size - finite.size, st_.step
        assert s["min"] == float(finite.min()), st_.step
        assert s["max"] == float(finite.max()), st_.step
        assert s["mean"] == pytest.approx(float(finite.mean()), rel=1e-12, abs=1e-15), st_.step
        assert s["std"] == pytest.approx(float(finite.std()), rel=1e-9, abs=1e-12), st_.step


def test_raw_note_quotes_the_slices_range_mean_and_std() -> None:
    run = note_run("causal")
    raw = run.whole("raw")
    lo, hi, mean, std = find(
        r"(\S+) … (\S+), mean (\S+), std (\S+) over", stage(run.ex, "raw").note
    )
    assert number(lo) == pytest.approx(float(raw.min()), rel=1e-3)
    assert number(hi) == pytest.approx(float(raw.max()), rel=1e-3)
    assert number(mean) == pytest.approx(float(raw.mean()), rel=1e-3)
    assert number(std) == pytest.approx(float(raw.std()), rel=1e-3)
    assert f"d_k = {run.spec.E}" in stage(run.ex, "raw").note
    assert f"{run.spec.L}×{run.spec.S}" in stage(run.ex, "raw").note


def test_dropout_note_counts_the_weights_dropout_zeroed() -> None:
    run = note_run("everything-dropout")
    weights, dropped = run.whole("weights"), run.whole("dropped")
    note = stage(run.ex, "dropout").note
    zeroed, live = find(r"zeroed ([\d,]+) of ([\d,]+) nonzero weights", note)
    assert int(number(zeroed)) == int(np.count_nonzero((weights > 0) & (dropped == 0))) > 0
    assert int(number(live)) == int(np.count_nonzero(weights > 0))
    assert "p = 0.4" in note
    assert "seed 3" in note
    lo, hi = find(r"row sums now run (\S+) … (\S+) ", note)
    has_keys = run.visible.any(axis=1)
    sums = dropped.sum(axis=1)[has_keys]
    assert number(lo) == pytest.approx(float(sums.min()), rel=1e-3)
    assert number(hi) == pytest.approx(float(sums.max()), rel=1e-3)


def test_capped_note_counts_logits_the_cap_moved() -> None:
    run = note_run("everything-dropout")
    scaled, capped = run.whole("scaled"), run.whole("capped")
    moved = int(np.count_nonzero(np.abs(capped - scaled) > 0.01 * np.abs(scaled)))
    n, cells = find(
        r"([\d,]+) (?:logits? )?of ([\d,]+) (?:logits? )?moved", stage(run.ex, "capped").note
    )
    assert int(number(n)) == moved > 0
    assert int(number(cells)) == scaled.size
    assert np.all(np.abs(capped) < 1.0)  # C = 1: nothing passes ±C


def test_biased_note_counts_rows_whose_top_key_the_bias_moved() -> None:
    """Every row's top key is key 0 before the bias; the bias moves it in rows 0 and 1."""
    q = np.ones((4, 1))
    k = np.array([[3.0], [2.0], [1.0]])
    v = np.eye(3)
    bias = np.zeros((4, 3))
    bias[0, 2] = 10.0  # row 0: key 2 now on top
    bias[1, 1] = 5.0  # row 1: key 1 (2 + 5 > 3)
    bias[2, 0] = 0.1  # row 2: key 0 stays on top
    run = run_explain(make_spec(q, k, v, bias=bias, scale="none"))
    moved, rows = find(r"top key changed in (\d+) of (\d+) rows", stage(run.ex, "biased").note)
    assert (int(moved), int(rows)) == (2, 4)
    assert (
        stage(run.ex, "biased").values.tolist() == (np.array([[3.0, 2.0, 1.0]] * 4) + bias).tolist()
    )


@pytest.mark.parametrize("name", sorted(NOTE_CASES))
def test_row_stats_are_the_weights_rows_by_hand(name: str) -> None:
    run = note_run(name)
    rs = run.ex.row_stats
    assert list(rs.rows) == [0, 1, 2]
    weights, visible = run.whole("weights")[0:3], run.visible[0:3]
    for r in range(3):
        w, vis = weights[r], visible[r]
        n = int(vis.sum())
        assert rs.visible[r] == n
        assert rs.sums[r] == pytest.approx(sum(float(x) for x in w[vis]), abs=1e-15)
        h = entropy_by_hand(w, vis)
        assert rs.entropy[r] == pytest.approx(h, rel=1e-12, abs=1e-15)
        assert rs.normalized_entropy[r] == pytest.approx(
            h / math.log(max(n, 2)), rel=1e-12, abs=1e-15
        )
        assert rs.max_weight[r] == pytest.approx(float(w[vis].max()) if n else 0.0, rel=1e-12)
        if n:
            assert rs.argmax[r] == int(np.argmax(np.where(vis, w, -1.0)))
    listed = rs.to_list()
    assert [row["row"] for row in listed] == [0, 1, 2]
    assert [row["visible"] for row in listed] == visible.sum(axis=1).tolist()


def test_weights_note_quotes_the_slices_rows() -> None:
    run = note_run("causal")
    weights, visible = run.whole("weights"), run.visible
    n_vis = visible.sum(axis=1)
    ok = n_vis >= 2
    max_w = weights.max(axis=1)[ok]
    ent = np.array(
        [
            entropy_by_hand(w, vis) / math.log(n)
            for w, vis, n in zip(weights, visible, n_vis, strict=True)
            if n >= 2
        ]
    )
    note = stage(run.ex, "weights").note
    (deviation,) = find(r"largest deviation ([^)]+)\)", note)
    deviation_by_hand = float(np.abs(weights.sum(axis=1)[n_vis > 0] - 1).max())
    assert number(deviation) == pytest.approx(deviation_by_hand, rel=0.05, abs=1e-300)
    rows, lo, hi, mean = find(
        r"Over the (\d+) rows? with ≥ 2 visible keys: max weight (\S+) … (\S+) \(mean (\S+)\)", note
    )
    assert int(rows) == int(ok.sum())
    assert number(lo) == pytest.approx(float(max_w.min()), rel=1e-3)
    assert number(hi) == pytest.approx(float(max_w.max()), rel=1e-3)
    assert number(mean) == pytest.approx(float(max_w.mean()), rel=1e-3)
    e_lo, e_hi = find(r"entropy (\S+) … (\S+) of its maximum", note)
    assert number(e_lo) == pytest.approx(float(ent.min()), rel=1e-3)
    assert number(e_hi) == pytest.approx(float(ent.max()), rel=1e-3)
    one_hot, uniform = find(r"(\d+) one-hot .*?(\d+) near uniform", note)
    assert int(one_hot) == int((max_w >= 0.99).sum())
    assert int(uniform) == int(((ent >= 0.98) & (max_w < 0.99)).sum())


@pytest.mark.parametrize("name", sorted(NOTE_CASES))
def test_variance_fields_are_numpy_stds_of_the_slice(name: str) -> None:
    run = note_run(name)
    q, k, _ = gqa_inputs(20)
    var = run.ex.variance
    assert var is not None
    E = run.spec.E
    raw, scaled = run.whole("raw"), run.whole("scaled")
    assert var.E == E
    assert var.sigma_q == pytest.approx(float(np.std(q[1, 2])), rel=1e-12)
    assert var.sigma_k == pytest.approx(float(np.std(k[1, 1])), rel=1e-12)  # head 2 → kv head 1
    assert var.predicted_raw_std == pytest.approx(
        math.sqrt(E) * float(np.std(q[1, 2])) * float(np.std(k[1, 1])), rel=1e-12
    )
    assert var.raw_std == pytest.approx(float(raw.std()), rel=1e-9)
    assert var.scaled_std == pytest.approx(float(scaled.std()), rel=1e-9)
    assert var.factor == pytest.approx(1 / math.sqrt(E), rel=1e-15)
    assert var.sqrt_dk_std == pytest.approx(float(raw.std()) / math.sqrt(E), rel=1e-9)
    d = var.to_dict()
    assert d["d_k"] == E
    assert d["effective_scale"] == var.factor


def test_variance_with_a_temperature_and_a_given_scale() -> None:
    q, k, v = gqa_inputs(21)
    run = run_explain(make_spec(q, k, v, scale=0.3, temperature=2.0), 0, 1)
    var = run.ex.variance
    assert var is not None
    assert var.factor == pytest.approx(0.15, rel=1e-15)
    assert var.scaled_std == pytest.approx(float(run.whole("raw").std()) * 0.15, rel=1e-9)


def test_variance_under_prescale_is_the_std_of_q_k_transposed() -> None:
    """With --prescale the raw stage already holds c·QKᵀ; the variance undoes c."""
    q, k, v = normal(1, 3, 4), normal(2, 3, 4), normal(3, 3, 2)
    run = run_explain(make_spec(q, k, v, prescale=True, scale="dk"))
    np.testing.assert_allclose(stage(run.ex, "raw").values, (q @ k.T) / 4, rtol=1e-12)
    var = run.ex.variance
    assert var is not None
    assert var.factor == 0.25
    assert var.raw_std == pytest.approx(float(np.std(q @ k.T)), rel=1e-9)
    assert var.scaled_std == pytest.approx(float(np.std(q @ k.T)) / 4, rel=1e-9)


# --- 4. properties --------------------------------------------------------------------------

VALUES = st.floats(-3, 3, allow_nan=False, allow_infinity=False)


@dataclass(frozen=True)
class Problem:
    """(H, L, E) queries, (H, S, E) keys, (H, S, Ev) values, a boolean mask, options."""

    q: F64
    k: F64
    v: F64
    mask: NDArray[np.bool_] | None
    options: dict[str, Any]

    def spec(self, **changes: Any) -> AttentionSpec:
        parts = {"q": self.q, "k": self.k, "v": self.v, "mask": self.mask, **changes}
        return make_spec(
            parts["q"],
            parts["k"],
            parts["v"],
            mask=parts["mask"],
            bias=parts.get("bias"),
            **self.options,
        )


@st.composite
def problems(draw: st.DrawFn, positional: bool = True) -> Problem:
    H, L, S = draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(1, 5))
    E, Ev = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    q = draw(arrays(np.float64, (H, L, E), elements=VALUES))
    k = draw(arrays(np.float64, (H, S, E), elements=VALUES))
    v = draw(arrays(np.float64, (H, S, Ev), elements=VALUES))
    mask = draw(st.none() | arrays(np.bool_, (H, L, S), elements=st.booleans()))
    options: dict[str, Any] = {
        "scale": draw(st.sampled_from(["sqrt-dk", "dk", "none", 0.7])),
        "softcap": draw(st.none() | st.sampled_from([1.0, 5.0])),
    }
    if positional:
        options["causal"] = draw(st.booleans())
        options["window"] = draw(st.none() | st.tuples(st.integers(0, 2), st.integers(0, 2)))
        options["key_lengths"] = draw(st.none() | st.integers(0, S).map(lambda n: (n,)))
    return Problem(q, k, v, mask, options)


@BOUNDED
@given(problems(), st.data())
def test_weight_rows_with_a_visible_key_sum_to_one(problem: Problem, data: st.DataObject) -> None:
    spec = problem.spec()
    head = data.draw(st.integers(0, spec.H - 1))
    run = run_explain(spec, 0, head)
    weights = stage(run.ex, "weights").values
    has_key = run.ex.visible.any(axis=1)
    np.testing.assert_allclose(weights.sum(axis=1)[has_key], 1.0, rtol=0, atol=1e-12)
    assert np.all(weights[~has_key] == 0.0)  # no visible key: zero weights under −inf
    assert np.all(weights[~run.ex.visible] == 0.0)
    assert np.all((weights >= 0) & (weights <= 1))


@BOUNDED
@given(problems(), st.data())
def test_a_constant_per_row_bias_leaves_the_weights_unchanged(
    problem: Problem, data: st.DataObject
) -> None:
    spec = problem.spec()
    H, L = spec.H, spec.L
    shift = data.draw(arrays(np.float64, (H, L, 1), elements=st.floats(-30, 30)))
    head = data.draw(st.integers(0, H - 1))
    plain = run_explain(spec, 0, head).ex
    shifted = run_explain(problem.spec(bias=shift), 0, head).ex
    before = stage(plain, "scaled" if problem.options["softcap"] is None else "capped")
    np.testing.assert_allclose(
        stage(shifted, "biased").values, before.values + shift[head], rtol=1e-12, atol=1e-12
    )
    np.testing.assert_allclose(
        stage(shifted, "weights").values, stage(plain, "weights").values, rtol=0, atol=1e-12
    )
    np.testing.assert_allclose(
        stage(shifted, "output").values, stage(plain, "output").values, rtol=0, atol=1e-11
    )


@BOUNDED
@given(problems(positional=False), st.data())
def test_permuting_keys_permutes_weights_and_keeps_the_output(
    problem: Problem, data: st.DataObject
) -> None:
    S = problem.k.shape[1]
    perm = np.array(data.draw(st.permutations(range(S))), dtype=np.int64)
    mask = None if problem.mask is None else problem.mask[..., perm]
    plain = run_explain(problem.spec()).ex
    permuted = run_explain(problem.spec(k=problem.k[:, perm], v=problem.v[:, perm], mask=mask)).ex
    np.testing.assert_allclose(
        stage(permuted, "weights").values,
        stage(plain, "weights").values[:, perm],
        rtol=0,
        atol=1e-12,
    )
    np.testing.assert_allclose(
        stage(permuted, "output").values, stage(plain, "output").values, rtol=0, atol=1e-11
    )


@BOUNDED
@given(problems(), st.data())
def test_scorecard_contributions_add_up_to_the_output(
    problem: Problem, data: st.DataObject
) -> None:
    dropout = data.draw(st.sampled_from([0.0, 0.5]))
    spec = make_spec(
        problem.q, problem.k, problem.v, mask=problem.mask, dropout=dropout, **problem.options
    )
    query = data.draw(st.integers(0, spec.L - 1))
    ex = run_explain(spec, 0, 0, query=query).ex
    card = ex.scorecard
    assert card is not None
    assert card.dropout == (dropout > 0)
    total = np.sum([key.contribution for key in card.keys], axis=0)
    np.testing.assert_allclose(total, card.output, rtol=1e-12, atol=1e-12)
    mixing = stage(ex, "dropout" if dropout else "weights").values[query]
    np.testing.assert_allclose([key.weight for key in card.keys], mixing, rtol=1e-12, atol=1e-15)
    json_document(ex)
    logits = [key.logit for key in card.keys if key.visible]
    if logits:
        m = max(logits)
        assert card.logit_max == m
        assert card.z == pytest.approx(sum(math.exp(x - m) for x in logits), rel=1e-12)
        if not dropout:
            for key in card.keys:
                assert key.weight == pytest.approx(key.exp / card.z, rel=1e-12, abs=1e-300)
    else:
        assert card.z == 0.0
        assert card.output.tolist() == [0.0] * spec.Ev
    for key in card.keys:
        assert key.terms is not None  # E ≤ 4: written out
        assert key.raw == pytest.approx(sum(a * b for a, b in key.terms), rel=1e-12, abs=1e-12)


# --- 5. findings in their place ----------------------------------------------------------------


def saturated_in_head_1() -> AttentionSpec:
    """Batch 1, two heads; head 1's row 0 puts almost all weight on key 2."""
    q = normal(30, 1, 2, 4, 8)
    k = normal(31, 1, 2, 4, 8)
    key = k[0, 1, 2]
    q[0, 1, 0] = 60.0 * key / float(key @ key)  # q·k_2 = 60: a logit of 60/√8 ≈ 21 for key 2
    return make_spec(q, k, normal(32, 1, 2, 4, 3))


def test_saturated_finding_sits_under_weights_of_its_own_head() -> None:
    spec = saturated_in_head_1()
    run = run_explain(spec, 0, 1)
    saturated = [f for f in run.diagnosis.findings if f.kind == "saturated"]
    assert [f.index for f in saturated] == [(0, 1, 0)]  # only head 1, row 0
    assert run.trace.stats.max_weight[0, 1, 0] >= 0.99

    here = {s.name: [f.kind for f in s.findings] for s in run.ex.stages}
    assert "saturated" in here["weights"]
    assert all("saturated" not in kinds for name, kinds in here.items() if name != "weights")
    assert not any(f.kind == "saturated" for f in run.ex.elsewhere)
    assert run.ex.row_stats.flags.get(0) == ("one-hot", "warning")


def test_other_heads_list_the_saturated_row_elsewhere() -> None:
    run = run_explain(saturated_in_head_1(), 0, 0)
    assert all(f.kind != "saturated" for s in run.ex.stages for f in s.findings)
    assert all(f.kind != "saturated" for f in run.ex.input_findings)
    elsewhere = [f for f in run.ex.elsewhere if f.kind == "saturated"]
    assert [f.index for f in elsewhere] == [(0, 1, 0)]
    summary = elsewhere_summary(run.ex.elsewhere, run.ex.lead)
    assert summary is not None
    assert "saturated in [0, 1]" in summary
    assert run.ex.row_stats.flags == {}


def test_unscaled_finding_has_no_index_and_appears_at_scaled_in_every_slice() -> None:
    q, k, v = normal(40, 1, 2, 6, 16), normal(41, 1, 2, 6, 16), normal(42, 1, 2, 6, 2)
    spec = make_spec(q, k, v, scale="none")
    for head in (0, 1):
        run = run_explain(spec, 0, head)
        (unscaled,) = [f for f in run.diagnosis.findings if f.kind == "unscaled"]
        assert unscaled.index is None
        assert unscaled.stage == "scaled"
        assert unscaled in stage(run.ex, "scaled").findings
        assert unscaled not in run.ex.elsewhere
        assert all(unscaled not in s.findings for s in run.ex.stages if s.name != "scaled")


def test_unscaled_seed_example_puts_the_finding_at_scaled() -> None:
    ex = run_explain(sample_spec("scale_comparison.yaml", scale="none")).ex
    assert [f.kind for f in stage(ex, "scaled").findings] == ["unscaled"]
    assert "saturated" in [f.kind for f in stage(ex, "weights").findings]


def test_fully_masked_rows_are_findings_at_masked() -> None:
    spec = sample_spec("causal.yaml", key_lengths=0)
    ex = run_explain(spec).ex
    kinds = [f.kind for f in stage(ex, "masked").findings]
    assert kinds == ["fully_masked"] * 3
    assert [f.index for f in stage(ex, "masked").findings] == [(0,), (1,), (2,)]
    assert stage(ex, "weights").values.tolist() == [[0.0] * 3] * 3


def test_a_finding_at_a_stage_not_shown_goes_to_the_stage_before_it() -> None:
    """Nothing masks, so ``masked`` is not shown: its overflow is told at ``biased``."""
    bias = np.zeros((3, 3))
    bias[1, 2] = 1e5  # beyond float16's 65504 once added to the logits
    run = run_explain(make_spec(normal(1, 3, 4), normal(2, 3, 4), normal(3, 3, 2), bias=bias))
    overflow = [f for f in run.diagnosis.findings if f.kind == "overflow" and f.stage == "masked"]
    assert [f.index for f in overflow] == [(1, 2)] * len(overflow)
    assert {f.dtype for f in overflow} >= {"float16"}
    assert run.ex.stage("masked") is None
    assert all(f in stage(run.ex, "biased").findings for f in overflow)
    assert all(f not in run.ex.elsewhere and f not in run.ex.input_findings for f in overflow)


def test_a_nan_in_a_kv_head_is_an_input_finding_of_the_query_heads_that_read_it() -> None:
    q, k, v = normal(50, 1, 4, 3, 4), normal(51, 1, 2, 5, 4), normal(52, 1, 2, 5, 3)
    k[0, 1, 2, 0] = math.nan  # K/V head 1 serves query heads 2 and 3
    spec = make_spec(q, k, v)
    for head in range(4):
        ex = run_explain(spec, 0, head).ex
        reads_nan = bool(np.isnan(stage(ex, "raw").values).any())
        assert reads_nan == (head >= 2)
        inputs = [f for f in ex.input_findings if f.kind == "nonfinite"]
        assert bool(inputs) == reads_nan, f"head {head}"


# --- 6. a scorecard over many keys ------------------------------------------------------------


def test_scorecard_lists_the_heaviest_keys_heaviest_first() -> None:
    S, limit = 40, 5
    logits = np.random.default_rng(60).permutation(S) * 0.1  # distinct: no ties
    spec = make_spec(np.ones((1, 1)), logits[:, None], normal(61, S, 2), scale="none")
    ex = run_explain(spec, query=0, key_limit=limit).ex
    card = ex.scorecard
    assert card is not None
    heaviest = [int(j) for j in np.argsort(-logits)[:limit]]
    assert card.shown == tuple(heaviest)
    assert [card.keys[j].weight for j in card.shown] == sorted(
        (card.keys[j].weight for j in card.shown), reverse=True
    )
    assert len(card.keys) == S  # every key is scored; the scorecard lists `shown`
    weights = softmax(logits.tolist())
    others = [j for j in range(S) if j not in heaviest]
    assert card.rest_weight == pytest.approx(sum(weights[j] for j in others), rel=1e-12)
    assert card.rest_weight == pytest.approx(1 - sum(weights[j] for j in heaviest), rel=1e-10)
    rest = np.sum([card.keys[j].contribution for j in others], axis=0)
    np.testing.assert_allclose(card.rest_contribution, rest, rtol=1e-12)
    shown_part = np.sum([card.keys[j].contribution for j in card.shown], axis=0)
    np.testing.assert_allclose(shown_part + card.rest_contribution, card.output, rtol=1e-12)
    assert json_document(ex)["scorecard"]["shown_keys"] == heaviest

    everything = run_explain(spec, query=0, key_limit=S).ex.scorecard
    assert everything is not None
    assert everything.shown == tuple(range(S))
    assert everything.rest_weight == 0.0


def test_a_scorecard_of_a_masked_row_lists_its_visible_keys_never_the_masked() -> None:
    # Regression: q5 of a causal 40-key input listed k0..k15 in key order, ten of them
    # masked, with contribution lines "0.000000 · v6".
    S = 40
    logits = np.random.default_rng(62).normal(size=S)
    spec = make_spec(np.ones((6, 1)), logits[:, None], normal(63, S, 2), scale="none", causal=True)
    card = run_explain(spec, query=5, key_limit=16).ex.scorecard
    assert card is not None
    assert card.n_visible == 6
    visible = logits[:6]
    assert card.shown == tuple(int(j) for j in np.argsort(-visible))
    assert all(card.keys[j].visible for j in card.shown)
    assert card.rest_weight == 0.0


def test_scorecard_of_a_masked_query_hides_its_future_keys() -> None:
    ex = run_explain(sample_spec("causal.yaml"), query=1).ex
    card = ex.scorecard
    assert card is not None
    assert [k.visible for k in card.keys] == [True, True, False]
    assert card.keys[2].logit == -math.inf
    assert card.keys[2].exp == 0.0
    assert card.keys[2].weight == 0.0
    assert card.keys[2].contribution.tolist() == [0.0, 0.0]
    logits = [2 / SQRT2, 4 / SQRT2]
    assert card.z == pytest.approx(sum(math.exp(x - logits[1]) for x in logits), rel=1e-12)
    assert card.output.tolist() == pytest.approx([1.80443, 0.0], abs=5e-6)


# --- 7. the JSON document -------------------------------------------------------------------


def json_cases() -> dict[str, Run]:
    q, k, v = gqa_inputs(70)
    nan_q = q.copy()
    nan_q[1, 3, 2, 0] = math.nan
    nan_v = v.copy()
    nan_v[1, 1, 4, 1] = math.inf
    return {
        "seed-003": run_explain(sample_spec("scorecard.yaml"), query=0, scales=True),
        "causal": run_explain(sample_spec("causal.yaml"), query=2),
        "padded-nan": run_explain(sample_spec("padded_nan.yaml"), query=0),
        "fp16-overflow": run_explain(sample_spec("fp16_overflow.yaml", dtype="float16"), query=0),
        "everything": run_explain(
            make_spec(q, k, v, **NOTE_CASES["everything-dropout"]),
            1,
            3,
            range(1, 4),
            query=2,
            scales=True,
        ),
        "nan-inputs": run_explain(
            make_spec(nan_q, k, nan_v, causal=True), 1, 3, query=2, scales=True
        ),
        "finite-mask-value": run_explain(
            make_spec(q, k, v, key_lengths=(0, 3), mask_value=-1e9), 0, 1, scales=True
        ),
    }


def test_json_document_of_every_case() -> None:
    for name, run in json_cases().items():
        ex = run.ex
        data = json_document(ex)  # allow_nan=False: no bare NaN or Infinity anywhere
        rows = ex.rows
        names = [EXPLAIN_NAME.get(s, s) for s in shown_steps(run.spec)]
        assert [s["name"] for s in data["stages"]] == names, name
        assert "dropped" not in [s["name"] for s in data["stages"]]
        assert data["slice"]["rows"] == [rows.start, rows.stop]
        assert data["slice"]["queries"] == run.spec.L
        assert data["slice"]["keys"] == run.spec.S
        for entry, st_ in zip(data["stages"], ex.stages, strict=True):
            values = entry["values"]
            width = run.spec.Ev if st_.step == "output" else run.spec.S
            assert len(values) == len(rows), (name, st_.step)
            assert all(len(r) == width for r in values), (name, st_.step)
            for row_json, row in zip(values, st_.values, strict=True):
                for x_json, x in zip(row_json, row, strict=True):
                    if math.isnan(x):
                        assert x_json == "NaN"
                    elif math.isinf(x):
                        assert x_json == ("Infinity" if x > 0 else "-Infinity")
                    else:
                        assert x_json == x
            assert isinstance(entry["note"], str)
            assert entry["note"] == st_.note
            assert isinstance(entry["findings"], list)
            assert [f["kind"] for f in entry["findings"]] == [f.kind for f in st_.findings]
            assert ("visible" in entry) == (st_.step == "masked")
            assert ("rows" in entry) == (st_.step == "weights")
            if st_.step == "masked":
                assert entry["visible"] == ex.visible.tolist()
            if st_.step == "weights":
                assert [r["row"] for r in entry["rows"]] == list(rows)
                assert [r["visible"] for r in entry["rows"]] == ex.visible.sum(axis=1).tolist()
        assert [f["kind"] for f in data["findings"]] == [f.kind for f in run.diagnosis.findings]


def test_json_hidden_logits_are_minus_infinity_strings() -> None:
    data = json_document(run_explain(sample_spec("causal.yaml")).ex)
    masked = next(s for s in data["stages"] if s["name"] == "masked")
    assert masked["values"][0][1:] == ["-Infinity", "-Infinity"]
    assert masked["values"][1][2] == "-Infinity"
    assert masked["values"][2] == pytest.approx([3 / SQRT2, 6 / SQRT2, 9 / SQRT2], rel=1e-12)
    assert masked["visible"] == [[True, False, False], [True, True, False], [True, True, True]]
    weights = next(s for s in data["stages"] if s["name"] == "weights")
    assert weights["values"][0] == [1.0, 0.0, 0.0]
    assert [r["visible"] for r in weights["rows"]] == [1, 2, 3]


def test_json_names_the_dropout_stage_dropout() -> None:
    q, k, v = gqa_inputs(71)
    ex = run_explain(make_spec(q, k, v, dropout=0.2), 0, 0).ex
    names = [s["name"] for s in json_document(ex)["stages"]]
    assert names == ["raw", "scaled", "weights", "dropout", "output"]
    ex = run_explain(make_spec(q, k, v, dropout=0.2, causal=True), 0, 0).ex
    names = [s["name"] for s in json_document(ex)["stages"]]
    assert names == ["raw", "scaled", "masked", "weights", "dropout", "output"]


def test_json_of_nan_inputs_writes_nan_strings_and_the_nonfinite_findings() -> None:
    run = json_cases()["nan-inputs"]
    data = json_document(run.ex)
    raw = next(s for s in data["stages"] if s["name"] == "raw")
    assert all(x == "NaN" for x in raw["values"][2])  # query 2 of head 3 holds the NaN
    assert all(isinstance(x, float) for i in (0, 1, 3, 4) for x in raw["values"][i])
    assert raw["summary"]["nonfinite"] == run.spec.S  # one query row of the slice
    kinds = {f["kind"] for f in data["findings"]}
    assert "nonfinite" in kinds


# --- 8. PyTorch ------------------------------------------------------------------------------


@pytest.mark.parametrize("masking", ["causal", "boolean mask"])
def test_torch_sdpa_on_the_slice_matches_the_explained_output(masking: str) -> None:
    torch = pytest.importorskip("torch")
    attention_mod = pytest.importorskip("torch.nn.attention")
    q, k, v = gqa_inputs(80)
    batch, head = 1, 3
    mask = None
    if masking == "boolean mask":
        mask = np.random.default_rng(81).random((5, 7)) < 0.6
        mask[:, 3] = True
        spec = make_spec(q, k, v, mask=mask)
    else:
        spec = make_spec(q, k, v, causal=True)
    ex = run_explain(spec, batch, head).ex
    qs, ks, vs = (
        torch.from_numpy(np.ascontiguousarray(a))
        for a in (q[batch, head], k[batch, 1], v[batch, 1])
    )
    with attention_mod.sdpa_kernel(attention_mod.SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(
            qs,
            ks,
            vs,
            attn_mask=None if mask is None else torch.from_numpy(mask),
            is_causal=mask is None,
        ).numpy()
    assert out.dtype == np.float64
    np.testing.assert_allclose(stage(ex, "output").values, out, rtol=1e-12, atol=1e-13)
    mixed = stage(ex, "weights").values @ v[batch, 1]
    np.testing.assert_allclose(mixed, out, rtol=1e-12, atol=1e-13)


# --- 9. edge cases ----------------------------------------------------------------------------


def test_no_queries() -> None:
    run = run_explain(make_spec(np.zeros((0, 4)), normal(90, 3, 4), normal(91, 3, 2)), scales=True)
    ex = run.ex
    assert [s.values.shape for s in ex.stages] == [(0, 3)] * (len(ex.stages) - 1) + [(0, 2)]
    assert all(s.summary["count"] == 0 for s in ex.stages)
    assert ex.variance is None
    assert ex.row_stats.to_list() == []
    assert "L = 0 queries and S = 3 keys" in stage(ex, "raw").note
    assert ex.scales_verdict is not None
    assert "nothing to compare" in ex.scales_verdict
    data = json_document(ex)
    assert [s["values"] for s in data["stages"]] == [[]] * len(ex.stages)
    assert data["variance"] is None
    assert data["slice"]["rows"] == [0, 0]


def test_no_keys() -> None:
    run = run_explain(make_spec(normal(92, 3, 4), np.zeros((0, 4)), np.zeros((0, 2))), query=1)
    ex = run.ex
    assert stage(ex, "weights").values.shape == (3, 0)
    assert stage(ex, "output").values.tolist() == [[0.0, 0.0]] * 3  # nothing to mix
    assert "L = 3 queries and S = 0 keys" in stage(ex, "weights").note
    assert "every output row is zero" in stage(ex, "output").note
    assert ex.row_stats.visible.tolist() == [0, 0, 0]
    assert ex.row_stats.sums.tolist() == [0.0] * 3
    card = ex.scorecard
    assert card is not None
    assert card.keys == ()
    assert card.z == 0.0
    assert card.sum_exp == 0.0
    assert card.shown == ()
    assert card.output.tolist() == [0.0, 0.0]
    data = json_document(ex)
    assert next(s for s in data["stages"] if s["name"] == "weights")["values"] == [[], [], []]
    assert data["scorecard"]["keys"] == []
    assert data["scorecard"]["logit_max"] == "-Infinity"


def test_emulated_float16_values_differ_but_the_notes_still_hold() -> None:
    q, k, v = gqa_inputs(95)
    exact = run_explain(make_spec(q, k, v, causal=True), 1, 2)
    half = run_explain(make_spec(q, k, v, causal=True, dtype="float16"), 1, 2)
    for step in ("raw", "weights", "output"):
        a, b = stage(half.ex, step).values, stage(exact.ex, step).values
        finite = np.isfinite(b) & (b != 0)
        assert not np.array_equal(a, b), step
        np.testing.assert_allclose(a[finite], b[finite], rtol=2e-2, atol=2e-3, err_msg=step)
        # The emulated values are float16 numbers, and the emulated trace's.
        assert np.array_equal(
            a[np.isfinite(a)].astype(np.float16).astype(np.float64), a[np.isfinite(a)]
        )
        np.testing.assert_array_equal(a, half.whole(step)[: a.shape[0]])

    # The notes describe the emulated values, and what they say is still true.
    assert (
        stage(half.ex, "masked").note.split(";")[0] == stage(exact.ex, "masked").note.split(";")[0]
    )
    weights, visible = half.whole("weights"), half.visible
    deviation = float(np.abs(weights.sum(axis=1)[visible.any(axis=1)] - 1).max())
    assert deviation > 1e-6  # float16 weights do not sum to 1 exactly
    (said,) = find(r"largest deviation ([^)]+)\)", stage(half.ex, "weights").note)
    assert number(said) == pytest.approx(deviation, rel=0.05)
    for st_ in half.ex.stages:
        values = half.whole(st_.step)
        if st_.step == "masked":
            values = values[visible]
        finite = values[np.isfinite(values)]
        assert st_.summary["min"] == float(finite.min())
        assert st_.summary["max"] == float(finite.max())
    card = run_explain(make_spec(q, k, v, causal=True, dtype="float16"), 1, 2, query=4).ex.scorecard
    assert card is not None
    total = np.sum([key.contribution for key in card.keys], axis=0)
    np.testing.assert_allclose(total, card.output, rtol=0, atol=2e-3)  # output stored in float16


# --- regressions (bugs found while writing these tests) --------------------------------------------------------------------------------


def test_summary_std_survives_a_large_common_offset() -> None:
    q = np.array([[1e4, 1.0], [1e4, 2.0], [1e4, -1.0]])
    k = np.array([[1e4, 0.3], [1e4, -2.0], [1e4, 1.5]])
    run = run_explain(make_spec(q, k, np.eye(3), scale="none"))
    raw = run.whole("raw")
    assert stage(run.ex, "raw").summary["std"] == pytest.approx(float(raw.std()), rel=1e-6)


def test_a_float_mask_of_minus_inf_is_not_called_hiding_nothing() -> None:
    q, k, v = normal(100, 3, 4), normal(101, 3, 4), normal(102, 3, 2)
    mask = np.zeros((3, 3))
    mask[:, 2] = -math.inf
    ex = run_explain(make_spec(q, k, v, mask=mask)).ex
    masked = stage(ex, "masked")
    assert np.all(masked.values[:, 2] == -math.inf)
    assert np.all(stage(ex, "weights").values[:, 2] == 0.0)
    assert "every key is visible" not in masked.note


def test_masked_note_keeps_the_mask_file_name_as_given() -> None:
    q, k, v = normal(103, 3, 4), normal(104, 3, 4), normal(105, 3, 2)
    mask = np.tril(np.ones((3, 3), dtype=bool))
    spec = make_spec(q, k, v, mask=mask, names={"mask": "Masks/Pad_Mask.npy"})
    assert "Masks/Pad_Mask.npy" in stage(run_explain(spec).ex, "masked").note


def test_weights_note_on_rows_with_no_key_under_a_finite_mask_value() -> None:
    ex = run_explain(sample_spec("causal.yaml", key_lengths=0, mask_value="-1e9")).ex
    weights = stage(ex, "weights")
    assert weights.values == pytest.approx(np.full((3, 3), 1 / 3), rel=1e-12)
    assert "get zero weights" not in weights.note


def test_row_sums_count_every_key_under_a_finite_mask_value() -> None:
    """A row with no visible key under −1e9 spreads its weight over the hidden keys:
    no key is visible and none carries a visible weight, yet the weights sum to 1."""
    run = run_explain(sample_spec("causal.yaml", key_lengths=0, mask_value="-1e9"))
    rs = run.ex.row_stats
    assert rs.visible.tolist() == [0, 0, 0]
    assert rs.max_weight.tolist() == [0.0, 0.0, 0.0]
    assert rs.sums.tolist() == pytest.approx([1.0, 1.0, 1.0], rel=1e-12)


def test_notes_on_nan_inputs_count_them_and_do_not_guess() -> None:
    """padded_nan: K and V rows of the padded key are NaN. The raw note counts the NaN
    scores; the mask note does not claim a share of weight the NaN keys would have had."""
    ex = run_explain(sample_spec("padded_nan.yaml")).ex
    raw = run_explain(sample_spec("padded_nan.yaml")).whole("raw")
    bad = int((~np.isfinite(raw)).sum())
    assert bad == 2
    assert f"({bad} not finite)" in stage(ex, "raw").note
    masked = stage(ex, "masked").note
    assert "2 hidden scores are NaN or inf themselves" in masked
    assert "would have taken 0%" not in masked


def test_the_mask_note_names_this_batch_items_key_length() -> None:
    """cross.yaml: key lengths 5 and 3; batch item 1's note speaks of its own 3."""
    spec = sample_spec("cross.yaml")
    lengths = spec.options.key_lengths
    assert lengths is not None
    assert len(lengths) == 2
    for b in (0, 1):
        note = stage(run_explain(spec, b, 0).ex, "masked").note
        assert f"key length {lengths[b]} (batch item {b})" in note.lower()
