"""``--html``: one self-contained page from report model, check, explain and compute;
``--tokens`` labels its positions; a bad labels file is one line and no page. (What a
person sees in a browser: tests/pages/test_pages.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from clirunner import assert_one_error_line, invoke
from reference import attention

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = str(ROOT / "samples/model/manifest.yaml")
SCORECARD = str(ROOT / "samples/scorecard.yaml")


def page_data(text: str) -> Any:
    """The JSON a page's script reads (``SDPA_DATA``)."""
    found = re.search(r'<script type="application/json" id="sdpa-data">(.*?)</script>', text)
    assert found is not None
    return json.loads(found.group(1))


def test_report_model_writes_the_grid_with_every_heads_pattern(workdir: Path) -> None:
    result = invoke("report", "model", MANIFEST, "--html", "model.html")
    assert result.exit_code == 0, result.stderr
    text = (workdir / "model.html").read_text()
    data = page_data(text)
    assert len(data["patterns"]) == 3 * 4  # every head of the three layers
    kinds = {(n["case"], n["head"], n["kind"]) for n in data["notable"]}
    assert {(1, 0, "sink"), (1, 2, "dead"), (2, 3, "saturated")} <= kinds
    # the same facts in words, for grep and a screen reader
    assert 'title="model.layers.1.self_attn, head 0: ' in text
    assert "; sink" in text
    assert "3 cases × 4 query heads" in result.stdout  # the terminal's grid is still printed


def test_tokens_label_the_patterns_and_a_count_that_does_not_fit_is_refused(
    workdir: Path,
) -> None:
    (workdir / "tokens.txt").write_text("".join(f"t{i}\n" for i in range(8)))
    result = invoke("report", "model", MANIFEST, "--html", "m.html", "--tokens", "tokens.txt")
    assert result.exit_code == 0, result.stderr
    patterns = page_data((workdir / "m.html").read_text())["patterns"]
    assert 'data-xnames="[&quot;t0&quot;, &quot;t1&quot;' in patterns["0,0"]
    (workdir / "three.txt").write_text("a\nb\nc\n")
    result = invoke("report", "model", MANIFEST, "--html", "bad.html", "--tokens", "three.txt")
    line = assert_one_error_line(result)
    assert line == (
        "sdpa: error: --tokens three.txt: labels 3 queries and 3 keys; the computation has "
        "8 and 8 (case model.layers.0.self_attn)"
    )
    assert not (workdir / "bad.html").exists()


def test_a_decoding_steps_query_is_labelled_with_the_last_token(workdir: Path) -> None:
    """One new query over 8 cached keys (L = 1, S = 8): the keys read the 8 tokens and
    the query the last of them (it was labelled with the first)."""
    rng = np.random.default_rng(0)
    for name, rows in (("q", 1), ("k", 8), ("v", 8)):
        np.save(workdir / f"{name}.npy", rng.standard_normal((1, 2, rows, 4)))
    (workdir / "m.yaml").write_text("cases:\n  - {name: step, q: q.npy, k: k.npy, v: v.npy}\n")
    (workdir / "tokens.txt").write_text("".join(f"t{i}\n" for i in range(8)))
    result = invoke("report", "model", "m.yaml", "--html", "m.html", "--tokens", "tokens.txt")
    assert result.exit_code == 0, result.stderr
    pattern = page_data((workdir / "m.html").read_text())["patterns"]["0,0"]
    keys = ", ".join(f"&quot;t{i}&quot;" for i in range(8))
    assert f'data-xnames="[{keys}]"' in pattern
    assert 'data-ynames="[&quot;t7&quot;]"' in pattern


def write_case(workdir: Path, flipped: bool) -> list[str]:
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 2, 64, 16)).astype(np.float16) for _ in range(3))
    if flipped:
        out = attention(q, k, v, mask=np.triu(np.ones((64, 64), dtype=np.bool_))).output
    else:
        out = attention(q, k, v, causal=True).output
    for name, a in (("q", q), ("k", k), ("v", v), ("out", out.astype(np.float16))):
        np.save(workdir / f"{name}.npy", a)
    return ["q.npy", "k.npy", "v.npy", "--causal", "--expect-output", "out.npy"]


def test_a_failing_check_draws_where_it_fails_and_the_masks(workdir: Path) -> None:
    result = invoke("check", *write_case(workdir, flipped=True), "--html", "check.html")
    assert result.exit_code == 1
    text = (workdir / "check.html").read_text()
    for figure in ("output-rows", "output-worst", "output-mask"):
        assert f'<figure class="heat" id="{figure}"' in text, figure
    assert "64 × 64" not in text  # no pooling at this size
    differ = 64 * 63  # tril against triu: every pair off the diagonal
    assert re.search(rf"the masks over b0 h\d: {differ:,} \(query, key\) pairs differ", text)
    assert "causal mask transposed" in text  # the hint, as the report says it


def test_a_passing_check_is_its_lines(workdir: Path) -> None:
    result = invoke("check", *write_case(workdir, flipped=False), "--html", "check.html")
    assert result.exit_code == 0, result.stderr
    text = (workdir / "check.html").read_text()
    assert "all 4 checks passed" in text
    assert '<figure class="heat"' not in text


