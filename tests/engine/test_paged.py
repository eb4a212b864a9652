"""Paged KV caches (``--block-table``), as vLLM and FlashAttention's
``flash_attn_with_kvcache`` keep them: the pages gathered exactly, the block table
checked at the entry, findings named by page.

The reference gathers the cache by plain loops (key j of item b is
``pages[table[b, j // page_size], j % page_size]``) and runs the float64 loop of
``tests/reference.py`` on the contiguous K and V with the lengths as key lengths. At
1e-9 in float64.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray
from reference import attention

from sdpa_cli.diagnosis.rules import diagnose
from sdpa_cli.engine.inputs import load_spec
from sdpa_cli.engine.options import Options
from sdpa_cli.engine.paged import gather_pages
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.trace import trace
from sdpa_cli.errors import InputError, SpecError
from sdpa_cli.files import limits

TOL = 1e-9
B, L, H, G, E, EV = 3, 4, 4, 2, 8, 6
P, PAGE, MAX_PAGES = 13, 4, 4
LENGTHS = (7, 16, 1)


def paged_cache(
    rng: np.random.Generator, lengths: tuple[int, ...] = LENGTHS
) -> dict[str, NDArray[Any]]:
    """Q (B, L, H, E) and a paged cache: shuffled physical pages, each item its own,
    the entries past an item's used pages padding (-1)."""
    pages = rng.permutation(P)
    table = np.full((len(lengths), MAX_PAGES), -1, dtype=np.int32)
    n = 0
    for b, length in enumerate(lengths):
        used = -(-length // PAGE)
        table[b, :used] = pages[n : n + used]
        n += used
    return {
        "q": rng.standard_normal((len(lengths), L, H, E)),
        "k": rng.standard_normal((P, PAGE, G, E)),
        "v": rng.standard_normal((P, PAGE, G, EV)),
        "block_table": table,
    }


def contiguous(cache: dict[str, NDArray[Any]], lengths: tuple[int, ...]) -> tuple[Any, Any]:
    """K and V gathered by loops, (B, G, S, ·) with S the longest length; zeros past an
    item's length."""
    S = max(lengths)
    table, kp, vp = cache["block_table"], cache["k"], cache["v"]
    k = np.zeros((len(lengths), G, S, E))
    v = np.zeros((len(lengths), G, S, EV))
    for b, length in enumerate(lengths):
        for j in range(length):
            for g in range(G):
                k[b, g, j] = kp[table[b, j // PAGE], j % PAGE, g]
                v[b, g, j] = vp[table[b, j // PAGE], j % PAGE, g]
    return k, v


def saved(tmp_path: Path, cache: dict[str, NDArray[Any]]) -> dict[str, str]:
    paths = {}
    for name, a in cache.items():
        np.save(tmp_path / f"{name}.npy", a)
        paths[name] = str(tmp_path / f"{name}.npy")
    return paths


def paged_spec(
    paths: dict[str, str], lengths: tuple[int, ...] | None = LENGTHS, **flags: Any
) -> AttentionSpec:
    keys = None if lengths is None else ",".join(str(n) for n in lengths)
    flags = {"layout": "bshd", "key_lengths": keys, **flags}
    tensors = {"block_table": paths["block_table"]}
    spec, _ = load_spec((paths["q"], paths["k"], paths["v"]), tensors, flags)
    return spec


def output(spec: AttentionSpec) -> NDArray[np.float64]:
    """The output, (B, H, L, Ev)."""
    out = trace(spec, stages=("output",)).output
    assert out is not None
    return out


@pytest.mark.parametrize(
    "flags",
    [{}, {"causal": True, "query_offset": "3,12,0"}, {"window": "2,0", "query_offset": "3,12,0"}],
    ids=["plain", "causal", "window"],
)
def test_the_gathered_cache_computes_as_the_contiguous_one(
    tmp_path: Path, flags: dict[str, Any]
) -> None:
    cache = paged_cache(np.random.default_rng(1))
    spec = paged_spec(saved(tmp_path, cache), **flags)
    k, v = contiguous(cache, LENGTHS)
    q = np.swapaxes(cache["q"], 1, 2)  # (B, H, L, E)
    window = (2, 0) if "window" in flags else None
    offset = (3, 12, 0) if "query_offset" in flags else None
    ref = attention(
        q, k, v, key_lengths=LENGTHS, causal="causal" in flags, window=window, query_offset=offset
    )
    assert max(LENGTHS) == spec.S
    assert spec.group == H // G
    np.testing.assert_allclose(output(spec), ref.output, rtol=0, atol=TOL)


def test_the_gathered_keys_are_the_pages_slot_by_slot() -> None:
    cache = paged_cache(np.random.default_rng(2))
    k, v, paging = gather_pages(
        cache["k"],
        cache["v"],
        cache["block_table"],
        Options(layout="bshd", key_lengths=LENGTHS),
        {},
        cache["q"].shape,
    )
    ref_k, ref_v = contiguous(cache, LENGTHS)
    for b, length in enumerate(LENGTHS):
        np.testing.assert_array_equal(k[b, :length], np.swapaxes(ref_k[b, :, :length], 0, 1))
        np.testing.assert_array_equal(v[b, :length], np.swapaxes(ref_v[b, :, :length], 0, 1))
    # item 0's last page is read whole (slot 3 past its 7 keys), as a kernel reads it
    last = cache["block_table"][0, 1]
    np.testing.assert_array_equal(k[0, 7], cache["k"][last, 3])
    assert paging.locate(0, 5) == (1, int(last), 1)
    assert paging.where(1, 9) == (
        f"item 1 key 9: page 2 of its table (physical page {cache['block_table'][1, 2]}, slot 1)"
    )


def test_bhsd_queries_read_the_cache_in_their_layout(tmp_path: Path) -> None:
    cache = paged_cache(np.random.default_rng(3))
    bshd = output(paged_spec(saved(tmp_path, cache)))
    cache["q"] = np.swapaxes(cache["q"], 1, 2).copy()  # (B, H, L, E)
    spec = paged_spec(saved(tmp_path, cache), layout="bhsd")
    assert spec.shapes["k"] == (B, G, max(LENGTHS), E)
    np.testing.assert_allclose(output(spec), bshd, rtol=0, atol=TOL)


def test_without_key_lengths_every_item_reads_its_whole_table(tmp_path: Path) -> None:
    full = (MAX_PAGES * PAGE,) * 2
    cache = paged_cache(np.random.default_rng(4), lengths=(5, 5))
    cache["block_table"] = np.array([[3, 0, 8, 1], [2, 9, 4, 7]])
    cache["q"] = cache["q"][:2]
    spec = paged_spec(saved(tmp_path, cache), lengths=None)
    k, v = contiguous(cache, full)
    ref = attention(np.swapaxes(cache["q"], 1, 2), k, v)
    assert spec.S == MAX_PAGES * PAGE
    np.testing.assert_allclose(output(spec), ref.output, rtol=0, atol=TOL)


def test_a_shared_prefix_is_no_finding(tmp_path: Path) -> None:
    cache = paged_cache(np.random.default_rng(5))
    cache["block_table"][1, 0] = cache["block_table"][0, 0]  # both read all 4 slots of page 0
    spec = paged_spec(saved(tmp_path, cache))
    assert spec.paging is not None
    assert spec.paging.prefix_pages == 1
    assert "page_shared" not in diagnose(trace(spec)).counts


@pytest.mark.parametrize(
    ("entry", "problem"),
    [((1, 2), "positions"), ((1, 1), "partial")],
    ids=["other-position", "partial"],
)
def test_a_page_shared_amiss_is_a_warning(
    tmp_path: Path, entry: tuple[int, int], problem: str
) -> None:
    cache = paged_cache(np.random.default_rng(6))
    page = int(cache["block_table"][0, 1])  # item 0's last page: 3 of its 4 slots
    cache["block_table"][entry] = page
    spec = paged_spec(saved(tmp_path, cache))
    (found,) = [f for f in diagnose(trace(spec)).findings if f.kind == "page_shared"]
    assert found.severity == "warning"
    assert f"physical page {page} is page 1 of item 0's table (3 slots)" in found.message
    assert found.details["pages"][0]["problem"] == problem


def test_a_non_finite_key_is_named_by_its_page(tmp_path: Path) -> None:
    cache = paged_cache(np.random.default_rng(7))
    physical = int(cache["block_table"][1, 2])
    cache["k"][physical, 1, 0, 3] = np.nan  # item 1's key 9
    spec = paged_spec(saved(tmp_path, cache))
    found = [f for f in diagnose(trace(spec)).findings if f.kind == "nonfinite"]
    page = f"item 1 key 9: page 2 of its table (physical page {physical}, slot 1)"
    assert page in found[0].message
    assert found[0].details["physical_page"] == physical
    assert "gathered through the block table" in found[0].message  # its count and index
    assert page in found[1].message  # the raw scores' first: the same key


def test_nan_past_an_items_length_is_named_by_its_page(tmp_path: Path) -> None:
    cache = paged_cache(np.random.default_rng(8))
    physical = int(cache["block_table"][0, 1])
    cache["v"][physical, 3] = np.nan  # item 0's slot past its 7 keys
    spec = paged_spec(saved(tmp_path, cache))
    (found,) = [f for f in diagnose(trace(spec)).findings if f.kind == "mask_suspect"]
    assert f"item 0 key 7: page 1 of its table (physical page {physical}, slot 3)" in found.message


def bad_tables() -> list[tuple[str, Any, tuple[int, ...], str]]:
    """(id, table or a change of it, key lengths, the message's tail)."""
    return [
        ("out-of-range", (1, 3, 13), LENGTHS, "item 1's page 3 (entry [1, 3]) is 13, not a page"),
        ("negative", (2, 0, -1), LENGTHS, "item 2's page 0 (entry [2, 0]) is -1, not a page"),
        ("twice", (1, 2, "1,0"), LENGTHS, "reads physical page"),
        ("past-the-table", None, (7, 17, 1), "item 1 reads 17 keys (--key-lengths) but its table"),
        ("rank", np.zeros(4, dtype=np.int64), LENGTHS, "should be (B, max_pages), 2-D"),
        ("float", np.zeros((3, 4)), LENGTHS, "holds float64; expected integer page indices"),
    ]


@pytest.mark.parametrize(
    ("change", "lengths", "message"),
    [case[1:] for case in bad_tables()],
    ids=[case[0] for case in bad_tables()],
)
def test_an_inconsistent_table_is_refused_naming_it(
    tmp_path: Path, change: Any, lengths: tuple[int, ...], message: str
) -> None:
    cache = paged_cache(np.random.default_rng(9))
    table = cache["block_table"]
    if isinstance(change, np.ndarray):
        cache["block_table"] = change
    elif isinstance(change, tuple) and isinstance(change[2], str):  # a page read twice
        b, p, _ = change
        table[b, p] = table[b, 0]
    elif change is not None:
        b, p, value = change
        table[b, p] = value
    paths = saved(tmp_path, cache)
    with pytest.raises(SpecError) as raised:
        paged_spec(paths, lengths=lengths)
    assert raised.value.where == paths["block_table"]
    assert message in str(raised.value)


def test_padding_past_an_items_pages_is_never_read(tmp_path: Path) -> None:
    cache = paged_cache(np.random.default_rng(10))
    cache["block_table"][2, 1:] = [99, -7, 10**6]  # item 2 reads 1 key: page 0 only
    assert paged_spec(saved(tmp_path, cache)).paging is not None


def test_padding_read_for_want_of_key_lengths_says_to_give_them(tmp_path: Path) -> None:
    """vLLM pads a table with -1: without --key-lengths every entry is read, and the
    message says what would make those entries padding."""
    cache = paged_cache(np.random.default_rng(12))
    cache["block_table"][2, 1:] = -1
    with pytest.raises(SpecError, match=r"is -1, not a page of K .*give --key-lengths"):
        paged_spec(saved(tmp_path, cache), lengths=None)


def test_pages_of_another_shape_than_k_are_refused(tmp_path: Path) -> None:
    cache = paged_cache(np.random.default_rng(11))
    cache["v"] = cache["v"][:, :2]  # a page size of 2
    paths = saved(tmp_path, cache)
    with pytest.raises(SpecError, match=r"with K's \(num_pages, page_size, G\) = \(13, 4, 2\)"):
        paged_spec(paths)


def test_what_the_table_declares_is_never_allocated(tmp_path: Path) -> None:
    cache = paged_cache(np.random.default_rng(12))
    wide = np.full((B, 10**6), -1, dtype=np.int32)  # 4·10⁶ keys declared per item
    wide[:, :MAX_PAGES] = cache["block_table"]
    cache["block_table"] = wide
    spec = paged_spec(saved(tmp_path, cache))
    assert max(LENGTHS) == spec.S


def test_the_gathered_cache_must_fit_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = saved(tmp_path, paged_cache(np.random.default_rng(13)))
    monkeypatch.setattr(limits, "available_memory", lambda: 2**13)
    with pytest.raises(InputError, match=r"needs 0\.0 GiB of memory for K and V gathered"):
        paged_spec(paths)
