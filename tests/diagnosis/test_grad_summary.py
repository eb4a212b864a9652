"""Gradient health gathered slice by slice: the figures of the whole gradients, whatever
the backward pass keeps, and a non-finite value named by its index in the file."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from attention_cases import make_spec

from sdpa_cli.diagnosis import grad_summary
from sdpa_cli.diagnosis.findings import Thresholds
from sdpa_cli.diagnosis.grad import backward_health, diagnose_grad
from sdpa_cli.diagnosis.grad_summary import GradSummary, summarise
from sdpa_cli.engine.grad import SLICED, backward, make_dout
from sdpa_cli.engine.options import Options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.engine.types import F64, Index


def _poisoned() -> Any:
    spec = make_spec(2, causal=True, spread=30.0)
    grads = backward(spec, make_dout(spec, "random", 3, "--dout"))
    grads.dk[1, 0, 4, 2] = np.nan  # one non-finite value, found by its chunk
    grads.dv[0, 1, 3, 1] = 1e6  # beyond float16
    grads.dq[0, 0, 2, 0] = 1e-9  # subnormal in float16
    return grads


def test_ranges_and_non_finite_values_read_in_chunks_equal_one_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grads = _poisoned()
    whole = diagnose_grad(grads, Thresholds(), "float16")
    monkeypatch.setattr(grad_summary, "CHUNK", 7)  # chunks that cut rows and slices
    chunked = diagnose_grad(grads, Thresholds(), "float16")
    assert chunked.ranges == whole.ranges
    assert [f.to_dict() for f in chunked.findings] == [f.to_dict() for f in whole.findings]
    kinds = {(f.kind, f.stage) for f in whole.findings}
    assert ("gradient_nonfinite", "dk") in kinds
    assert ("gradient_range", "dv") in kinds
    overflow = [r for r in whole.ranges if (r.name, r.dtype) == ("dv", "float16")]
    assert overflow[0].overflow == 1


def test_the_summary_counts_what_the_whole_tensor_holds() -> None:
    grads = _poisoned()
    grads.dq[1, 1, 0, :2] = [np.inf, -np.inf]
    grads.dq[0, 1, 5, 3] = np.nan
    t = summarise(grads, "float16").tallies
    assert (t["dq"].nonfinite, t["dq"].nans, t["dq"].first_bad) == (3, 1, (0, 1, 5, 3))
    assert (t["dk"].nonfinite, t["dk"].nans, t["dk"].first_bad) == (1, 1, (1, 0, 4, 2))
    assert t["dv"].nonfinite == 0
    assert t["dv"].first_bad is None
    finite = np.isfinite(grads.dv)
    assert t["dv"].max_abs == np.abs(grads.dv[finite]).max() == 1e6
    assert t["dv"].nonzero == np.count_nonzero(grads.dv[finite])
    assert t["dv"].tallies["float16"][0] == 1  # 1e6 overflows float16 (max 65504)
    assert t["dv"].tallies["bfloat16"][0] == 0
    for name in SLICED:
        values = grads.tensor(name)
        for index, n in t[name].norms.items():
            assert n == pytest.approx(np.linalg.norm(values[index]), rel=1e-14, nan_ok=True)
    assert t["dv"].norm() == pytest.approx(np.linalg.norm(grads.dv), rel=1e-14)


def test_norms_keep_a_vanishing_gradient_from_underflowing() -> None:
    spec = make_spec(1, B=1, H=1, G=1)
    summary = GradSummary(spec, "float64")
    summary.add("dq", (0, 0), np.full((13, 4), 1e-200))
    assert summary.norm("dq") == pytest.approx(1e-200 * np.sqrt(52), rel=1e-14)


@pytest.mark.parametrize("jobs", [1, 2])
def test_keeping_one_slice_judges_the_gradients_as_keeping_all(jobs: int) -> None:
    """Every slice is judged as the pass finishes it: the diagnosis does not depend on
    what is kept, and a kept slice is bit for bit the one of the whole pass."""
    spec = make_spec(4, causal=True, spread=8.0, H=4, G=2, dtype="float16")
    dout = make_dout(spec, "random", 5, "--dout")
    all_grads, all_health = backward_health(spec, dout, Thresholds(), jobs=jobs)
    lead = (1, 2)
    one, health = backward_health(spec, dout, Thresholds(), jobs=jobs, keep={lead})
    assert health == all_health
    for name in SLICED:
        np.testing.assert_array_equal(one.at(name, lead), all_grads.at(name, lead))
    with pytest.raises(ValueError, match="not kept"):
        one.at("dq", (0, 0))
    with pytest.raises(ValueError, match="some slices only"):
        one.tensor("dk")
    assert one.tensor("dbias") is None  # summed to the end, always whole


def test_every_slice_is_handed_over_once_after_its_last_reader() -> None:
    """Under grouped-query attention a K/V head is finished after its group's last
    query head; a slice no block reaches (no query rows) is handed over too, as zeros."""
    spec = make_spec(6, H=4, G=2)
    seen: list[tuple[str, Index]] = []
    got: dict[tuple[str, Index], F64] = {}

    def sink(name: str, index: Index, values: F64) -> None:
        seen.append((name, index))
        got[name, index] = values.copy()

    grads = backward(spec, make_dout(spec, "ones", 0, "--dout"), rows=4, on_slice=sink)
    assert sorted(seen) == sorted(set(seen))
    assert len(seen) == 8 + 4 + 4  # dQ per query head, dK and dV per K/V head
    for (name, index), values in got.items():
        np.testing.assert_array_equal(values, grads.tensor(name)[index])  # type: ignore[index]
    at = {key: i for i, key in enumerate(seen)}
    assert at["dk", (0, 0)] < at["dq", (1, 0)]  # K/V head 0 of batch 0: before batch 1
    empty = build_spec(np.zeros((1, 0, 4)), np.ones((1, 3, 4)), np.ones((1, 3, 2)))
    handed: list[tuple[str, Index]] = []
    backward(
        empty, make_dout(empty, "ones", 0, "--dout"), on_slice=lambda n, i, v: handed.append((n, i))
    )
    assert sorted(handed) == [("dk", (0,)), ("dq", (0,)), ("dv", (0,))]


def test_a_non_finite_gradient_is_named_by_its_index_in_the_file() -> None:
    """Q is (B, L, d_model) under --heads: the first bad value in the file's order."""
    rng = np.random.default_rng(3)
    q, k, v = rng.normal(size=(2, 5, 8)), rng.normal(size=(2, 6, 8)), rng.normal(size=(2, 6, 8))
    k[1, 2, 5] = np.nan  # K/V heads of 4: head 1, column 1, of batch 1
    spec = build_spec(q, k, v, options=Options(heads=2))
    grads, health = backward_health(spec, make_dout(spec, "ones", 0, "--dout"), Thresholds())
    bad = {f.stage: f for f in health.findings if f.kind == "gradient_nonfinite"}
    # the NaN key reaches every row of query head 1 in batch 1 through the softmax's
    # sum: in the file, columns 4 to 7 of batch 1
    assert bad["dq"].index == (1, 0, 4)
    assert bad["dq"].count == 5 * 4
    for name in SLICED:
        loaded = grads.loaded(name)
        assert loaded is not None
        assert bad[name].index == tuple(np.argwhere(~np.isfinite(loaded))[0])
        assert bad[name].count == np.count_nonzero(~np.isfinite(loaded))


def test_gradients_are_reported_in_their_order_whatever_the_pass_finishes_first() -> None:
    """Q broadcast over the batch: dK and dV of batch 0 are finished before dQ, which
    every batch item reads; the ranges and findings still list dQ, dK, dV."""
    rng = np.random.default_rng(2)
    q = rng.normal(size=(1, 2, 5, 4))
    k, v = rng.normal(size=(2, 2, 6, 4)), rng.normal(size=(2, 2, 6, 4))
    k[:, :, 0] = np.nan  # every gradient non-finite: one finding each
    spec = build_spec(q, k, v)
    order: list[str] = []
    backward(spec, make_dout(spec, "ones", 0, "--dout"), on_slice=lambda n, i, x: order.append(n))
    assert order.index("dk") < order.index("dq")
    _, health = backward_health(spec, make_dout(spec, "ones", 0, "--dout"), Thresholds())
    assert [r.name for r in health.ranges][::2] == ["dq", "dk", "dv"]
    bad = [f.stage for f in health.findings if f.kind == "gradient_nonfinite"]
    assert bad == ["dq", "dk", "dv"]
