"""Why the logits are too flat or too peaked, in the user's own terms: the scale, or the
temperature that divides the scores after it (the effective scale is scale / T).

The effective scale is too large when it is closer, in log, to 1 than to 1/√d_k
(above d_k^−¼), too small when closer to 1/d_k (below d_k^−¾). The temperature is to
blame where the scale alone is not: ``--temperature 100`` over 1/√d_k flattens every
row, ``--temperature 0.05`` sharpens it; a hint then names the temperature and never
advises a ``--scale`` the run already has.
"""

from __future__ import annotations

import math

from sdpa_cli.engine.spec import AttentionSpec
from sdpa_cli.text import sig


def scale_looks_omitted(spec: AttentionSpec) -> bool:
    """The effective scale is closer, in log, to 1 than to 1/√d_k: the mark of a
    1/√d_k left out (or of a temperature below 1)."""
    return spec.E > 1 and spec.factor > spec.E**-0.25


def scale_looks_doubled(spec: AttentionSpec) -> bool:
    """The effective scale is closer, in log, to 1/d_k than to 1/√d_k: the mark of
    1/√d_k applied twice (or of a temperature above 1)."""
    return spec.E > 1 and spec.factor < spec.E**-0.75


def temperature_sharpens(spec: AttentionSpec) -> bool:
    """The effective scale looks omitted, the scale alone does not: the temperature
    (below 1) is what makes it so."""
    return scale_looks_omitted(spec) and spec.scale <= spec.E**-0.25


def temperature_flattens(spec: AttentionSpec) -> bool:
    """The effective scale looks applied twice, the scale alone does not: the
    temperature (above 1) is what makes it so."""
    return scale_looks_doubled(spec) and spec.scale >= spec.E**-0.75


def temperature_cause(spec: AttentionSpec, does: str) -> str:
    """``the temperature 100 flattens every row (…: an effective scale of 0.00125)``."""
    t = spec.options.temperature
    return (
        f"the temperature {t:g} {does} every row (scores are divided by it after the "
        f"scale, {spec.scale_label}: an effective scale of {sig(spec.factor)})"
    )


def temperature_also(spec: AttentionSpec, below: bool) -> str:
    """The temperature's part where it pushes the same way but is not the whole cause:
    ``the temperature 2 flattens them 2×`` (empty where it does not)."""
    t = spec.options.temperature
    if t == 1 or (t < 1) != below:
        return ""
    return f"the temperature {t:g} " + (
        f"sharpens them {sig(1 / t)}×" if below else f"flattens them {sig(t)}×"
    )


def flat_cause(spec: AttentionSpec) -> str:
    """Why rows are nearly uniform: the temperature, the scale, or the inputs."""
    also = temperature_also(spec, below=False)
    if temperature_flattens(spec):
        return temperature_cause(spec, "flattens")
    if scale_looks_doubled(spec):
        return (
            f"the scale is {spec.scale_label}, nearer 1/d_k than 1/√d_k (1/√{spec.E} = "
            f"{sig(1 / math.sqrt(spec.E))}): was 1/√d_k applied twice?"
            + (f" And {also} more" if also else "")
        )
    inputs = "are Q and K near zero, or were they scaled before export (1/√d_k applied twice)?"
    return f"{also}; {inputs.replace('are Q and K', 'are Q and K also')}" if also else inputs


def peaked_cause(spec: AttentionSpec) -> str:
    """Why rows are one-hot: the temperature, the scale, or the logits' gaps."""
    also = temperature_also(spec, below=True)
    if temperature_sharpens(spec):
        return temperature_cause(spec, "sharpens")
    if scale_looks_omitted(spec):
        return (
            f"the scale is {spec.scale_label}: was 1/√d_k (1/√{spec.E} = "
            f"{sig(1 / math.sqrt(spec.E))}) applied? Without it the logits' spread grows "
            "with √d_k and the softmax saturates" + (f", and {also} more" if also else "")
        )
    return (
        "very large logit gaps saturate the softmax"
        + (f", and {also}" if also else "")
        + ": check that 1/√d_k was applied once, and that low precision did not clip the logits"
    )


def saturation_hint(spec: AttentionSpec) -> str:
    """The hint of a one-hot row (and of a vanishing gradient): its cause, and what it
    costs where the cause is not the scale (whose hint says what it does)."""
    cost = "; a one-hot row passes almost no gradient"
    return peaked_cause(spec) + (
        "" if scale_looks_omitted(spec) and not temperature_sharpens(spec) else cost
    )
