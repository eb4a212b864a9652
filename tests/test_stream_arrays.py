"""Documents with arrays formatted a piece at a time (:func:`sdpa_cli.stream.
write_with_arrays`, ``sdpa grad --format json|yaml``): byte for byte what ``to_json``
and ``to_yaml`` write for the same data with the arrays as nested lists, in a few
MiB whatever the arrays' size."""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from sdpa_cli.diagnosis.findings import Thresholds
from sdpa_cli.diagnosis.grad import backward_health, combined
from sdpa_cli.diagnosis.rules import diagnose
from sdpa_cli.engine.grad import make_dout
from sdpa_cli.engine.options import Options
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.engine.stats import Stats
from sdpa_cli.report import grad_arrays, grad_payload, to_json, to_yaml
from sdpa_cli.stream import write_with_arrays
from sdpa_cli.text import json_number


def _lists(a: NDArray[Any], for_json: bool) -> Any:
    """The array as the in-memory report nests it."""
    if a.ndim == 0:
        return json_number(float(a)) if for_json else float(a)
    return (
        [_lists(x, for_json) for x in a]
        if a.ndim > 1
        else [json_number(float(x)) if for_json else float(x) for x in a]
    )


def _streamed(data: dict[str, Any], key: str, arrays: dict[str, Any], fmt: str) -> str:
    parts: list[str] = []
    write_with_arrays(data, key, arrays, parts.append, fmt=fmt)
    return "".join(parts)


def _arrays(rng: np.random.Generator) -> dict[str, NDArray[Any]]:
    wide = rng.standard_normal((2, 3, 2, 41)) * 10.0 ** rng.integers(-8, 8, (2, 3, 2, 41))
    wide[0, 1, 1, 5], wide[1, 2, 0, 0], wide[1, 0, 1, 40] = np.nan, np.inf, -np.inf
    return {
        "wide": wide,  # rows that wrap past the width, non-finite values, 4-D
        "plain": rng.standard_normal((3, 4)),
        "empty": np.zeros((2, 0, 3)),
        "one": np.array([1.5, np.nan, -2.0]),  # 1-D: d(sinks)
        "tall": rng.standard_normal((1, 5, 2)),
    }


@pytest.mark.parametrize("fmt", ["json", "yaml"])
@pytest.mark.parametrize("where", [0, 1, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_write_with_arrays_is_to_json_and_to_yaml(fmt: str, where: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    others = [("a", 1), ("b", {"c": [1.0, None], "d": "x"}), ("e", [{"f": 2}])]
    data = dict([*others[:where], ("gradients", None), *others[where:]])
    arrays = _arrays(rng)
    for_json = fmt == "json"
    whole = {**data, "gradients": {n: _lists(a, for_json) for n, a in arrays.items()}}
    want = to_json(whole) + "\n" if for_json else to_yaml(whole)
    assert _streamed(data, "gradients", arrays, fmt) == want


def _grad_specs() -> dict[str, AttentionSpec]:
    rng = np.random.default_rng(7)

    def n(*shape: int) -> NDArray[np.float64]:
        return rng.standard_normal(shape)

    bshd = Options(layout="bshd", causal=True)
    return {
        "bias": build_spec(n(2, 2, 5, 4), n(2, 2, 6, 4), n(2, 2, 6, 3), bias=n(5, 6)),
        "bshd": build_spec(n(1, 5, 4, 8), n(1, 6, 2, 8), n(1, 6, 2, 3), options=bshd),
        "heads": build_spec(
            n(2, 5, 16), n(2, 6, 8), n(2, 6, 8), options=Options(heads=4, kv_heads=2)
        ),
        "sinks": build_spec(n(1, 2, 5, 4), n(1, 2, 6, 4), n(1, 2, 6, 4), sinks=n(2)),
    }


@pytest.mark.parametrize("fmt", ["json", "yaml"])
@pytest.mark.parametrize("case", sorted(_grad_specs()))
def test_the_grad_document_streamed_is_the_in_memory_one(fmt: str, case: str) -> None:
    spec = _grad_specs()[case]
    stats = Stats.empty(spec)
    grads, health = backward_health(
        spec, make_dout(spec, "random", 3, "--dout"), Thresholds(), stats=stats
    )
    grads.dq[(0,) * (grads.dq.ndim - 1)] = np.nan  # a non-finite value, written as JSON has it
    diagnosis = combined(diagnose(stats, Thresholds()), health)
    args: dict[str, Any] = {
        "dout": {"source": "random"},
        "numeric": None,
        "tolerance": 1e-6,
        "dtype": "float16",
        "for_json": fmt == "json",
    }
    data = grad_payload(grads, health, diagnosis, **args)
    arrays = grad_arrays(grads)
    extra = {"bias": ["dbias"], "sinks": ["dsinks"]}.get(case, [])
    assert list(arrays) == ["dq", "dk", "dv", *extra]
    whole = {**data, "gradients": {n: _lists(a, fmt == "json") for n, a in arrays.items()}}
    want = to_json(whole) + "\n" if fmt == "json" else to_yaml(whole)
    assert _streamed(data, "gradients", arrays, fmt) == want


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_memory_does_not_grow_with_the_arrays(fmt: str) -> None:
    """1.5 million float64 values: as nested lists they would take about 120 MiB
    (JSON) and 600 MiB (PyYAML); streamed, a few MiB beside the arrays."""
    rng = np.random.default_rng(0)
    arrays = {n: rng.standard_normal((2, 4096, 64)) for n in ("dq", "dk", "dv")}
    size = [0]

    def count(text: str) -> None:
        size[0] += len(text)

    tracemalloc.start()
    try:
        write_with_arrays({"a": 1, "gradients": None}, "gradients", arrays, count, fmt=fmt)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert size[0] > 3 * (1 << 19) * 15  # every number written, about 20 characters each
    assert peak < 16 << 20
