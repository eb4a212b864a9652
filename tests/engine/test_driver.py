"""The one block driver: every block once, in order, whatever the threads; the key
ranges it hands out; one slice when asked; progress."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from sdpa_cli.engine import driver
from sdpa_cli.engine.block import attend_block
from sdpa_cli.engine.driver import InOrder, Place, iter_blocks, sweep
from sdpa_cli.engine.options import parse_options
from sdpa_cli.engine.spec import AttentionSpec, build_spec

RNG = np.random.default_rng(7)


def spec_of(L: int = 13, S: int = 13, **options: object) -> AttentionSpec:
    q, k, v = (RNG.standard_normal((2, 3, n, 4)) for n in (L, S, S))
    return build_spec(q, k, v, options=parse_options(dict(options)))


def places(
    spec: AttentionSpec, **kwargs: object
) -> list[tuple[tuple[int, ...], int, int, int, int]]:
    def visit(p: Place) -> tuple[tuple[int, ...], int, int, int, int]:
        return p.lead, p.rows.start, p.rows.stop, p.keys.start, p.keys.stop

    return list(sweep(spec, visit, **kwargs))  # type: ignore[arg-type]


def test_every_row_of_every_slice_is_visited_once_in_c_order() -> None:
    spec = spec_of()
    seen = places(spec, rows=4)
    assert [s[0] for s in seen[::4]] == [(b, h) for b in range(2) for h in range(3)]
    for lead in {s[0] for s in seen}:
        rows = [(s[1], s[2]) for s in seen if s[0] == lead]
        assert rows == [(0, 4), (4, 8), (8, 12), (12, 13)]


@pytest.mark.parametrize("jobs", [2, 3])
def test_threads_yield_the_same_results_in_the_same_order(jobs: int) -> None:
    spec = spec_of(causal=True)

    def visit(p: Place) -> tuple[tuple[int, ...], int, float]:
        return p.lead, p.rows.start, float(p.attend(spec).output.sum())

    serial = list(sweep(spec, visit, rows=3))
    threaded = list(sweep(spec, visit, rows=3, jobs=jobs))
    assert threaded == serial


@pytest.mark.parametrize(("jobs", "ahead", "most"), [(2, None, 4), (2, 3, 3), (3, 1, 3)])
def test_at_most_ahead_blocks_are_in_flight(jobs: int, ahead: int | None, most: int) -> None:
    """A block is in flight from its visit's start until the caller has its result
    (default two per thread; never fewer than the threads)."""
    spec = build_spec(*(np.zeros((2, 3, 13, 4)) for _ in range(3)))
    lock, started, peak = threading.Lock(), [0], [0]
    taken = 0

    def visit(p: Place) -> int:
        with lock:
            started[0] += 1
            peak[0] = max(peak[0], started[0] - taken)
        time.sleep(0.002)
        return int(p.rows.start)

    for _ in sweep(spec, visit, rows=2, jobs=jobs, ahead=ahead):
        time.sleep(0.004)  # a slow caller: the threads run as far ahead as they may
        with lock:
            taken += 1
    assert peak[0] == most


@pytest.mark.parametrize(
    ("L", "rows", "jobs", "ahead"), [(40, 4, 2, None), (40, 4, 2, 3), (2, 1, 3, None)]
)
def test_each_slice_is_converted_once_and_few_stay_converted(
    monkeypatch: pytest.MonkeyPatch, L: int, rows: int, jobs: int, ahead: int | None
) -> None:
    """K and V are converted once per slice, however many blocks read them, and no
    more slices stay converted than the blocks in flight can span (two for a slice of
    many blocks: the memory of long sequences)."""
    spec = build_spec(*(np.zeros((2, 3, L, 4), np.float16) for _ in range(3)))
    converted: list[tuple[int, ...]] = []
    alive: set[tuple[int, ...]] = set()
    most = [0]
    lock = threading.Lock()
    real = driver.operands  # type: ignore[attr-defined]

    def counting(spec: AttentionSpec, lead: tuple[int, ...], emulate: bool = True) -> object:
        with lock:
            converted.append(lead)
        return real(spec, lead, emulate)

    monkeypatch.setattr(driver, "operands", counting)

    def visit(p: Place) -> None:
        p.inputs.get(spec, p.lead)
        cached = p.inputs._cache  # the slices converted and kept
        with lock:
            alive.update(cached)
            most[0] = max(most[0], len(cached))

    list(sweep(spec, visit, rows=rows, jobs=jobs, ahead=ahead))
    assert sorted(converted) == sorted(set(converted)) == sorted(alive)
    assert len(converted) == 6
    assert most[0] == (2 if L // rows > jobs else jobs + 1)


def test_visible_keys_skip_what_a_causal_mask_hides_from_the_whole_block() -> None:
    spec = spec_of(L=8, S=8, causal=True)
    for _, _, i1, k0, k1 in places(spec, rows=2):
        assert (k0, k1) == (0, i1)  # row i sees keys 0..i: the block's last row sees most
    assert all((k0, k1) == (0, 8) for *_, k0, k1 in places(spec, rows=2, keys="all"))


def test_a_finite_mask_value_computes_every_key() -> None:
    """Hidden keys still take weight in a fully masked row under a finite mask value."""
    spec = spec_of(L=8, S=8, causal=True, mask_value=-1e9)
    assert all((k0, k1) == (0, 8) for *_, k0, k1 in places(spec, rows=2))


def test_nonfinite_v_makes_the_backward_keys_dense() -> None:
    q, k, v = (RNG.standard_normal((1, 1, 6, 4)) for _ in range(3))
    v[0, 0, 5, 1] = np.nan
    spec = build_spec(q, k, v, options=parse_options({"causal": True}))
    dense = places(spec, rows=2, keys="all-if-v-nonfinite")
    assert all((k0, k1) == (0, 6) for *_, k0, k1 in dense)
    assert places(spec, rows=2)[0][3:] == (0, 2)


def test_leads_walk_only_the_slices_asked_for() -> None:
    spec = spec_of()
    seen = places(spec, rows=5, leads=[(1, 2)])
    assert {s[0] for s in seen} == {(1, 2)}
    assert [(s[1], s[2]) for s in seen] == [(0, 5), (5, 10), (10, 13)]


def test_progress_counts_every_score_once() -> None:
    spec = spec_of(L=11, S=7)
    told: list[int] = []
    list(sweep(spec, lambda p: None, rows=4, progress=told.append))
    assert sum(told) == 2 * 3 * 11 * 7


def test_place_attend_is_attend_block_over_its_keys() -> None:
    spec = spec_of(L=9, S=9, causal=True)
    for block in sweep(spec, lambda p: p.attend(spec), rows=4):
        whole = attend_block(spec, block.lead_index, block.rows)
        np.testing.assert_allclose(block.output, whole.output, rtol=1e-12, atol=1e-15)
        # the row sums run over fewer keys: equal to rounding, not bit for bit
        np.testing.assert_allclose(block.weights, whole.weights[:, block.keys], rtol=1e-14)
        assert np.all(whole.weights[:, : block.keys.start] == 0)
        assert np.all(whole.weights[:, block.keys.stop :] == 0)


def test_the_twin_of_an_emulated_block_is_float64() -> None:
    spec = spec_of(dtype="float16")
    twins = list(sweep(spec, lambda p: p.twin(spec, p.attend(spec)), rows=13))
    exact = [attend_block(spec, t.lead_index, t.rows, emulate=False) for t in twins]
    for t, e in zip(twins, exact, strict=True):
        np.testing.assert_array_equal(t.output, e.output)
    plain = spec_of()
    block = next(sweep(plain, lambda p: p.twin(plain, p.attend(plain))))
    assert block.output.dtype == np.float64


def test_iter_blocks_of_an_empty_query_axis_is_empty() -> None:
    spec = spec_of(L=0)
    assert list(iter_blocks(spec)) == []


def test_each_slice_is_converted_once_per_spec_however_many_blocks_read_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A check reads each slice as the reference, the emulated run and its float64 twin:
    each conversion is made once per slice, not once per block."""
    from sdpa_cli.engine import block

    calls: list[tuple[tuple[int, ...], bool]] = []
    real = block.operands

    def counted(spec: AttentionSpec, lead: tuple[int, ...], emulate: bool = True) -> object:
        calls.append((lead, emulate))
        return real(spec, lead, emulate)

    monkeypatch.setattr("sdpa_cli.engine.driver.operands", counted)
    spec = spec_of(L=12, S=12, dtype="float16")
    reference = spec_of(L=12, S=12)

    def visit(p: Place) -> None:
        p.twin(spec, p.attend(spec))
        p.attend(reference)

    list(sweep(spec, visit, rows=3))
    assert len(calls) == 3 * 2 * 3  # three conversions of each of the six slices
    assert len(set(calls)) == 2 * 6  # (slice, emulated or not); the two specs differ


