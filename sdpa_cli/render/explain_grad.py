"""``explain --backward``'s walk → rich renderables: each backward stage of the
explained slice (dO, dA, dS, dQ, dK, dV, d(bias)) with its formula, note, table and
findings. Never prints.
"""

from __future__ import annotations

from rich.console import RenderableType
from rich.text import Text

from sdpa_cli.diagnosis.explained import Explanation
from sdpa_cli.names import FORMULAS as BACKWARD_FORMULAS
from sdpa_cli.render.common import THEME, View, note_text, rule, titled
from sdpa_cli.render.findings import stage_findings
from sdpa_cli.render.heatmap import matrix_table
from sdpa_cli.text import plural

BACKWARD_AXES = {
    "d_output": ("q", "v"),
    "d_weights": ("q", "k"),
    "d_scores": ("q", "k"),
    "d_scaled": ("q", "k"),
    "d_query": ("q", "e"),
    "d_key": ("k", "e"),
    "d_value": ("k", "v"),
    "d_bias": ("q", "k"),
}
"""Row and column labels of each backward stage's table."""


def render_backward(ex: Explanation, view: View) -> list[RenderableType]:
    """``explain --backward``: each backward stage's formula, note, table and findings,
    then where the other gradient findings are."""
    back = ex.backward
    assert back is not None
    parts: list[RenderableType] = [
        rule(f"backward · ℓ = Σ O ⊙ dO · dO {back.dout_label}", view.width)
    ]
    rows = ex.rows
    for st in back.stages:
        parts.append(titled(st.name, BACKWARD_FORMULAS[st.name]))
        parts.append(note_text(st.note, view.width))
        row_prefix, col_prefix = BACKWARD_AXES[st.name]
        n_rows, n_cols = st.values.shape
        shown = view.key_columns(n_rows) if row_prefix == "k" else range(len(rows))
        cols = view.key_columns(n_cols) if col_prefix == "k" else range(n_cols)
        offset = 0 if row_prefix == "k" else rows.start
        parts.append(
            matrix_table(st.values, shown, cols, row_prefix, col_prefix, view, row_offset=offset)
        )
        if st.findings:
            parts.extend(stage_findings(st.findings, view.width))
        parts.append(Text(""))
    if back.elsewhere:
        parts.append(
            Text(
                f"{plural(len(back.elsewhere), 'more gradient finding')} elsewhere in the input "
                "(sdpa grad lists them all)",
                THEME["muted"],
            )
        )
        parts.append(Text(""))
    return parts
