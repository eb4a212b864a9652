"""Gradients → rich renderables: ``sdpa grad``'s tables, head norms, numeric check.

Never prints. Tables show a slice as ``compute`` does (``--batch``, ``--head``,
``--rows``, ``--keys``, ``--max-rows``), sized to the console's width.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray
from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from sdpa_cli.diagnosis.findings import Diagnosis
from sdpa_cli.diagnosis.grad import LABEL, GradDiagnosis
from sdpa_cli.engine.grad import Gradients
from sdpa_cli.engine.numeric import NumericCheck
from sdpa_cli.names import gradient_formula
from sdpa_cli.render.common import (
    SEVERITY_STYLE,
    THEME,
    View,
    layout,
    more_slices,
    rule,
    slice_label,
    titled,
)
from sdpa_cli.render.findings import NOTHING_FOUND, findings_panel
from sdpa_cli.render.header import header
from sdpa_cli.render.heatmap import matrix_table
from sdpa_cli.text import format_index, sig

GRADIENT_FOUND = ", no vanishing gradients, no keys without gradient"

GAIN_NOTE = "1−Σw²: how much gradient a row's softmax lets through: 0 one-hot, near 1 spread"
"""What the dQ table's last column is, said under it (the glossary has it too)."""

FORMULAS = {
    **{name: gradient_formula(name) for name in ("dq", "dk", "dv")},
    "dbias": gradient_formula("dbias") + " (the logits' gradient)",
}
"""A gradient's table title: its formula (:mod:`sdpa_cli.names`)."""


def _row_columns(
    grads: Gradients, lead: tuple[int, ...], rows: range, health: GradDiagnosis, view: View
) -> list[tuple[str, list[Text]]]:
    """Per query row: 1 − Σw² (the softmax Jacobian's norm bound) and a flag (the
    finding gives ‖dS‖: the columns leave room for the gradient's own)."""
    flagged = grads.vanishing(health.vanishing)[lead]
    shown = rows[: view.max_rows]
    gains = [Text(sig(float(grads.gain[(*lead, i)]), 3)) for i in shown]
    flags = [
        Text("vanishing", SEVERITY_STYLE["warning"]) if flagged[i] else Text("") for i in shown
    ]
    columns = [("1−Σw²", gains)]
    if any(flagged[i] for i in shown):
        columns.append(("flag", flags))
    return columns


def render_grad(
    grads: Gradients,
    health: GradDiagnosis,
    diagnosis: Diagnosis,
    view: View,
    dout_label: str,
    dtype: str,
    numeric: Sequence[NumericCheck] | None = None,
    tolerance: float = 0.0,
) -> RenderableType:
    """The whole ``grad`` view: header, each chosen slice's dQ, dK, dV (and d(bias)),
    head norms, the numeric check, then the findings (forward and gradient)."""
    spec = grads.spec
    parts: list[RenderableType] = [header(spec, "sdpa grad")]
    judged = f" · gradients judged against {dtype}" if dtype != "float64" else ""
    parts.append(
        Text.assemble(
            ("dO ", THEME["label"]),
            f"{dout_label} · loss ℓ = Σ O ⊙ dO · backward in float64{judged}",
        )
    )
    parts.append(Text(""))
    positions, _, _, picked = layout(spec, view)
    # Every row picked, as every key picked: the table cuts them and says so.
    rows, keys = view.query_rows(spec.L), view.key_columns(spec.S)
    for lead in positions:
        label = slice_label(spec, lead)
        if label:
            parts.append(rule(label, view.width))
        dq = grads.at("dq", lead)
        parts.append(titled("dQ", FORMULAS["dq"]))
        parts.append(
            matrix_table(
                dq,
                rows,
                range(spec.E),
                "q",
                "e",
                view,
                _row_columns(grads, lead, rows, health, view),
            )
        )
        if lead == positions[0]:  # what the column is, where it is read (once)
            parts.append(Text(GAIN_NOTE, THEME["muted"]))
        parts.append(Text(""))
        group = _group_note(spec.group, lead)
        for name, cols, prefix in (("dk", spec.E, "e"), ("dv", spec.Ev, "v")):
            parts.append(titled(LABEL[name], FORMULAS[name] + group))
            parts.append(matrix_table(grads.at(name, lead), keys, range(cols), "k", prefix, view))
            parts.append(Text(""))
        if grads.dsinks is not None:
            sums = "p_sink · (0 − Σ_j A_j dA_j), summed over every row of the head"
            parts.append(Text(f"{LABEL['dsinks']} = {sums}: {grads.dsinks.tolist()}"))
            parts.append(Text(""))
        if grads.dbias is not None:
            at = spec.operand_index("bias", lead)
            d = grads.dbias[at]
            parts.append(titled(LABEL["dbias"], FORMULAS["dbias"] + _broadcast_note(d)))
            parts.append(
                matrix_table(
                    d,
                    rows if d.shape[0] > 1 else range(1),
                    keys if d.shape[1] > 1 else range(1),
                    "q",
                    "k",
                    view,
                )
            )
            parts.append(Text(""))
    parts.extend(more_slices(picked, view))
    parts.append(norms_table(health, view))
    if numeric is not None:
        parts.append(numeric_table(numeric, tolerance))
    parts.append(findings_panel(diagnosis, NOTHING_FOUND + GRADIENT_FOUND))
    return Group(*parts)


