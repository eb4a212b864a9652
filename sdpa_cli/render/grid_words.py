"""The words of a model's grid, for the terminal's tables and the page alike (no
rich here: the page is built where rich is not imported): what each metric shows,
what each kind of notable head is, and the rows' labels."""

from __future__ import annotations

from sdpa_cli.diagnosis.findings import Thresholds
from sdpa_cli.diagnosis.model import FLAT_MAX_WEIGHT, SINK_MASS, ModelGrid
from sdpa_cli.text import shared_parts, sig

LABEL_SHARE = 3
"""A row label may take a third of the width (at least :data:`LABEL_MIN` cells)
before it is shortened."""
LABEL_MIN = 12


def metric_description(metric: str, th: Thresholds) -> str:
    """What a metric's table shows, in a line."""
    return {
        "entropy": "mean entropy ÷ log(visible keys): 0 one-hot, 1 uniform",
        "max_weight": "mean largest weight of a row",
        "saturated": f"share of rows one-hot (max weight ≥ {sig(th.saturation)})",
        "near_uniform": (
            f"share of rows nearly uniform (entropy ≥ {sig(th.uniform)} of the maximum)"
        ),
        "fully_masked": "share of rows with no visible key",
        "sink_mass": f"mean weight on key 0 (an attention sink above {sig(SINK_MASS)})",
        "error": "RMS error of the expected output ÷ RMS of the reference (float64)",
    }[metric]


def kind_titles(th: Thresholds) -> dict[str, str]:
    fraction = f"{sig(100 * th.head_fraction)}%"
    return {
        "sink": f"attention sinks, mean weight on key 0 > {sig(SINK_MASS)}",
        "dead": (
            f"dead heads, nearly uniform on ≥ {fraction} of rows (the share shown) or max "
            f"weight within {sig(100 * (FLAT_MAX_WEIGHT - 1))}% of 1/visible keys"
        ),
        "saturated": f"saturated heads, one-hot on ≥ {fraction} of rows (the share shown)",
    }


def row_labels(grid: ModelGrid, width: int) -> tuple[list[str], str, str | None]:
    """The rows' labels, the label column's header, and a note on what was cut.

    By layer when every case has one of its own; else by name, less the dotted parts
    every name shares at either end (``model.layers.3.self_attn`` → ``3``), and a
    label still longer than a third of ``width`` loses its start (``…``)."""
    most = max(LABEL_MIN, width // LABEL_SHARE)
    rows = grid.rows
    layers = [r.layer for r in rows]
    if rows and None not in layers and len(set(layers)) == len(rows):
        return [str(layer) for layer in layers], "layer", None
    labels, shared = shared_parts([r.name for r in rows], "case")
    note = None if shared is None else f"case: {shared}"
    labels = [x if len(x) <= most else "…" + x[-(most - 1) :] for x in labels]
    return labels, "case", note
