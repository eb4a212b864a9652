"""Tests of ``sdpa explain``: every sample in every format, the JSON contract, the slice
that --batch/--head/--rows/--query pick, bad usage, the exports, and what a terminal
(or a pipe) gets.

Like ``test_cli.py``, the command runs in-process through click's ``CliRunner`` (the
``invoke`` helper: ``exit_code`` is what a user sees, ``stderr`` is apart from
``stdout``); inputs are small arrays written with ``np.save`` into a fresh working
directory. The stage values are checked against ``sdpa compute``'s JSON for the same
slice, and a few against numpy.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from click.testing import Result
from clirunner import (
    ANSI,
    CLEAN_ENV,
    assert_one_error_line,
    decode_non_finite,
    invoke,
    strict_json,
)
from numpy.typing import NDArray

from sdpa_cli.errors import ExitCode

F64 = NDArray[np.float64]

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted(p.name for p in (ROOT / "samples").glob("*.yaml"))
QKV = ("q.npy", "k.npy", "v.npy")
B, H, L, S, E = 2, 4, 8, 8, 4
NARROW = {"COLUMNS": "80", "NO_COLOR": "1"}
STAGE_ORDER = ("raw", "scaled", "capped", "biased", "masked", "weights", "dropout", "output")
STAGE_KEYS = ["name", "values", "note", "summary", "findings"]
SUMMARY_KEYS = {"min", "max", "mean", "std", "count", "nonfinite"}
SLICE_KEYS = {"index", "batch", "head", "rows", "queries", "keys"}


def explain(*args: str, env: Mapping[str, str | None] | None = None) -> Result:
    """``sdpa explain ARGS``."""
    return invoke("explain", *args, env=env)


def ok(*args: str, env: Mapping[str, str | None] | None = None) -> Result:
    """``sdpa explain ARGS``, which must succeed with a silent stderr."""
    result = explain(*args, env=env)
    assert result.exit_code == ExitCode.OK, (result.exit_code, result.stderr)
    assert result.stderr == ""
    assert "Traceback" not in result.output
    return result


def explain_json(*args: str) -> dict[str, Any]:
    """``sdpa explain ARGS --format json``: one strict JSON object on one line."""
    result = ok(*args, "--format", "json")
    assert result.stdout.count("\n") == 1
    data = strict_json(result.stdout)
    assert isinstance(data, dict)
    return data


def array(node: Any) -> F64:
    return np.array(decode_non_finite(node), dtype=np.float64)


def lines_of(text: str) -> list[str]:
    return text.split("\n")[:-1] if text.endswith("\n") else text.split("\n")


def too_wide(text: str, width: int = 80) -> list[str]:
    return [line for line in lines_of(text) if len(line) > width]


def trailing(text: str) -> list[str]:
    return [line for line in lines_of(text) if line != line.rstrip()]


# --- fixtures --------------------------------------------------------------------------


@pytest.fixture
def qkv(workdir: Path) -> dict[str, F64]:
    """q/k/v.npy (B, H, L, E) random, a bias (L, S), 2-D, 3-D and empty inputs."""
    rng = np.random.default_rng(20240611)
    arrays = {name: rng.standard_normal((B, H, L, E)) for name in "qkv"}
    for name, arr in arrays.items():
        np.save(workdir / f"{name}.npy", arr)
    np.save(workdir / "bias.npy", rng.standard_normal((L, S)))
    shapes: dict[str, tuple[int, ...]] = {
        "q2": (5, 3), "k2": (6, 3), "v2": (6, 2),  # 2-D: no head axis
        "q3": (3, 5, 2), "k3": (3, 6, 2), "v3": (3, 6, 2),  # 3-D: heads, no batch
        "q0": (0, 4), "k0": (0, 4), "v0": (0, 3), "qs": (3, 4),  # L = 0, S = 0
    }  # fmt: skip
    for name, shape in shapes.items():
        np.save(workdir / f"{name}.npy", rng.standard_normal(shape))
    return arrays


@pytest.fixture
def at_root(monkeypatch: pytest.MonkeyPatch) -> Path:
    """The repository root as the working directory, so samples are named as in the README."""
    monkeypatch.chdir(ROOT)
    return ROOT


# --- every sample, every format ------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["table", "json", "yaml"])
@pytest.mark.parametrize("sample", SAMPLES)
def test_every_sample_runs_in_every_format(at_root: Path, sample: str, fmt: str) -> None:
    result = ok(f"samples/{sample}", "--format", fmt)
    if fmt == "json":
        data = strict_json(result.stdout)
    elif fmt == "yaml":
        data = yaml.safe_load(result.stdout)
    else:
        assert "sdpa explain" in result.stdout
        assert "findings" in result.stdout
        return
    assert isinstance(data, dict)
    assert set(data["slice"]) == SLICE_KEYS
    assert [s["name"] for s in data["stages"]][-1] == "output"


@pytest.mark.parametrize("sample", SAMPLES)
def test_every_sample_has_a_scorecard_and_a_scale_comparison(at_root: Path, sample: str) -> None:
    card = ok(f"samples/{sample}", "--query", "0").stdout
    assert "── scorecard · q0" in card
    assert "contributions" in card
    scales = ok(f"samples/{sample}", "--compare-scales").stdout
    assert "── scales compared" in scales
    assert "◂" in scales  # this run's scale is marked


def test_help_shows_examples_and_exit_codes() -> None:
    result = invoke("explain", "--help-all")
    assert result.exit_code == 0
    text = result.stdout
    assert "Examples:" in text
    for example in (
        "sdpa explain sample:causal",
        "sdpa explain sample:scorecard --query 0",
        "sdpa explain sample:scale_comparison --compare-scales",
    ):
        assert example in text, example
    flat = " ".join(text.split())
    assert "Exit codes:" in flat
    for code in ExitCode:
        assert re.search(rf"(?<![\d.]){int(code)} [a-z]", flat), code
    for option in ("--batch", "--head", "--rows", "--query", "--compare-scales", "--plot"):
        assert option in text, option


# --- the JSON contract -------------------------------------------------------------------


def test_json_slice_and_stages_follow_the_contract(qkv: dict[str, F64]) -> None:
    data = explain_json(*QKV, "--causal", "--batch", "1", "--head", "3")
    assert data["slice"] == {
        "index": [1, 3],
        "batch": 1,
        "head": 3,
        "rows": [0, L],
        "queries": L,
        "keys": S,
    }
    assert "scorecard" not in data
    assert "scales" not in data
    for stage in data["stages"]:
        assert list(stage)[:5] == STAGE_KEYS
        extra = set(stage) - set(STAGE_KEYS)
        assert extra == {"masked": {"visible"}, "weights": {"rows"}}.get(stage["name"], set())
        assert isinstance(stage["note"], str)
        assert stage["note"]
        assert set(stage["summary"]) == SUMMARY_KEYS
        assert isinstance(stage["findings"], list)
    weights = next(s for s in data["stages"] if s["name"] == "weights")
    assert [r["row"] for r in weights["rows"]] == list(range(L))
    masked = next(s for s in data["stages"] if s["name"] == "masked")
    assert masked["visible"] == np.tril(np.ones((L, S), dtype=bool)).tolist()


@pytest.mark.parametrize(
    ("options", "added"),
    [
        ([], set()),
        (["--softcap", "5"], {"capped"}),
        (["--alibi"], {"biased"}),
        (["--bias", "bias.npy"], {"biased"}),
        (["--causal"], {"masked"}),
        (["--window", "2"], {"masked"}),
        (["--dropout", "0.1"], {"dropout"}),
        (["--softcap", "5", "--alibi", "--dropout", "0.1"], {"capped", "biased", "dropout"}),
        (
            ["--softcap", "5", "--bias", "bias.npy", "--dropout", "0.1", "--causal"],
            {"capped", "biased", "masked", "dropout"},
        ),
    ],
    ids=["plain", "softcap", "alibi", "bias", "causal", "window", "dropout", "all-alibi", "all"],
)
def test_optional_stages_appear_only_when_asked_for(
    qkv: dict[str, F64], options: list[str], added: set[str]
) -> None:
    data = explain_json(*QKV, *options)
    names = [s["name"] for s in data["stages"]]
    always = {"raw", "scaled", "weights", "output"}
    assert names == [s for s in STAGE_ORDER if s in always | added]


def test_scorecard_only_with_query(qkv: dict[str, F64]) -> None:
    data = explain_json(*QKV, "--query", "5", "--batch", "1", "--head", "2")
    assert data["slice"]["rows"] == [5, 6]
    card = data["scorecard"]
    assert card["query"] == 5
    assert card["index"] == [1, 2, 5]
    assert len(card["keys"]) == S
    assert "scales" not in data
    output = next(s for s in data["stages"] if s["name"] == "output")
    np.testing.assert_allclose(card["output"], output["values"][0], rtol=1e-12)
    weights = next(s for s in data["stages"] if s["name"] == "weights")
    np.testing.assert_allclose([k["weight"] for k in card["keys"]], weights["values"][0])
    assert sum(k["weight"] for k in card["keys"]) == pytest.approx(1.0)


def test_scales_only_with_compare_scales(qkv: dict[str, F64]) -> None:
    data = explain_json(*QKV, "--compare-scales", "--max-rows", "3")
    assert "scorecard" not in data
    scales = data["scales"]
    assert set(scales) == {"runs", "verdict"}
    assert isinstance(scales["verdict"], str)
    runs = scales["runs"]
    assert [r["scale"] for r in runs] == ["none", "sqrt-dk", "dk"]
    assert [r["current"] for r in runs] == [False, True, False]
    assert [r["factor"] for r in runs] == pytest.approx([1.0, 1 / math.sqrt(E), 1 / E])
    for run in runs:
        assert np.array(run["weights"]).shape == (3, S)
    # A scale of its own is a fourth run, and the current one.
    own = explain_json(*QKV, "--compare-scales", "--scale", "0.3")["scales"]["runs"]
    assert [r["current"] for r in own] == [False, False, False, True]
    assert own[-1]["factor"] == pytest.approx(0.3)


@pytest.mark.parametrize(
    ("options", "rows"),
    [
        ([], [0, L]),
        (["--max-rows", "3"], [0, 3]),
        (["--rows", "2:6"], [2, 6]),
        (["--rows", "5"], [5, 6]),
        (["--rows", ":3"], [0, 3]),
        (["--rows", "6:"], [6, L]),
        (["--rows", "1:7", "--max-rows", "2"], [1, 7]),
        (["--query", "4"], [4, 5]),
    ],
)
def test_values_hold_the_rows_shown_with_every_key(
    qkv: dict[str, F64], options: list[str], rows: list[int]
) -> None:
    data = explain_json(*QKV, *options)
    assert data["slice"]["rows"] == rows
    for stage in data["stages"]:
        width = E if stage["name"] == "output" else S  # Ev = E here
        assert array(stage["values"]).shape == (rows[1] - rows[0], width), stage["name"]


def test_yaml_holds_the_same_document_as_json(qkv: dict[str, F64]) -> None:
    args = (*QKV, "--causal", "--query", "2", "--compare-scales")
    from_json = decode_non_finite(explain_json(*args))
    from_yaml = yaml.safe_load(ok(*args, "--format", "yaml").stdout)
    assert from_yaml.keys() == from_json.keys()
    for name in ("slice", "variance", "scorecard", "scales", "finding_counts"):
        assert from_yaml[name] == from_json[name], name
    for a, b in zip(from_yaml["stages"], from_json["stages"], strict=True):
        np.testing.assert_array_equal(np.array(a["values"]), np.array(b["values"]))


# --- --batch and --head pick the slice -----------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        [],
        ["--causal", "--softcap", "2", "--alibi", "--dropout", "0.3", "--seed", "3"],
        ["--bias", "bias.npy", "--window", "2", "--rows", "2:7", "--max-rows", "3"],
    ],
    ids=["plain", "every-stage", "rows"],
)
def test_batch_and_head_select_the_same_slice_as_compute(
    qkv: dict[str, F64], options: list[str]
) -> None:
    explained = explain_json(*QKV, *options, "--batch", "1", "--head", "2")
    computed = invoke("compute", *QKV, *options, "--format", "json")
    assert computed.exit_code == 0, computed.stderr
    full = strict_json(computed.stdout)
    start, stop = explained["slice"]["rows"]
    assert explained["slice"]["index"] == [1, 2]
    names = [s["name"] for s in explained["stages"]]
    engine = [{"dropout": "dropped"}.get(n, n) for n in names]
    # compute shows every stage; explain leaves out the masked logits when nothing masks.
    assert engine == [s for s in full["stages"] if s in engine]
    assert set(full["stages"]) - set(engine) <= {"masked"}
    for stage in explained["stages"]:
        name = {"dropout": "dropped"}.get(stage["name"], stage["name"])
        expected = array(full[name])[1, 2, start:stop]
        np.testing.assert_allclose(
            array(stage["values"]), expected, rtol=1e-12, atol=1e-15, err_msg=name
        )
    # And not another slice.
    other = array(full["raw"])[0, 2, start:stop]
    assert not np.allclose(array(explained["stages"][0]["values"]), other)


def test_slice_of_3d_inputs_has_heads_only(qkv: dict[str, F64]) -> None:
    data = explain_json("q3.npy", "k3.npy", "v3.npy", "--head", "2")
    assert data["slice"] | {"rows": None} == {
        "index": [2],
        "batch": None,
        "head": 2,
        "rows": None,
        "queries": 5,
        "keys": 6,
    }
    q, k = np.load("q3.npy")[2], np.load("k3.npy")[2]
    np.testing.assert_allclose(array(data["stages"][0]["values"]), q @ k.T, rtol=1e-12)


def test_2d_inputs_accept_head_and_batch_zero(qkv: dict[str, F64]) -> None:
    data = explain_json("q2.npy", "k2.npy", "v2.npy", "--head", "0", "--batch", "0")
    assert data["slice"]["index"] == []
    assert data["slice"]["batch"] is None
    assert data["slice"]["head"] is None


# --- bad usage: one line, exit 2, no file written ------------------------------------------

# (id, arguments after `explain`, how the line starts after "sdpa: error: ", a fragment)
ERRORS: list[tuple[str, list[str], str, str]] = [
    ("head-out-of-range", [*QKV, "--head", "4"], "--head: ", "4 heads (0..3)"),
    ("head-negative", [*QKV, "--head", "-1"], "--head: ", "out of range"),
    ("batch-out-of-range", [*QKV, "--batch", "2"], "--batch: ", "2 batch items (0..1)"),
    ("batch-negative", [*QKV, "--batch", "-1"], "--batch: ", "out of range"),
    ("head-on-2d", ["q2.npy", "k2.npy", "v2.npy", "--head", "1"], "--head: ", "no head axis"),
    ("batch-on-2d", ["q2.npy", "k2.npy", "v2.npy", "--batch", "1"], "--batch: ", "no batch"),
    ("batch-on-3d", ["q3.npy", "k3.npy", "v3.npy", "--batch", "1"], "--batch: ", "no batch"),
    ("query-out-of-range", [*QKV, "--query", "8"], "--query: ", "outside the 8 query rows"),
    ("query-negative", [*QKV, "--query", "-1"], "--query: ", "-1"),
    ("query-with-rows", [*QKV, "--query", "1", "--rows", "1"], "--query: ", "--rows"),
    ("query-no-rows", ["q0.npy", "k0.npy", "v0.npy", "--query", "0"], "--query: ", "L = 0"),
    ("rows-garbage", [*QKV, "--rows", "x"], "--rows: ", "'x'"),
    ("rows-reversed", [*QKV, "--rows", "5:3"], "--rows: ", "'5:3'"),
    ("rows-past-the-end", [*QKV, "--rows", "8"], "--rows: ", "'8'"),
    ("rows-empty-range", [*QKV, "--rows", "3:3"], "--rows: ", "'3:3'"),
    ("plot-not-png", [*QKV, "--plot", "keep.jpg"], "--plot: ", "PNG"),
    ("missing-input", ["nope.npy", "k.npy", "v.npy"], "nope.npy: ", "no such file"),
    ("missing-case", ["nope.yaml"], "nope.yaml: ", "no such file"),
    ("missing-bias", [*QKV, "--bias", "nope.npy"], "nope.npy: ", "no such file"),
    ("two-inputs", ["q.npy", "k.npy"], "q.npy k.npy: ", "got 2 inputs"),
    ("bad-softcap", [*QKV, "--softcap", "0"], "--softcap: ", "positive"),
    ("bad-dropout", [*QKV, "--dropout", "1"], "--dropout: ", "[0, 1)"),
    ("max-rows-zero", [*QKV, "--max-rows", "0"], "Invalid value for '--max-rows'", "0"),
    ("precision-13", [*QKV, "--precision", "13"], "Invalid value for '--precision'", "13"),
    ("format-xml", [*QKV, "--format", "xml"], "Invalid value for '--format'", "xml"),
    ("export-into-missing-dir", [*QKV, "--export-svg", "nodir/t.svg"], "nodir/t.svg: ", "nodir"),
]
KEPT = b"an earlier result that must survive"


def targets(args: Sequence[str], stem: str) -> list[str]:
    """``--export-svg``, ``--export-html`` and ``--plot`` onto ``stem.*``, unless the
    case names its own."""
    out = []
    for option, suffix in (("--export-svg", "svg"), ("--export-html", "html"), ("--plot", "png")):
        if option not in args:
            out += [option, f"{stem}.{suffix}"]
    return out


def listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


@pytest.mark.parametrize(
    ("args", "head", "fragment"), [pytest.param(a, h, f, id=i) for i, a, h, f in ERRORS]
)
def test_bad_usage_is_one_line_and_writes_nothing(
    qkv: dict[str, F64], workdir: Path, args: list[str], head: str, fragment: str
) -> None:
    for name in ("keep.svg", "keep.html", "keep.png", "keep.jpg"):
        (workdir / name).write_bytes(KEPT)
    before = listing(workdir)
    # New targets are not created...
    line = assert_one_error_line(explain(*args, *targets(args, "new")))
    assert line.startswith("sdpa: error: " + head), line
    assert fragment in line[len("sdpa: error: ") :], line
    assert ANSI not in line
    assert listing(workdir) == before
    # ...and existing ones are left as they were.
    assert_one_error_line(explain(*args, *targets(args, "keep"), "--color"))
    assert listing(workdir) == before
    for name in ("keep.svg", "keep.html", "keep.png", "keep.jpg"):
        assert (workdir / name).read_bytes() == KEPT, name


def test_error_catalogue_is_distinct() -> None:
    assert len({i for i, *_ in ERRORS}) == len(ERRORS)


def hide_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import matplotlib`` (and anything under it) fail, as when it is not installed."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "sdpa_cli.render.plot", raising=False)


def test_plot_without_matplotlib_is_one_line_and_writes_nothing(
    qkv: dict[str, F64], workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hide_matplotlib(monkeypatch)
    for name in ("keep.svg", "keep.png"):
        (workdir / name).write_bytes(KEPT)
    before = listing(workdir)
    line = assert_one_error_line(explain(*QKV, "--plot", "new.png", "--export-svg", "new.svg"))
    assert line.startswith("sdpa: error: --plot: "), line
    assert "matplotlib" in line
    assert "pip install" in line
    line = assert_one_error_line(explain(*QKV, "--plot", "keep.png", "--export-svg", "keep.svg"))
    assert line.startswith("sdpa: error: --plot: "), line
    assert listing(workdir) == before
    assert (workdir / "keep.png").read_bytes() == KEPT
    assert (workdir / "keep.svg").read_bytes() == KEPT
    # Without --plot, matplotlib is not needed.
    ok(*QKV, "--export-svg", "new.svg")
    assert (workdir / "new.svg").exists()


def test_internal_error_is_one_line_and_exit_3(
    qkv: dict[str, F64], workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sdpa_cli.api.explain

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(sdpa_cli.api.explain, "build", broken)
    line = assert_one_error_line(explain(*QKV, "--export-svg", "new.svg"), code=ExitCode.INTERNAL)
    assert line.startswith("sdpa: error: internal error: RuntimeError: boom")
    assert not (workdir / "new.svg").exists()


# --- the exports ---------------------------------------------------------------------------

SVG_HEAD = re.compile(r"^\s*(<\?xml[^>]*\?>\s*)?<svg\b")


def check_exports(d: Path, words: Sequence[str] = ("weights", "softmax")) -> None:
    """trace.svg, trace.html and trace.png in ``d``, the first two holding ``words``."""
    svg = (d / "trace.svg").read_text(encoding="utf-8")
    assert SVG_HEAD.match(svg), svg[:80]
    assert svg.rstrip().endswith("</svg>")
    html = (d / "trace.html").read_text(encoding="utf-8")
    assert html.lstrip().lower().startswith(("<!doctype html", "<html"))
    assert "</html>" in html.lower()
    for word in words:
        assert word in svg, word
        assert word in html, word
    png = (d / "trace.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(png) > 1000


EXPORTS = ("--export-svg", "trace.svg", "--export-html", "trace.html", "--plot", "trace.png")


def test_exports_are_written_from_a_pipe_and_the_trace_still_printed(
    workdir: Path, qkv: dict[str, F64]
) -> None:
    (workdir / "trace.png").write_bytes(KEPT)  # replaced, not kept, on success
    result = ok(*QKV, "--causal", "--head", "1", *EXPORTS)
    assert "weights  softmax over keys" in result.stdout
    assert "── batch 0 · head 1" in result.stdout
    assert ANSI not in result.stdout
    check_exports(workdir)
    assert sorted(p.name for p in workdir.glob("trace*")) == [
        "trace.html",
        "trace.png",
        "trace.svg",
    ]
    assert not list(workdir.glob(".*tmp"))  # no temporary file left behind


def test_exports_with_json_on_stdout(workdir: Path, qkv: dict[str, F64]) -> None:
    data = explain_json(*QKV, "--query", "1", *EXPORTS)
    assert data["scorecard"]["query"] == 1
    check_exports(workdir, ("scorecard", "contributions"))


def test_plot_of_a_sample(at_root: Path, tmp_path: Path) -> None:
    ok("samples/causal.yaml", "--plot", str(tmp_path / "causal.png"))
    assert (tmp_path / "causal.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_of_an_empty_input_is_silent(workdir: Path, qkv: dict[str, F64]) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok("qs.npy", "k0.npy", "v0.npy", "--plot", "empty.png")
    assert (workdir / "empty.png").read_bytes()[:4] == b"\x89PNG"
    assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == []


# --- the terminal ----------------------------------------------------------------------------


def test_no_ansi_codes_in_a_pipe_or_with_no_color(qkv: dict[str, F64]) -> None:
    assert ANSI not in ok(*QKV, "--causal").stdout
    assert ANSI not in ok(*QKV, "--causal", env={"NO_COLOR": "1"}).stdout
    assert ANSI not in ok(*QKV, "--causal", "--no-color", env={"FORCE_COLOR": "1"}).stdout
    assert ANSI not in ok(*QKV, "--query", "0", env={"NO_COLOR": "1"}).stdout
    assert ANSI not in ok(*QKV, "--compare-scales", env={"NO_COLOR": "1"}).stdout


def test_color_forces_codes_into_a_pipe(qkv: dict[str, F64]) -> None:
    for extra in ([], ["--query", "0"], ["--compare-scales"]):
        assert ANSI in ok(*QKV, "--causal", "--color", *extra).stdout, extra
    # but never into JSON
    assert ANSI not in ok(*QKV, "--color", "--format", "json").stdout


def test_color_changes_nothing_but_the_codes(qkv: dict[str, F64]) -> None:
    plain = ok(*QKV, "--causal", "--query", "3").stdout
    colored = ok(*QKV, "--causal", "--query", "3", "--color").stdout
    stripped = re.sub(r"\x1b\[[0-9;]*m", "", colored)
    # Without color the lines lose rich's trailing padding; with it they keep it.
    assert [line.rstrip() for line in stripped.splitlines()] == plain.splitlines()


@pytest.mark.parametrize("sample", SAMPLES)
def test_samples_fit_80_columns(at_root: Path, sample: str) -> None:
    for extra in ([], ["--query", "0"], ["--compare-scales"]):
        out = ok(f"samples/{sample}", *extra, env=NARROW).stdout
        assert not too_wide(out), (extra, too_wide(out))


# Trailing spaces: rich pads wrapped lines and table cells; without color the
# command prints plain lines stripped of them (cli.options.print_all).
@pytest.mark.parametrize("sample", SAMPLES)
def test_samples_have_no_trailing_spaces(at_root: Path, sample: str) -> None:
    out = ok(f"samples/{sample}", env=NARROW).stdout
    assert not trailing(out), trailing(out)


def test_a_wrapped_description_has_no_trailing_spaces(at_root: Path) -> None:
    out = ok("samples/causal.yaml", "--format", "table", env=NARROW).stdout
    description = out.split("╭")[0]
    assert len(lines_of(description)) > 1  # it does wrap at 80 columns
    assert not trailing(description), trailing(description)


def test_a_flag_column_has_no_trailing_spaces(at_root: Path) -> None:
    out = ok("samples/fp16_overflow.yaml", env=NARROW).stdout
    table = [line for line in lines_of(out) if "H/Hmax" in line]
    assert table
    assert table[0].endswith("flag"), repr(table[0])


def random_inputs(d: Path, shape: tuple[int, ...], seed: int) -> tuple[str, str, str]:
    rng = np.random.default_rng(seed)
    for name in "qkv":
        np.save(d / f"{name}_{seed}.npy", rng.standard_normal(shape))
    return (f"q_{seed}.npy", f"k_{seed}.npy", f"v_{seed}.npy")


def test_every_stage_of_a_wide_input_fits_80_columns(workdir: Path) -> None:
    files = random_inputs(workdir, (1, 2, 64, 32), 3)
    options = ("--causal", "--softcap", "20", "--alibi", "--dropout", "0.1")
    out = ok(*files, *options, "--head", "1", env=NARROW).stdout
    for title in ("soft-capped", "biased", "masked logits", "after dropout", "output"):
        assert title in out
    assert "keys 0–" in out  # the cut is said, not hidden
    assert not too_wide(out), too_wide(out)
    assert not trailing(out), trailing(out)
    scales = ok(*files, *options, "--compare-scales", env=NARROW).stdout
    assert not too_wide(scales), too_wide(scales)
    assert not trailing(scales), trailing(scales)


def test_a_large_input_does_not_flood_the_terminal(workdir: Path) -> None:
    files = random_inputs(workdir, (1, 1, 512, 16), 4)
    out = ok(*files, env=NARROW).stdout
    assert len(lines_of(out)) < 200, len(lines_of(out))
    assert "rows q0–q15 of 512" in out
    assert not too_wide(out)
    card = ok(*files, "--query", "511", env=NARROW).stdout
    assert len(lines_of(card)) < 80, len(lines_of(card))
    assert "the heaviest 16 of the 512 keys listed, heaviest first; the other 496" in " ".join(
        card.split()
    )
    assert not too_wide(card)


def test_rows_beyond_max_rows_are_cut_in_the_table(workdir: Path) -> None:
    files = random_inputs(workdir, (1, 1, 512, 16), 4)
    out = ok(*files, "--rows", "0:512", "--max-rows", "4", env=NARROW).stdout
    assert len(lines_of(out)) < 200, len(lines_of(out))


# --- the scorecard at 80 columns --------------------------------------------------------


def test_scorecard_has_no_trailing_spaces(at_root: Path) -> None:
    out = ok("samples/scorecard.yaml", "--query", "0", env=NARROW).stdout
    assert not trailing(out), trailing(out)


def scorecard_section(out: str) -> list[str]:
    return lines_of(out.split("── scorecard")[1].split("contributions")[0])[1:]


def test_scorecard_lines_wrap_indented(workdir: Path) -> None:
    files = random_inputs(workdir, (3, 4), 5)  # d_k = 4: terms written out
    out = ok(*files, "--query", "0", env=NARROW).stdout
    section = scorecard_section(out)
    assert sum(line.startswith("  q0·k") for line in section) == 3
    # Every line starts a part of the card (a wrapped note continues indented).
    heads = ("q0 = ", "  ", "key ", "k0 ", "k1 ", "k2 ", "m = max logit", "e^(x − m) / Z")
    assert all(line.startswith(heads) for line in section if line), section


def test_contributions_keep_key_labels_and_weights_at_80_columns(workdir: Path) -> None:
    files = random_inputs(workdir, (1, 1, 8, 4), 6)
    out = ok(*files, "--query", "0", "--prescale", env=NARROW).stdout
    contributions = lines_of(out.split("contributions")[1].split("findings")[0])[1:]
    labels = [line.split()[0] for line in contributions if line.strip()]
    assert labels[:8] == [f"k{j}" for j in range(8)], contributions
    assert "…" not in "\n".join(contributions)


def test_contributions_show_non_finite_vectors(workdir: Path) -> None:
    np.save(workdir / "iq.npy", np.array([[1.0, 0.0]]))
    np.save(workdir / "ik.npy", np.array([[1.0, 0.0], [0.0, 1.0]]))
    np.save(workdir / "iv.npy", np.array([[np.inf, 1.0], [2.0, 3.0]]))
    out = ok("iq.npy", "ik.npy", "iv.npy", "--query", "0", env=NARROW).stdout
    contributions = out.split("contributions  weight · v_j")[1]
    row = next(line for line in lines_of(contributions) if line.startswith("k0 "))
    assert "[inf, 1]" in row, row
    assert "= [inf, 0.6698]" in row, row


def test_scorecard_of_a_fully_masked_row_under_a_finite_mask_value(at_root: Path) -> None:
    args = ("samples/causal.yaml", "--mask-value", "-1e9", "--key-lengths", "0", "--query", "1")
    out = ok(*args, env=NARROW).stdout
    assert "0.3333" in out  # the weights are 1/3 each...
    assert "every weight is zero" not in out  # ...so the card must not say they are zero


def test_scorecard_of_a_fully_masked_row_under_minus_inf(at_root: Path) -> None:
    args = ("samples/causal.yaml", "--key-lengths", "0", "--query", "1")
    out = ok(*args, env=NARROW).stdout
    assert "no visible key: every weight is zero, and so is the output" in out
    assert "= [0.0000, 0.0000]" in out


# --- edge cases ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("files", "L_", "S_"),
    [(("q0.npy", "k0.npy", "v0.npy"), 0, 0), (("qs.npy", "k0.npy", "v0.npy"), 3, 0)],
    ids=["L=0,S=0", "S=0"],
)
def test_empty_inputs_exit_zero(
    qkv: dict[str, F64], files: tuple[str, ...], L_: int, S_: int
) -> None:
    out = ok(*files, env=NARROW).stdout
    assert "output  weights · V" in out
    assert not too_wide(out)
    data = explain_json(*files)
    assert data["slice"]["queries"] == L_
    assert data["slice"]["keys"] == S_
    assert data["slice"]["rows"] == [0, L_]
    output = next(s for s in data["stages"] if s["name"] == "output")
    assert array(output["values"]).reshape(L_, 3).tolist() == [[0.0] * 3] * L_
    yaml.safe_load(ok(*files, "--format", "yaml").stdout)
    scales = ok(*files, "--compare-scales").stdout
    assert "No row has two visible keys" in scales
    if L_:
        card = ok(*files, "--query", "0").stdout
        assert "no visible key" in card


def test_empty_inputs_have_no_blank_space_lines(qkv: dict[str, F64]) -> None:
    out = ok("q0.npy", "k0.npy", "v0.npy", env=NARROW).stdout
    assert not trailing(out), trailing(out)


# --- end to end: the installed entry point -------------------------------------------------


@pytest.mark.e2e
def test_e2e_piped_at_80_columns() -> None:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    env.update(COLUMNS="80")
    proc = subprocess.run(
        [sys.executable, "-m", "sdpa_cli", "explain", "samples/scorecard.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert ANSI not in proc.stdout
    assert "raw scores  Q·Kᵀ" in proc.stdout
    assert not too_wide(proc.stdout)