def _group_note(group: int, lead: tuple[int, ...]) -> str:
    if group <= 1 or not lead:
        return ""
    first = (lead[-1] // group) * group
    return f", summed over query heads {first}–{first + group - 1}"


def _broadcast_note(d: NDArray[np.float64]) -> str:
    axes = []
    if d.shape[0] == 1:
        axes.append("queries")
    if d.shape[1] == 1:
        axes.append("keys")
    return f", summed over {' and '.join(axes)} (the bias broadcasts)" if axes else ""


def norms_table(health: GradDiagnosis, view: View) -> RenderableType:
    """‖dQ‖ per query head and ‖dK‖, ‖dV‖ per key/value head, with their rows
    whose gradient vanishes and keys that get none."""
    norms = " · ".join(f"‖{LABEL[n]}‖ = {sig(v)}" for n, v in health.norms.items())
    parts: list[RenderableType] = [titled("gradient norms", norms)]
    if len(health.query_heads) > 1 or len(health.kv_heads) > 1:
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        for col in ("slice", "‖dQ‖", "vanishing rows", "mean 1−Σw²"):
            table.add_column(col, justify="right", no_wrap=True)
        for h in health.query_heads[: view.max_rows]:
            mean = "—" if math.isnan(h.mean_gain) else sig(h.mean_gain, 3)
            table.add_row(format_index(h.index), sig(h.dq_norm), f"{h.vanishing} of {h.rows}", mean)
        parts.append(table)
        parts.append(
            Text(
                "vanishing rows: of the rows that see ≥ 2 keys (one key always gets weight 1)",
                THEME["muted"],
            )
        )
        kv = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        for col in ("K/V slice", "‖dK‖", "‖dV‖", "keys without gradient"):
            kv.add_column(col, justify="left" if col == "K/V slice" else "right", no_wrap=True)
        for k in health.kv_heads[: view.max_rows]:
            kv.add_row(
                format_index(k.index),
                sig(k.dk_norm),
                sig(k.dv_norm),
                f"{k.hidden + k.starved} of {k.keys}",
            )
        parts.append(kv)
        if len(health.query_heads) > view.max_rows:
            parts.append(Text(f"first {view.max_rows} heads shown (--max-rows)", THEME["muted"]))
    parts.append(Text(""))
    return Group(*parts)


def numeric_table(checks: Sequence[NumericCheck], tolerance: float) -> RenderableType:
    """Central differences against the analytic gradient, per tensor."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col in ("gradient", "samples", "rel. error", "at", "numeric", "analytic", ""):
        table.add_column(col, justify="left" if col in ("gradient", "at", "") else "right")
    for c in checks:
        ok = c.passed(tolerance)
        table.add_row(
            LABEL[c.name],
            str(c.samples),
            f"{c.max_rel_error:.2e}",
            format_index(c.worst_at) if c.worst_at is not None else "—",
            sig(c.numeric, 6),
            sig(c.analytic, 6),
            Text("ok" if ok else "FAIL", THEME["ok"] if ok else SEVERITY_STYLE["error"]),
        )
    title = titled(
        "numeric check",
        f"float64 central differences; rel. error past rounding ≤ {sig(tolerance, 6)}",
    )
    return Group(title, table, Text(""))
