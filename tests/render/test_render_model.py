"""``sdpa report model``'s view: the heatmap tables and the notable heads, read at 80
columns without color; many heads wrap into further tables, long names are shortened,
cells say what they hold (a blank for no such head, ``—`` for no row to judge)."""

from __future__ import annotations

import io
import math
import re

import numpy as np
import pytest
from rich.console import Console

from sdpa_cli.diagnosis.findings import Thresholds
from sdpa_cli.diagnosis.model import CaseHeads, GridRow, ModelGrid, model_grid
from sdpa_cli.names import MODEL_METRICS as METRICS
from sdpa_cli.render.grid_words import row_labels
from sdpa_cli.render.model import cell_text, render_model

TH = Thresholds()


def heads_of(n: int, **metrics: list[float]) -> CaseHeads:
    """``n`` heads whose statistics are set by hand (the others 0; no error unless given)."""
    full = {m: np.array(metrics.get(m, [0.0] * n), dtype=np.float64) for m in METRICS}
    if "error" not in metrics:
        del full["error"]
    return CaseHeads(full, np.full(n, 10), np.full(n, 2.0))


def shown(grid: ModelGrid, metrics: list[str], width: int = 80) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None, no_color=True)
    console.print(render_model(grid, metrics, "m.yaml", width))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    return "\n".join(line.rstrip() for line in text.splitlines())


def a_grid() -> ModelGrid:
    a = heads_of(
        4,
        entropy=[0.02, 1.0, 0.61, math.nan],
        sink_mass=[0.97, 0.25, 0.003, math.nan],
        saturated=[0.95, 0.0, 0.0, 0.0],
        near_uniform=[0.0, 1.0, 0.1, 0.0],
        error=[1.6e-4, 0.29, 0.0, math.inf],
    )
    b = heads_of(2, entropy=[0.7, 0.8], sink_mass=[0.2, 0.3])
    rows = [
        GridRow("model.layers.0.self_attn", heads=a),
        GridRow("model.layers.1.self_attn", heads=b),
        GridRow("model.layers.2.self_attn", error="bad"),
    ]
    return model_grid(rows, TH)


EXPECTED_80 = """m.yaml
3 cases × 4 query heads · each head's rows pooled over the batch
case: model.layers.‹case›.self_attn

── entropy ─────────────────────────────────────────────────────────────────────
  mean entropy ÷ log(visible keys): 0 one-hot, 1 uniform

case  h0  h1  h2  h3
────────────────────
0    .02   1 .61   —
1    .70 .80
2
  0 ▁▂▃▄▅▆▇█ 1

── error ───────────────────────────────────────────────────────────────────────
  RMS error of the expected output ÷ RMS of the reference (float64)

case     h0     h1     h2     h3
────────────────────────────────
0    1.6e-4    .29      0    inf
1
2
  0 ▁▂▃▄▅▆▇█ .29
  no expect-output: model.layers.1.self_attn

── notable heads ───────────────────────────────────────────────────────────────
  attention sinks, mean weight on key 0 > 0.5: 1 head
    model.layers.0.self_attn: h0 .97
  dead heads, nearly uniform on ≥ 90% of rows (the share shown) or max weight
  within 5% of 1/visible keys: 1 head
    model.layers.0.self_attn: h1 1
  saturated heads, one-hot on ≥ 90% of rows (the share shown): 1 head
    model.layers.0.self_attn: h0 .95

not read (1 case; the errors above say why): model.layers.2.self_attn"""


def test_the_view_at_80_columns_without_color() -> None:
    text = shown(a_grid(), ["entropy", "error"])
    assert text == EXPECTED_80
    assert "\x1b[" not in text


def test_sixteen_heads_fit_one_table_at_80_columns() -> None:
    rng = np.random.default_rng(0)
    grid = model_grid(
        [GridRow(f"layer{i}", heads=heads_of(16, entropy=list(rng.random(16)))) for i in range(3)],
        TH,
    )
    text = shown(grid, ["entropy"], 80)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert len(re.findall(r"\bh15\b", text)) == 1  # one table: one header
    rows = [line for line in text.splitlines() if line.startswith("layer1 ")]
    assert len(rows) == 1
    assert len(rows[0].split()[1:]) == 16


