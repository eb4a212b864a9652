"""A call's layer kind: the schedule of attention kinds a model runs, read from its
module, and the options that say it.

Models alternate kinds of attention layer: Gemma 3 and gpt-oss sliding-window layers
between global ones, Llama 4 chunked layers (``attention_chunk_size``) between global
ones. Hugging Face's attention modules name their kind through their config
(``config.layer_types[module.layer_idx]``: ``full_attention``, ``sliding_attention``,
``chunked_attention``) and its size (``config.sliding_window``,
``config.attention_chunk_size``). Each recorded call keeps its kind in calls.yaml
(``layer_kind``), and its case the options that say it (``window``, ``attention_chunk``,
``causal``) when they hide exactly the keys the mask the kernel got hides: the mask
stays the authority, and options that would hide one key more or less (a padded
batch, a sliding cache that dropped keys) are left out, with the reason in calls.yaml.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sdpa_cli.capture.calls import Call
from sdpa_cli.engine import masks
from sdpa_cli.engine.options import parse_options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.engine.visible import visibility

KINDS = {
    "full_attention": "global",
    "sliding_attention": "sliding window",
    "chunked_attention": "chunked",
}
"""Hugging Face's layer types and how a description names them."""


def layer_kind(module: Any) -> tuple[str, dict[str, Any]] | None:
    """The module's layer type and the options that describe it (queries at the end of
    the keys, as Hugging Face's cache positions place them), or None when its config
    names none."""
    config = getattr(module, "config", None)
    index = getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if config is None or index is None or not types or index >= len(types):
        return None
    kind = str(types[index])
    options: dict[str, Any] = {"causal": True, "causal_align": "lower-right"}
    if kind == "sliding_attention" and getattr(config, "sliding_window", None):
        # transformers' sliding_window_overlay: key j is seen when j > i − W
        options["window"] = [int(config.sliding_window) - 1, 0]
    elif kind == "chunked_attention" and getattr(config, "attention_chunk_size", None):
        options["attention_chunk"] = int(config.attention_chunk_size)
    elif kind != "full_attention":
        return kind, {}
    return kind, options


def describe_layer(call: Call, module: Any, torch: Any) -> None:
    """Record the call's layer kind in its information, and the options that say it in
    its options when they hide exactly what its mask hides (no mask: what ``is_causal``
    hides)."""
    found = layer_kind(module)
    if found is None or call.skip is not None or "q" not in call.tensors:
        return
    kind, options = found
    call.info["layer_kind"] = kind
    if not options:
        call.info["layer_options"] = "none: sdpa has no option for this kind"
        return
    why = _disagreement(call, options, torch)
    if why is not None:
        call.info["layer_options"] = f"not added: {why}"
        return
    call.options.update(options)
    call.info["layer_options"] = f"added ({_shown(options)}): they hide what the mask hides"


def _shown(options: dict[str, Any]) -> str:
    """``causal, causal-align lower-right, window 3,0`` as flags read."""
    parts = []
    for key, value in options.items():
        flag = key.replace("_", "-")
        if value is True:
            parts.append(flag)
        else:
            text = ",".join(str(x) for x in value) if isinstance(value, list) else str(value)
            parts.append(f"{flag} {text}")
    return ", ".join(parts)


def _disagreement(call: Call, options: dict[str, Any], torch: Any) -> str | None:
    """Why ``options`` would not hide exactly the keys the call's mask hides, or None:
    the keys they leave are the engine's own (:func:`~sdpa_cli.engine.visible.visibility`
    of the case's options), the mask's those it leaves visible (a float mask's
    sentinels hide, as the findings read them)."""
    q, k = call.tensors["q"], call.tensors["k"]
    L, S = int(q.shape[-2]), int(k.shape[-2])
    mask = call.tensors.get("mask")
    if mask is None:
        return "the call has no mask to compare them with"
    if mask.dtype.is_floating_point:
        visible = ~masks.hides(mask.detach().double().cpu().numpy())
    else:
        visible = mask.detach().to(torch.bool).cpu().numpy()
    shape = build_spec(
        np.zeros((L, 1)), np.zeros((S, 1)), np.zeros((S, 1)), options=parse_options(options)
    )
    seen = visibility(shape, (), slice(0, L))
    if visible.shape[-2:] == (L, S) and seen is not None and (visible == seen).all():
        return None
    return "the mask hides other keys as well (padding, or a cache that dropped keys)"


def case_description(call: Call, number: int, layer: int | None) -> str:
    """A recorded call's description in its case: ``call 3, layer 1, sliding window
    layer: torch.nn.functional.scaled_dot_product_attention on cpu, float32, boolean mask``."""
    where = f", layer {layer}" if layer is not None else ""
    if (kind := call.info.get("layer_kind")) is not None:
        where += f", {KINDS.get(kind, kind)} layer"
    mask = call.info["mask"].split(" ")[0]
    return (
        f"call {number}{where}: {call.source} on {call.info['device']}, "
        f"{call.info['dtype']}, {'no' if mask == 'none' else mask} mask"
    )
