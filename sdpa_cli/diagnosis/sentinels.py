"""The rules of a float mask's sentinels: the large negative values models hide keys
with (Hugging Face's ``finfo(dtype).min``, −1e4, −1e9, −inf), which the findings read
as hiding (:data:`~sdpa_cli.engine.masks.HIDES`) while the mask is still added as given.

- a sentinel too weak for the logits it faces: rows that still put weight on keys it
  hides (``mask_suspect``);
- a sentinel beyond a format the run computes in, or its sum with the logits there: −inf
  in that format (``overflow``; harmless, as −inf hides the key too, until a row has no
  visible key);
- rows a finite sentinel leaves with no visible key: their weight stays on the keys it
  hides (``mask_suspect``, beside the ``fully_masked`` rows themselves).

A mask built by adding two masks (causal plus padding, each ``finfo.min``) holds −inf
where both hide, or a value beyond its format: the second rule reports the latter.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.diagnosis.findings import Finding
from sdpa_cli.engine import precision
from sdpa_cli.engine.masks import sentinel_label
from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.engine.stats import Stats
from sdpa_cli.engine.types import Index
from sdpa_cli.text import format_index, plural, sig

LEAK = 2.0**-24
"""Weight a row may keep on the keys a sentinel hides before the sentinel is too weak:
float32's unit roundoff, what a float32 sum of the row can lose anyway."""


def finite_sentinel(spec: AttentionSpec) -> bool:
    """Whether the float mask hides keys with a finite value (added, it leaves weight)."""
    return bool(spec.sentinels and spec.sentinels.finite)


def _first(flagged: NDArray[np.bool_]) -> Index:
    return tuple(int(i) for i in np.argwhere(flagged)[0])


def weak_sentinels(spec: AttentionSpec, stats: Stats) -> Iterator[Finding]:
    """Rows with a visible key that still put more than :data:`LEAK` of their weight on
    the keys a finite sentinel hides: exp(sentinel + logit − row max) is not negligible."""
    if not finite_sentinel(spec):
        return
    assert spec.sentinels is not None
    leaking = (stats.n_visible > 0) & (stats.hidden_weight > LEAK)
    n = int(leaking.sum())
    if not n:
        return
    ranked = np.where(leaking, stats.hidden_weight, -1.0)
    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(ranked)), ranked.shape))
    weight = float(stats.hidden_weight[worst])
    logits = stats.records.absmax["scaled"].extreme
    label = spec.sentinels.label()
    yield Finding(
        "mask_suspect",
        "warning",
        f"the float mask's sentinel {label} hides too little: {plural(n, 'row')} still put "
        f"weight on keys it hides (row {format_index(worst)}: {sig(weight, 3)} of its "
        f"weight), against logits up to {sig(logits, 3)}",
        hint="a sentinel must sit far below the logits it faces, so that exp(sentinel + "
        "logit − row max) vanishes: use −inf or finfo(dtype).min, or find why the logits "
        "are this large",
        index=_first(leaking),
        stage="masked",
        count=n,
        details={
            "sentinels": list(spec.sentinels.values),
            "largest_hidden_weight": weight,
            "largest_hidden_weight_at": list(worst),
            "largest_logit": logits,
        },
    )


def sentinel_overflow(
    spec: AttentionSpec, stats: Stats, working: tuple[str, ...]
) -> Iterator[Finding]:
    """A sentinel beyond a format the run computes in, or its sum with the logits beyond
    it: −inf there. Info, or a warning when some row has no visible key (where −inf
    turns a finite sentinel's weights into zeros, or NaN without a safe softmax)."""
    sentinels = spec.sentinels
    if not sentinels or not sentinels.finite:
        return
    empty = bool(stats.empty_rows.any())
    severity = "warning" if empty else "info"
    hint = (
        "−inf hides a key as well as the sentinel does; only a row with no visible key "
        "differs (zeros from a safe softmax, NaN from a plain one); build the mask in "
        "the format it meets (torch.finfo(dtype).min)"
    )
    for d in working:
        if d not in stats.narrow:
            continue
        f = precision.fmt(d)
        beyond = [x for x in sentinels.finite if bool(f.overflows(np.asarray([x]))[0])]
        if beyond:
            yield Finding(
                "overflow",
                severity,
                f"the float mask's sentinel {sentinel_label(beyond[0])} is −inf in {d} "
                f"(beyond ±{sig(f.max)})",
                hint=hint,
                stage="masked",
                dtype=d,
                count=None,
                details={"sentinel": beyond[0]},
            )
            continue
        rec = stats.records.sentinel_add_overflow[d]
        if rec.count:
            yield Finding(
                "overflow",
                severity,
                f"the float mask's sentinel plus the logits overflows {d} at "
                f"{plural(rec.count, 'hidden key')} (e.g. {sig(-rec.extreme)} at "
                f"{format_index(rec.extreme_at)})",
                hint=hint,
                index=rec.first,
                stage="masked",
                dtype=d,
                count=rec.count,
            )


def sentinel_fully_masked(spec: AttentionSpec, stats: Stats) -> Iterator[Finding]:
    """Rows with no visible key whose weight a finite sentinel leaves on hidden keys
    (a finite mask value's such rows are :mod:`~sdpa_cli.diagnosis.rules`' to report)."""
    if not finite_sentinel(spec) or math.isfinite(spec.options.effective_mask_value):
        return
    assert spec.sentinels is not None
    spread = (stats.n_visible == 0) & (stats.hidden_weight > 0)
    n = int(spread.sum())
    if n:
        yield Finding(
            "mask_suspect",
            "warning",
            f"{plural(n, 'row')} have no visible key, and the float mask's finite sentinel "
            f"{spec.sentinels.label()}, added to the logits, leaves their weight on the keys "
            "it hides instead of zero",
            hint="Hugging Face models do the same (their padded query rows are discarded "
            "later); mask with −inf and a safe softmax to get zeros",
            index=_first(spread),
            stage="masked",
            count=n,
        )