def test_more_heads_wrap_by_case_not_into_further_tables() -> None:
    """32 heads at 80 columns: each case's heads 16-31 go on the line below it
    (``↳16``), under the same header; every head once, every value in its case."""
    n = 32
    rng = np.random.default_rng(0)
    grid = model_grid(
        [GridRow(f"layer{i}", heads=heads_of(n, entropy=list(rng.random(n)))) for i in range(3)],
        TH,
    )
    for width in (60, 80, 120):
        text = shown(grid, ["entropy"], width)
        lines = text.splitlines()
        assert max(len(line) for line in lines) <= width
        headers = [line for line in lines if line.lstrip().startswith("case ")]
        assert len(headers) == 1  # one table
        at = lines.index(next(line for line in lines if line.startswith("layer1 ")))
        cells = lines[at].split()[1:]
        while at + 1 < len(lines) and lines[at + 1].startswith("↳"):
            at += 1
            cells += lines[at].split()[1:]
        assert len(cells) == n


def test_rows_are_labelled_by_layer_when_every_case_has_one() -> None:
    rows = [GridRow(f"model.layers.{i}.self_attn", 10 + i, heads_of(1)) for i in range(2)]
    assert row_labels(model_grid(rows, TH), 80) == (["10", "11"], "layer", None)


def test_rows_are_labelled_by_name_when_layers_repeat() -> None:
    rows = [
        GridRow("model.layers.3.self_attn", 3, heads_of(1)),
        GridRow("model.layers.3.self_attn#2", 3, heads_of(1)),  # the layer's second call
    ]
    assert row_labels(model_grid(rows, TH), 80) == (
        ["self_attn", "self_attn#2"],
        "case",
        "case: model.layers.3.‹case›",
    )


@pytest.mark.parametrize(
    ("names", "labels", "note"),
    [
        (
            ["model.layers.0.attn", "model.layers.1.attn"],
            ["0", "1"],
            "case: model.layers.‹case›.attn",
        ),
        (["enc.0", "enc.1", "dec.0"], ["enc.0", "enc.1", "dec.0"], None),
        (["good", "bad"], ["good", "bad"], None),
        (["a.b.c"], ["a.b.c"], None),  # one case: nothing to compare
    ],
)
def test_long_names_lose_what_they_share(
    names: list[str], labels: list[str], note: str | None
) -> None:
    grid = model_grid([GridRow(name, heads=heads_of(1)) for name in names], TH)
    assert row_labels(grid, 80) == (labels, "case", note)


def test_a_label_longer_than_a_third_of_the_width_loses_its_start() -> None:
    name = "transformer.encoder.block.11.layer.0.SelfAttention"
    grid = model_grid([GridRow(name, heads=heads_of(1)), GridRow("x", heads=heads_of(1))], TH)
    labels, _, _ = row_labels(grid, 60)
    assert labels == ["…" + name[-19:], "x"]
    assert len(labels[0]) == 20


@pytest.mark.parametrize(
    ("x", "metric", "text"),
    [
        (0.5, "entropy", ".50"),  # three characters: 16 heads fit 80 columns
        (0.003, "fully_masked", "<.01"),  # one fully masked row among many is not 0
        (0.003, "entropy", "0"),  # a mean that small is rounding
        (0.0, "fully_masked", "0"),
        (1.0, "saturated", "1"),
        (math.nan, "entropy", "—"),
        (1.6e-4, "error", "1.6e-4"),
        (0.29, "error", ".29"),
        (1.5, "error", "1.5"),
        (0.0, "error", "0"),
        (math.inf, "error", "inf"),
    ],
)
def test_cells(x: float, metric: str, text: str) -> None:
    assert cell_text(x, metric) == text


def test_no_notable_head_says_so() -> None:
    grid = model_grid([GridRow("a", heads=heads_of(2, entropy=[0.5, 0.6]))], TH)
    assert "no attention sink, no dead head, no saturated head" in shown(grid, ["entropy"])


def test_the_listed_heads_are_capped_per_kind() -> None:
    grid = model_grid([GridRow("a", heads=heads_of(5, sink_mass=[0.9] * 5))], TH)
    console = Console(file=io.StringIO(), width=80, color_system=None, no_color=True)
    console.print(render_model(grid, ["sink_mass"], "m.yaml", 80, max_listed=2))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "a: h0 .90, h1 .90\n" in text
    assert "… and 3 more (--format json lists every one)" in text
