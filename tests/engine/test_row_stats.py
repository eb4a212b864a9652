"""Every row statistic's two producers agree, read from its entry (``sdpa_cli.engine.row_stats``).

For each entry of :data:`~sdpa_cli.engine.row_stats.ROW_STATISTICS` and each of a set
of problems the lean pass computes, the lean pass
(:func:`~sdpa_cli.engine.online.attend_online` in key blocks of 7 keys, so the running
max rises and partial results are rescaled and combined) and the per-stage path
(:meth:`~sdpa_cli.engine.stats.Stats.measure` of :func:`~sdpa_cli.engine.block.attend_block`
over every key, one chunk) give every column of the statistic within the entry's own
tolerance (exact for counts and keys). A new entry is tested here with no new code.

The problems: no mask, causal, a window, key padding with a row block that sees no key,
a boolean mask, finite mask values (−1e9 and ``--as jax``'s) with rows that see no key
(uniform over every key), logits near flushing in float16 (float64 and float32 runs),
logits rising along the keys (every key block raises the running max) and falling
(none does), and a float32 run.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from attention_cases import make_spec
from numpy.typing import NDArray
from reference import attention

from sdpa_cli.engine import online, row_stats
from sdpa_cli.engine.block import attend_block, key_range, operands
from sdpa_cli.engine.conventions import JAX_MASK_VALUE
from sdpa_cli.engine.online import applies, attend_online
from sdpa_cli.engine.options import Options
from sdpa_cli.engine.records import Records
from sdpa_cli.engine.row_stats import ROW_STATISTICS, RowStatistic
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.engine.stats import Stats
from sdpa_cli.engine.trace import trace

KEY_BLOCK = 7
"""Keys per block of the lean pass here: several blocks a row, boundaries inside masks."""

ROW_BLOCK = 4
"""Query rows per block: does not divide L."""


def logits_spec(logits: NDArray[np.float64], **options: Any) -> AttentionSpec:
    """A spec whose logits are ``logits`` (L, S) exactly: Q = the logits, K = I, no scale."""
    S = logits.shape[1]
    v = np.random.default_rng(0).normal(size=(S, 3))
    return build_spec(logits, np.eye(S), v, options=Options(scale="none", **options))


def rising() -> AttentionSpec:
    """Logits rising along the keys, at every row's own pace: each key block raises the
    running max (a row's last key is its top)."""
    steps = np.linspace(0.05, 3.0, 9)[:, None]
    return logits_spec(steps * np.arange(40.0)[None, :])


def falling() -> AttentionSpec:
    """Logits falling along the keys: the first key block holds the max; later key
    blocks are rescaled into its frame, and the flushed weights sit in the last ones."""
    steps = np.linspace(0.05, 3.0, 9)[:, None]
    return logits_spec(-steps * np.arange(40.0)[None, :], causal=True)


PROBLEMS: dict[str, Callable[[], AttentionSpec]] = {
    "no-mask": lambda: make_spec(11),
    "causal": lambda: make_spec(12, L=17, S=30, causal=True),
    "window": lambda: make_spec(13, L=20, S=30, window=(9, 3)),
    "key-padding-with-0": lambda: make_spec(14, key_lengths=(0, 19)),
    "bool-mask": lambda: make_spec(15, mask="bool"),
    "mask-value-1e9-rows-see-none": lambda: make_spec(
        16,
        L=13,
        S=30,
        causal=True,
        causal_align="lower-right",
        key_lengths=(0, 23),
        mask_value=-1e9,
    ),
    "as-jax-rows-see-none": lambda: make_spec(
        17,
        L=30,
        S=13,
        causal=True,
        causal_align="lower-right",
        framework="jax",
        mask_value=JAX_MASK_VALUE,
    ),
    "float16-flushes": lambda: make_spec(18, spread=12.0, causal=True, window=(20, 0)),
    "float32-float16-flushes": lambda: make_spec(
        19, spread=12.0, float32=True, key_lengths=(30, 17)
    ),
    "float32": lambda: make_spec(20, float32=True, mask="keys"),
    "rising": rising,
    "falling": falling,
}


Columns = dict[str, NDArray[Any]]


@functools.cache
def producers(problem: str) -> tuple[Columns, Columns, float]:
    """Every column over ``(*lead, L)`` from the lean pass and from the per-stage path,
    and the machine epsilon of the computation."""
    spec = PROBLEMS[problem]()
    assert applies(spec)
    lean, staged = Stats.empty(spec), Stats.empty(spec)
    for index in np.ndindex(*spec.lead):
        lead = tuple(int(i) for i in index)
        inputs = operands(spec, lead)
        for i0 in range(0, spec.L, ROW_BLOCK):
            rows = slice(i0, min(i0 + ROW_BLOCK, spec.L))
            records = Records.empty(spec, lean.checked, lean.narrow)
            keys = key_range(spec, lead, rows)
            found = attend_online(spec, lead, rows, keys, inputs, records, key_block=KEY_BLOCK)
            assert found is not None, f"the lean pass computes {problem} at {lead}, {rows}"
            lean.write_rows((*lead, rows), found.rows)
            block = attend_block(spec, lead, rows)  # every key, every stage
            staged.measure(block, block)
    eps = float(np.finfo(inputs.k.dtype).eps)
    return dict(lean.rows), dict(staged.rows), eps


def assert_agree(
    got: NDArray[Any], want: NDArray[Any], tolerance: row_stats.Tolerance, eps: float, label: str
) -> None:
    if tolerance.exact:
        np.testing.assert_array_equal(got, want, err_msg=label)
    else:
        np.testing.assert_allclose(
            got, want, rtol=tolerance.rel * eps, atol=tolerance.abs * eps, err_msg=label
        )


@pytest.mark.parametrize("problem", PROBLEMS)
@pytest.mark.parametrize("statistic", ROW_STATISTICS, ids=[s.name for s in ROW_STATISTICS])
def test_the_lean_pass_and_the_per_stage_path_agree_on_every_statistic(
    statistic: RowStatistic, problem: str
) -> None:
    lean, staged, eps = producers(problem)
    formats = Stats.empty(PROBLEMS[problem]()).narrow
    for name, _ in statistic.columns(formats):
        assert_agree(lean[name], staged[name], statistic.tolerance, eps, f"{problem}: {name}")


def test_the_problems_exercise_what_the_statistics_read() -> None:
    """Rows that see no key, uniform rows, flushed weights, and a running max that rises."""
    lean = {name: producers(name)[0] for name in PROBLEMS}
    assert (lean["key-padding-with-0"]["n_visible"] == 0).any()
    for name in ("mask-value-1e9-rows-see-none", "as-jax-rows-see-none"):
        assert (lean[name]["hidden_weight"] == 1.0).any(), name
        assert (lean[name]["n_visible"] > 0).any(), name
    for name in ("float16-flushes", "float32-float16-flushes", "falling"):
        assert lean[name]["underflow[float16]"].sum() > 0, name
        assert lean[name]["lost[float16]"].max() > 0, name
    # the top key in the last key block: every block raised the max
    assert (lean["rising"]["argmax"] == 39).all()
    assert (lean["falling"]["argmax"] == 0).all()


def test_every_producer_gives_every_column_of_the_registry_in_its_order() -> None:
    spec = make_spec(21, causal=True)
    stats = Stats.empty(spec)
    columns = [name for s in ROW_STATISTICS for name, _ in s.columns(stats.narrow)]
    assert list(stats.rows) == columns
    records = Records.empty(spec, stats.checked, stats.narrow)
    lead, rows = (0, 0), slice(0, 5)
    found = attend_online(
        spec, lead, rows, key_range(spec, lead, rows), operands(spec, lead), records
    )
    assert found is not None
    assert list(found.rows) == columns
    block = attend_block(spec, lead, rows)
    staged = row_stats.per_stage(spec, block, block, stats.narrow, lambda: True)
    assert list(staged) == columns
    for s in ROW_STATISTICS:
        for name, _ in s.columns(stats.narrow):
            assert stats.rows[name].dtype == np.dtype(s.dtype), name
            assert found.rows[name].shape == staged[name].shape == (5,), name


def test_a_row_statistic_is_online_or_settled_and_says_how_close_its_producers_agree() -> None:
    for s in ROW_STATISTICS:
        online, settled = s.chunk is not None, s.settle is not None
        assert online != settled, s.name
        assert settled == (s.reads is not None), s.name
        assert s.description, s.name
        assert s.tolerance.rel < 1e3, s.name  # a few hundred ulps at most
        assert s.tolerance.abs < 1e3, s.name
        if np.issubdtype(s.dtype, np.integer):
            assert s.tolerance.exact, s.name


def test_the_memory_estimate_counts_every_column() -> None:
    assert row_stats.bytes_per_row(2) == sum(
        np.dtype(s.dtype).itemsize * (2 if s.per_format else 1) for s in ROW_STATISTICS
    )
    assert math.prod(Stats.empty(make_spec(22)).rows["n_visible"].shape) == 2 * 2 * 13


# --- the runner-up weight against the float64 loop reference -----------------------------


def reference_runner_up(spec: AttentionSpec) -> NDArray[np.float64]:
    """Each row's second-largest weight over its visible keys (0 below two), from
    :func:`reference.attention`'s weights, by sorting each row in Python."""
    o = spec.options
    want = attention(
        np.asarray(spec.q),
        np.asarray(spec.k),
        np.asarray(spec.v),
        causal=o.causal,
        causal_align=o.causal_align,
        key_lengths=o.key_lengths,
        mask_value=o.mask_value,
        scale=o.scale,
    )
    second = np.zeros(want.weights.shape[:-1])
    for at in np.ndindex(*second.shape):
        seen = sorted((w for w, v in zip(want.weights[at], want.visible[at], strict=True) if v))
        second[at] = seen[-2] if len(seen) >= 2 else 0.0
    return second


def saturated_and_tied() -> AttentionSpec:
    """Row 0 one-hot but for e^−40, row 1 two keys tied at the top, row 2 uniform, row 3
    the runner-up in an earlier key block than the top, row 4 the other way round."""
    logits = np.zeros((5, 20))
    logits[0, 3] = 40.0
    logits[1, [2, 17]] = 5.0
    logits[3, [1, 15]] = 6.0, 9.0
    logits[4, [1, 15]] = 9.0, 6.0
    return logits_spec(logits)


RUNNER_UP_CASES: dict[str, Callable[[], AttentionSpec]] = {
    "no-mask": lambda: make_spec(31, B=1, L=6, S=25),
    "causal": lambda: make_spec(32, B=1, L=9, S=25, causal=True),  # row 0: one key
    "key-padding-with-0": lambda: make_spec(33, L=5, S=25, key_lengths=(0, 1)),
    "mask-value-1e9-rows-see-none": lambda: make_spec(
        34, L=7, S=12, causal=True, causal_align="lower-right", key_lengths=(0, 9), mask_value=-1e9
    ),
    "saturated-and-tied": saturated_and_tied,
}


@pytest.mark.parametrize("case", RUNNER_UP_CASES)
def test_the_runner_up_weight_is_the_second_largest_visible_weight(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lean (key blocks of 7: the top two meet across blocks) and per stage, against
    the float64 loop reference."""
    spec = RUNNER_UP_CASES[case]()
    want = reference_runner_up(spec)
    computed = []

    def in_key_blocks(*args: Any, **kwargs: Any) -> online.Online | None:
        found = attend_online(*args, **{**kwargs, "key_block": KEY_BLOCK})
        computed.append(found is not None)
        return found

    monkeypatch.setattr(online, "attend_online", in_key_blocks)
    lean = trace(spec, stages=(), rows=3).stats.rows["runner_up"]
    assert computed, "the trace runs the lean pass"
    assert all(computed)
    staged = trace(spec, rows=3).stats.rows["runner_up"]
    np.testing.assert_allclose(lean, want, rtol=1e-12, atol=0, err_msg="lean")
    np.testing.assert_allclose(staged, want, rtol=1e-12, atol=0, err_msg="per stage")
    if case == "saturated-and-tied":
        assert want[0] == pytest.approx(math.exp(-40.0), rel=1e-6)
        tied = trace(spec).stats.max_weight[1]  # the top weight, twice
        assert lean[1] == pytest.approx(tied, rel=1e-15)
        assert staged[1] == tied
