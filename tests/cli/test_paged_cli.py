"""``--block-table`` through the commands: a paged export judged, a page-indexing bug
caught, case files and manifests, and one error line (exit 2) for each inconsistency
of the table, naming its file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from clirunner import assert_one_error_line, invoke, strict_json
from numpy.typing import NDArray
from reference import attention

B, L, H, G, E, EV = 2, 3, 4, 2, 8, 8
P, PAGE = 9, 4
LENGTHS = (6, 11)
TABLE = np.array([[5, 2, -1], [7, 0, 3]], dtype=np.int64)  # item 0 reads 2 pages, item 1 all 3


def exported(q: Any, kp: Any, vp: Any, table: Any) -> NDArray[np.float64]:
    """What a kernel exports for this paged cache: gathered by loops, attention in
    float64, the output in the bshd layout (B, L, H, Ev)."""
    S = max(LENGTHS)
    k, v = np.zeros((B, G, S, E)), np.zeros((B, G, S, EV))
    for b, length in enumerate(LENGTHS):
        for j in range(length):
            k[b, :, j] = kp[table[b, j // PAGE], j % PAGE]
            v[b, :, j] = vp[table[b, j // PAGE], j % PAGE]
    out = attention(np.swapaxes(q, 1, 2), k, v, key_lengths=LENGTHS).output
    return np.swapaxes(out, 1, 2)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    rng = np.random.default_rng(36)
    arrays = {
        "q": rng.standard_normal((B, L, H, E)),
        "k": rng.standard_normal((P, PAGE, G, E)),
        "v": rng.standard_normal((P, PAGE, G, EV)),
        "block_table": TABLE,
    }
    arrays["out"] = exported(arrays["q"], arrays["k"], arrays["v"], TABLE)
    swapped = TABLE.copy()
    # a kernel that swaps two pages: item 0's page 1 and item 1's page 0 (within one item a
    # swap changes nothing without a causal mask: the keys are a set)
    swapped[0, 1], swapped[1, 0] = TABLE[1, 0], TABLE[0, 1]
    arrays["swapped"] = exported(arrays["q"], arrays["k"], arrays["v"], swapped)
    paths = {}
    for name, a in arrays.items():
        np.save(tmp_path / f"{name}.npy", a)
        paths[name] = str(tmp_path / f"{name}.npy")
    return paths


def paged(files: dict[str, str], table: str | None = None) -> list[str]:
    return [
        files["q"],
        files["k"],
        files["v"],
        "--block-table",
        table or files["block_table"],
        "--key-lengths",
        "6,11",
        "--layout",
        "bshd",
    ]


def test_a_paged_export_passes_and_a_page_swap_fails(files: dict[str, str]) -> None:
    ok = invoke("check", *paged(files), "--expect-output", files["out"])
    assert ok.exit_code == 0, ok.output
    bug = invoke("check", *paged(files), "--expect-output", files["swapped"])
    assert bug.exit_code == 1, bug.output


def test_compute_prints_the_gathered_output(files: dict[str, str]) -> None:
    result = invoke("compute", *paged(files), "--stages", "output", "--format", "json")
    assert result.exit_code == 0, result.output
    data = strict_json(result.stdout)
    out = np.load(files["out"])  # (B, L, H, Ev), as Q's layout
    np.testing.assert_allclose(np.array(data["output"]), out, rtol=0, atol=1e-9)
    view = invoke("compute", *paged(files), "--stages", "output")
    assert "9 pages of 4 keys by the block table" in view.stdout


def test_a_case_file_and_a_manifest_hold_a_block_table(
    files: dict[str, str], tmp_path: Path
) -> None:
    case = tmp_path / "paged.yaml"
    entries = {n: files[n] for n in ("q", "k", "v", "block_table")}
    case.write_text(
        json.dumps({**entries, "key_lengths": list(LENGTHS), "layout": "bshd"}), encoding="utf-8"
    )
    result = invoke("check", str(case), "--expect-output", files["out"])
    assert result.exit_code == 0, result.output
    manifest = tmp_path / "checks.yaml"
    entry = {
        "name": "paged",
        "q": files["q"],
        "k": files["k"],
        "v": files["v"],
        "block-table": files["block_table"],
        "key-lengths": "6,11",
        "layout": "bshd",
        "expect-output": files["swapped"],
    }
    manifest.write_text(json.dumps({"cases": [entry]}), encoding="utf-8")
    assert invoke("check", "--manifest", str(manifest)).exit_code == 1


def _bad(tmp_path: Path, name: str, table: Any) -> str:
    np.save(tmp_path / f"{name}.npy", table)
    return str(tmp_path / f"{name}.npy")


@pytest.mark.parametrize(
    ("name", "table", "lengths", "problem"),
    [
        (
            "range",
            [[5, 2, -1], [7, 9, 3]],
            "6,11",
            "item 1's page 1 (entry [1, 1]) is 9, not a page of K (0 to 8)",
        ),
        (
            "twice",
            [[5, 5, -1], [7, 0, 3]],
            "6,11",
            "item 0 reads physical page 5 twice, as pages 0 and 1 of its table",
        ),
        (
            "long",
            TABLE,
            "6,13",
            "item 1 reads 13 keys (--key-lengths) but its table holds 3 pages of 4 = 12 keys",
        ),
        (
            "rank",
            [5, 2, 7],
            "6,11",
            "the block table should be (B, max_pages), 2-D: but got (3,)",
        ),
        (
            "float",
            [[5.0, 2.0, 0.0], [7.0, 0.0, 3.0]],
            "6,11",
            "the block table holds float64; expected integer page indices",
        ),
    ],
)
def test_an_inconsistent_table_is_one_error_line_naming_it(
    files: dict[str, str], tmp_path: Path, name: str, table: Any, lengths: str, problem: str
) -> None:
    path = _bad(tmp_path, name, np.asarray(table))
    args = paged(files, path)
    args[args.index("--key-lengths") + 1] = lengths
    line = assert_one_error_line(invoke("compute", *args))
    assert line == f"sdpa: error: {path}: {problem}"


def test_pages_unlike_ks_are_one_error_line_naming_v(files: dict[str, str], tmp_path: Path) -> None:
    v = _bad(tmp_path, "v8", np.zeros((P, 2, G, EV)))
    args = paged(files)
    args[2] = v
    line = assert_one_error_line(invoke("compute", *args))
    assert line == (
        f"sdpa: error: {v}: paged V should be (num_pages, page_size, G, Ev) with K's "
        "(num_pages, page_size, G) = (9, 4, 2): but got V (9, 2, 2, 8)"
    )


def test_a_page_shared_amiss_can_fail_a_check(files: dict[str, str], tmp_path: Path) -> None:
    shared = _bad(tmp_path, "shared", np.array([[5, 2, -1], [2, 0, 3]]))
    result = invoke(
        "check", *paged(files, shared), "--fail-on", "page_shared", env={"COLUMNS": "300"}
    )
    assert result.exit_code == 1, result.output
    assert "physical page 2 is page 1 of item 0's table (2 slots)" in result.stdout


def test_the_sample_computes_as_its_pages_gathered_by_hand() -> None:
    case = yaml.safe_load((Path(__file__).parents[2] / "samples" / "paged.yaml").read_text())
    kp, vp, table = (np.array(case[n], dtype=float) for n in ("k", "v", "block_table"))
    lengths = tuple(case["key_lengths"])
    S = max(lengths)
    k, v = np.zeros((2, 1, S, 2)), np.zeros((2, 1, S, 2))
    for b, length in enumerate(lengths):
        for j in range(length):
            k[b, 0, j] = kp[int(table[b, j // 2]), j % 2, 0]
            v[b, 0, j] = vp[int(table[b, j // 2]), j % 2, 0]
    q = np.swapaxes(np.array(case["q"], dtype=float), 1, 2)
    ref = np.swapaxes(attention(q, k, v, key_lengths=lengths).output, 1, 2)
    result = invoke("compute", "sample:paged", "--stages", "output", "--format", "json")
    assert result.exit_code == 0, result.output
    np.testing.assert_allclose(np.array(strict_json(result.stdout)["output"]), ref, atol=1e-9)
