"""The plain computation in the export's format, for the rows the default judgement
needs it in.

The kernel-relative rule (:mod:`sdpa_cli.check.relative`) reads the plain computation
only where an element, or a slice's mean, is beyond what the rule allows without it
(:func:`~sdpa_cli.check.relative.needs_plain`). A faithful kernel's export rarely is:
the plain computation (every stage rounded to the format, the slow emulation) then
runs for those rows alone, and not at all for most exports. Elsewhere its values are
NaN, "not computed".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.check.compare import Judgement
from sdpa_cli.check.exports import RUN_STAGES, Fitted, tensor_values
from sdpa_cli.check.relative import needs_plain
from sdpa_cli.engine.arrays import NUMPY
from sdpa_cli.engine.block import block_lse
from sdpa_cli.engine.driver import Place, sweep
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.trace import merge_heads, split_heads_of_output, trace
from sdpa_cli.engine.types import F64


def needed_rows(
    spec: AttentionSpec,
    fitted: Mapping[str, Fitted],
    reference: Mapping[str, F64],
    judgement: Judgement,
) -> NDArray[np.bool_]:
    """``(*lead, L)``: the query rows the rule needs the plain computation for: every
    row of a slice where one row's output or LSE cannot pass without it (``reference``
    holds the reference's output in the engine's layout and its LSE)."""
    need = np.zeros((*spec.lead, spec.L), dtype=np.bool_)
    if "output" in fitted:
        f = fitted["output"]
        values = split_heads_of_output(spec, f.values) if f.merged else f.values
        need |= needs_plain(values, reference["output"], judgement, rows=True, slices=2)
    if "lse" in fitted:
        need |= needs_plain(fitted["lse"].values, reference["lse"], judgement, rows=False, slices=1)
    # the rule reads the plain computation's largest error over a whole slice
    need |= need.any(axis=-1, keepdims=True)
    return need


def plain_values(
    naive: AttentionSpec, fitted: Mapping[str, Fitted], need: NDArray[np.bool_], jobs: int = 1
) -> dict[str, F64 | None]:
    """The plain computation's value of each export, in the export's layout: the output
    and the LSE for the row blocks holding a needed row (NaN elsewhere), the weights
    whole (a weights export holds as many numbers itself); None for the output and the
    LSE when no row needs it. The blocks run on ``jobs`` threads, on numpy whatever the
    run's backend (the per-stage path, every stage rounded to the format)."""
    out: dict[str, F64 | None] = {}
    if not need.any():  # nothing needed: no array of NaN the size of the output
        for name in fitted:
            out[name] = None if name != "weights" else _weights(naive)
        return out
    # the output is stored in the format (float32 at widest): float32 holds it exactly
    output = cast(F64, np.full(naive.output_shape, np.nan, dtype=np.float32))
    lse = np.full((*naive.lead, naive.L), np.nan)

    def visit(place: Place) -> None:
        if need[place.lead][place.rows].any():  # blocks write rows of their own
            block = place.attend(naive)
            output[place.at] = block.output
            lse[place.at] = block_lse(block)

    leads = [tuple(int(x) for x in lead) for lead in np.argwhere(need.any(axis=-1))]
    # every key, as a dense kernel sums them: the format's row sums round by their count
    for _ in sweep(naive, visit, jobs=jobs, leads=leads, keys="all", backend=NUMPY):
        pass
    for name, f in fitted.items():
        if name == "output":
            out[name] = merge_heads(naive, output) if f.merged else output
        elif name == "lse":
            out[name] = lse
        else:
            out[name] = _weights(naive)
    return out


def _weights(naive: AttentionSpec) -> F64:
    """The plain computation's weights, whole."""
    return tensor_values(trace(naive, RUN_STAGES, gather_stats=False), "weights")