def test_explain_draws_every_stage_and_keeps_the_scorecard(workdir: Path) -> None:
    result = invoke("explain", SCORECARD, "--query", "0", "--html", "card.html")
    assert result.exit_code == 0, result.stderr
    text = (workdir / "card.html").read_text()
    for stage in ("scores", "masked", "weights", "output"):
        assert f'id="stage-{stage}"' in text, stage
    assert "scorecard · q0" in text
    assert "[8.8291, 0.8582]" in text


def test_compute_draws_the_window_rows_and_keys_choose(workdir: Path) -> None:
    result = invoke(
        "compute", str(ROOT / "samples/causal.yaml"), "--rows", "1:3", "--keys", "0:2",
        "--html", "w.html",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    text = (workdir / "w.html").read_text()
    assert "queries 1–2 × keys 0–1" in text


@pytest.mark.parametrize("command", ["explain", "compute"])
def test_a_page_never_replaces_an_input(workdir: Path, command: str) -> None:
    (workdir / "case.yaml").write_text((ROOT / "samples/scorecard.yaml").read_text())
    before = (workdir / "case.yaml").read_text()
    assert_one_error_line(invoke(command, "case.yaml", "--html", "case.yaml"))
    assert (workdir / "case.yaml").read_text() == before


def test_a_capture_names_its_tokens_and_the_page_reads_them(workdir: Path) -> None:
    torch = pytest.importorskip("torch")
    from sdpa_cli.capture import capture

    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    with capture("run", tokens=["<s>", "the", "cat", "sat"], notify=lambda _: None):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert json.loads((workdir / "run/tokens.json").read_text()) == ["<s>", "the", "cat", "sat"]
    result = invoke("report", "model", "run/manifest.yaml", "--html", "m.html")
    assert result.exit_code == 0, result.stderr
    assert "&quot;cat&quot;" in (workdir / "m.html").read_text()


def test_the_plot_and_the_page_draw_the_whole_slice_unless_a_window_is_chosen() -> None:
    """``explain --plot`` once drew the 16 rows the tables show; the plot and the page
    now draw the slice, or the --rows/--keys window, pooled past 512 positions."""
    from sdpa_cli.api.pages import window_pictures
    from sdpa_cli.engine.options import parse_options
    from sdpa_cli.engine.spec import build_spec

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 40, 4)) for _ in range(3))
    spec = build_spec(q, k, v, options=parse_options({"causal": True}))
    whole = window_pictures(spec, (0, 1), None, None)
    assert (whole.rows, whole.keys, whole.pool) == (range(40), range(40), 1)
    window = window_pictures(spec, (0, 1), "5:9", "0:20")
    assert (window.rows, window.keys) == (range(5, 9), range(0, 20))
    assert window.stages["weights"].shape == (4, 20)


def test_a_manifests_check_page_is_its_grid_from_the_checks_own_pass(workdir: Path) -> None:
    """``check --manifest --html``: the model's grid, each case's row read from its
    check's pass, coloured by its verdict first; the same figures as report model's."""
    result = invoke("check", "--manifest", MANIFEST, "--html", "checks.html")
    assert result.exit_code == 1  # layer 2's head 1 was exported with the scale 1/d_k
    data = page_data((workdir / "checks.html").read_text())
    assert data["measures"]["verdict"]["values"] == [[0.0] * 4, [0.0] * 4, [1.0] * 4]
    # each head's largest error ÷ its allowance (log2): only layer 2's head 1 is over
    over = np.exp2(np.array(data["measures"]["over_allowance"]["values"], dtype=float))
    assert over[2, 1] > 1
    assert (np.delete(over.ravel(), 2 * 4 + 1) < 1).all()
    assert len(data["patterns"]) == 12
    model = invoke("report", "model", MANIFEST, "--html", "model.html")
    assert model.exit_code == 0
    grid = page_data((workdir / "model.html").read_text())["measures"]
    for metric in ("entropy", "sink_mass", "saturated"):
        np.testing.assert_allclose(
            np.array(data["measures"][metric]["values"], dtype=float),
            np.array(grid[metric]["values"], dtype=float),
            rtol=1e-6,  # the check's reference in float32 (a float16 export's), the grid's float64
            err_msg=metric,
        )


def test_labels_beside_a_manifest_that_do_not_fit_name_their_own_file(workdir: Path) -> None:
    """A capture's tokens.json is read without --tokens: an error names it, not a flag
    the user never gave."""
    import shutil

    shutil.copytree(ROOT / "samples/model", workdir / "run")
    (workdir / "run/tokens.json").write_text('["a", "b"]')
    line = assert_one_error_line(invoke("report", "model", "run/manifest.yaml", "--html", "m.html"))
    assert line == (
        "sdpa: error: run/tokens.json: labels 2 queries and 2 keys; the computation has "
        "8 and 8 (case model.layers.0.self_attn)"
    )
    assert not (workdir / "m.html").exists()


def test_an_export_of_nothing_but_nan_still_gets_its_page(workdir: Path) -> None:
    """Regression: no finite error leaves no worst slice by its ratio (np.nanargmax
    raised, an internal error); the page still draws the rows and a slice."""
    args = write_case(workdir, flipped=False)
    np.save(workdir / "out.npy", np.full((1, 2, 64, 16), np.nan, dtype=np.float16))
    result = invoke("check", *args, "--html", "nan.html")
    assert result.exit_code == 1, result.stderr
    text = (workdir / "nan.html").read_text()
    assert 'id="output-rows"' in text
    assert 'id="output-worst"' in text
