"""Checks of the options and extra tensors that :func:`~sdpa_cli.engine.spec.build_spec`
makes once the leading axes are known: per-item lists, the query offset, the sinks."""

from __future__ import annotations

from typing import Any

from numpy.typing import NDArray

from sdpa_cli.engine.options import Options
from sdpa_cli.errors import SpecError
from sdpa_cli.text import shown


def check_per_item(
    flag: str,
    values: tuple[int, ...],
    lead: tuple[int, ...],
    scores_shape: tuple[int, ...],
    most: tuple[str, int] | None,
) -> None:
    """One value, or one per batch item; none above ``most`` (what, how many)."""
    B = lead[-2] if len(lead) >= 2 else None
    n_given = len(values)
    if n_given != 1 and n_given != B:
        axis = (
            f"the batch axis has {B} items"
            if B is not None
            else (f"the inputs have no batch axis (scores {scores_shape} read as (H, L, S))")
        )
        what = "offset" if flag == "--query-offset" else "length"
        raise SpecError(
            flag, f"{n_given} {what}s given but {axis}; give one {what} or one per item"
        )
    too_long = [n for n in values if most is not None and n > most[1]]
    if most is not None and too_long:
        name = f"{most[0]}, {'S' if most[0] == 'keys' else 'L'} = {most[1]}"
        raise SpecError(flag, f"{shown(too_long[0])} exceeds the number of {name}")


def check_query_offset(opts: Options) -> None:
    """An offset places queries for causal, window, ALiBi: alone or with lower-right, a slip."""
    if opts.query_offset is not None and not (opts.causal or opts.window or opts.alibi):
        raise SpecError(
            "--query-offset", "places the queries for --causal, --window or --alibi; none given"
        )
    if opts.query_offset is not None and opts.causal_align != "upper-left":
        raise SpecError(
            "--query-offset",
            "replaces --causal-align lower-right (the offset S − L for every item); give one",
        )


def check_sinks(sinks: NDArray[Any], H: int, label: str) -> None:
    """gpt-oss sinks: one logit per query head, ``(H,)``, or one for all, ``(1,)``."""
    if sinks.ndim != 1 or sinks.shape[0] not in (1, H):
        raise SpecError(label, f"shape {tuple(sinks.shape)}, expected (H,) = ({H},) or (1,)")