def test_slice_blocks_are_every_row_of_one_slice_with_every_key() -> None:
    from sdpa_cli.engine.driver import slice_blocks

    spec = spec_of(L=9, S=9, causal=True)
    blocks = list(slice_blocks(spec, (1, 2)))
    assert {b.lead_index for b in blocks} == {(1, 2)}
    assert sum(b.rows.stop - b.rows.start for b in blocks) == 9
    assert all((b.keys.start, b.keys.stop) == (0, 9) for b in blocks)


def test_in_order_merges_blocks_in_the_sweeps_order_whatever_finishes_first() -> None:
    spec = build_spec(*(np.zeros((2, 3, 13, 4)) for _ in range(3)))
    order, merged = InOrder(), []

    def visit(p: Place) -> None:
        time.sleep(0.001 * (p.number * 7 % 5))  # later blocks often finish first
        with order.turn(p.number):
            merged.append((p.lead, p.rows.start))

    list(sweep(spec, visit, rows=3, jobs=3))
    assert merged == [(lead, r.start) for lead, r in iter_blocks(spec, 3)]


def test_a_failed_block_releases_the_blocks_waiting_for_their_turn() -> None:
    spec = build_spec(*(np.zeros((1, 2, 12, 4)) for _ in range(3)))
    order = InOrder()

    def visit(p: Place) -> None:
        try:
            if p.number == 2:
                time.sleep(0.01)  # the later blocks are waiting by now
                raise ValueError("block 2")
        except BaseException:
            order.failed()
            raise
        with order.turn(p.number):
            pass

    with pytest.raises(ValueError, match="block 2"):
        list(sweep(spec, visit, rows=2, jobs=3))
