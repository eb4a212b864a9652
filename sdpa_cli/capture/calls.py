"""One attention call, as the kernel got it, in the terms of ``sdpa check``.

Two kinds of kernel are caught (:mod:`~sdpa_cli.capture.hooks`):

- ``torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask,
  dropout_p, is_causal, scale, enable_gqa)``: Q ``(..., H, L, E)``, K ``(..., G, S, E)``,
  V ``(..., G, S, Ev)``, the output ``(..., H, L, Ev)``. ``is_causal`` is upper-left,
  sdpa's ``causal`` (its default alignment); ``scale=None`` is 1/√E, sdpa's default; a
  boolean mask means True = may attend, sdpa's; a float mask is added to the logits,
  as sdpa adds a float ``mask``; ``enable_gqa`` (G < H) is what sdpa does whenever G
  divides H.
- Hugging Face transformers' ``eager_attention_forward(module, query, key, value,
  attention_mask, scaling, dropout, softcap=..., sliding_window=..., ...)``: the same
  Q, K, V (K and V before ``repeat_kv``, which is sdpa's grouped-query reading),
  ``softmax(Q·Kᵀ·scaling [softcapped] + attention_mask)·V`` and the weights; the output
  comes back ``(B, L, H, Ev)`` and is recorded ``(B, H, L, Ev)``. The float mask the
  model built already holds causality, padding and the sliding window
  (``torch.finfo(dtype).min`` where a key is hidden), so it is recorded as it is and no
  causal flag or window is added: the kernel added that mask and nothing else.

Dropout in training draws a random mask no one can replay: such a call is recorded
with the reason it cannot be checked (:attr:`Call.skip`).

For a backward pass (``capture(backward=True)``), a call also names the tensors whose
gradients autograd will compute (:attr:`Call.differentiable`): the output as the kernel
returned it (its gradient is dO) and the inputs Q, K, V (and a mask) that require grad,
the tensors the kernel got, so their gradients are the call's dQ, dK, dV (K and V
before ``repeat_kv``: their gradients summed over each group's query heads).
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

TORCH_SOURCE = "torch.nn.functional.scaled_dot_product_attention"
TORCH_PARAMS = (
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
)
"""torch's SDPA parameters in positional order (a builtin: ``inspect`` cannot read them)."""
EAGER_KNOWN = frozenset(
    {"module", "query", "key", "value", "attention_mask", "scaling", "dropout", "softcap"}
)
"""The eager parameters mapped to sdpa's options; ``sliding_window`` is informational
(the mask already holds the window), any other named parameter given a value (T5's
``position_bias``, gpt-oss's ``sinks``) changes the computation in a way no option says."""
EAGER_INFORMATIONAL = frozenset({"sliding_window"})
_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
GRADIENTS = {"dout": "output", "dq": "q", "dk": "k", "dv": "v", "dmask": "mask"}
"""A gradient a backward pass gives a call → the tensor of :attr:`Call.tensors` it is
shaped as (``dmask``: a float mask that requires grad, a learned bias)."""


@dataclass
class Call:
    """One attention call: its tensors in sdpa's layout, the options that replay it, and
    what a person reads about it.

    Attributes:
        source: the function called, dotted (``torch.nn.functional.scaled_dot_product_attention``).
        tensors: ``q``, ``k``, ``v``, ``mask`` (when given), ``output`` and ``weights``
            (when returned), torch tensors as the kernel got or returned them (on their
            device; the output transposed to ``(..., H, L, Ev)`` where it came otherwise).
        options: sdpa's options by manifest key: ``causal``, ``scale``, ``softcap``.
        info: informational keys (device, dtype, layout, mask kind, dropout, ...).
        skip: why ``sdpa check`` cannot replay the call (dropout in training), or None.
        differentiable: the tensors a backward pass gives a gradient, by the
            gradient's name (:data:`GRADIENTS`): ``dout`` the output as the kernel
            returned it, ``dq``, ``dk``, ``dv``, ``dmask`` the inputs; empty when the
            output does not require grad.
        dout_transposed: the output was recorded transposed (``(B, L, H, Ev)`` →
            ``(B, H, L, Ev)``), and so is dO.
    """

    source: str
    tensors: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    skip: str | None = None
    differentiable: dict[str, Any] = field(default_factory=dict)
    dout_transposed: bool = False


def layer_of(path: str) -> int | None:
    """The layer index a module path names: its first integer part
    (``model.layers.3.self_attn`` → 3, ``transformer.h.0.attn`` → 0), or None."""
    found = _LAYER.search(path)
    return None if found is None else int(found[1])


def dtype_name(tensor: Any) -> str:
    """``bfloat16`` for ``torch.bfloat16``."""
    return str(tensor.dtype).removeprefix("torch.")


def _scale(value: Any, where: str) -> tuple[float | None, str | None]:
    """A kernel's scale (a float, or a 0-d tensor) as sdpa's ``scale``, or why it has none."""
    scale = float(value)
    if not (math.isfinite(scale) and scale > 0):
        return None, f"{where} {scale!r}: sdpa takes a positive finite scale"
    return scale, None


def _mask_info(mask: Any) -> str:
    """How a call's mask reads in calls.yaml; its first word is its kind."""
    if mask is None:
        return "none"
    if mask.dtype.is_floating_point:
        return (
            f"additive ({dtype_name(mask)}, added to the logits; "
            f"torch.finfo({dtype_name(mask)}).min or -inf hides a key)"
        )
    return "boolean (True = may attend)"


def _layout(q: Any, k: Any, output_note: str = "") -> str:
    heads = ""
    if q.dim() >= 3 and k.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        heads = f"; K and V with {k.shape[-3]} heads for Q's {q.shape[-3]} (grouped-query)"
    return f"q, k, v (..., H, L, E){heads}; output (..., H, L, Ev){output_note}"


def from_torch(args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Call:
    """A call of torch's ``scaled_dot_product_attention`` and what it returned."""
    bound = dict(zip(TORCH_PARAMS, args, strict=False))  # fewer positionals than parameters
    bound.update(kwargs)
    q, k, v = bound["query"], bound["key"], bound["value"]
    mask = bound.get("attn_mask")
    dropout = float(bound.get("dropout_p") or 0.0)
    causal = bool(bound.get("is_causal") or False)
    tensors = {"q": q, "k": k, "v": v}
    if mask is not None:
        tensors["mask"] = mask
    tensors["output"] = output
    call = Call(TORCH_SOURCE, tensors)
    if causal:
        call.options["causal"] = True  # PyTorch's is_causal is upper-left, sdpa's default
    if bound.get("scale") is not None:
        scale, call.skip = _scale(bound["scale"], "scale")
        if scale is not None:
            call.options["scale"] = scale
    call.info = {
        "device": str(q.device),
        "dtype": dtype_name(q),
        "layout": _layout(q, k),
        "mask": _mask_info(mask),
        "is_causal": causal,
        "enable_gqa": bool(bound.get("enable_gqa") or False),
        "dropout": dropout,
    }
    if dropout > 0:
        call.skip = f"dropout_p {dropout:g}: its random mask cannot be replayed"
    call.differentiable = differentiable(output, tensors)
    return call


def from_eager(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> Call:
    """A call of a transformers ``eager_attention_forward`` and what it returned
    (``(output (B, L, H, Ev), weights (B, H, L, S))``)."""
    values, parameters = _bind(function, args, kwargs)
    module, q, k, v = values["module"], values["query"], values["key"], values["value"]
    mask = values.get("attention_mask")
    output, weights = (result[0], result[1]) if isinstance(result, tuple) else (result, None)
    training = bool(getattr(module, "training", False))
    dropout = float(values.get("dropout") or 0.0) if training else 0.0
    source = f"{getattr(function, '__module__', '?')}.{getattr(function, '__name__', '?')}"
    tensors = {"q": q, "k": k, "v": v}
    if mask is not None:
        tensors["mask"] = mask
    call = Call(source, tensors)
    reasons = []
    B, H, L = (q.shape[0], q.shape[1], q.shape[2]) if q.dim() == 4 else (0, 0, 0)
    if not hasattr(output, "dim"):
        return Call(source, {}, skip=f"it returned {type(output).__name__}, not a tensor")
    if output.dim() == 4 and tuple(output.shape[:3]) == (B, L, H):
        tensors["output"] = output.transpose(1, 2)
    else:
        tensors["output"] = output
        reasons.append(f"its output has shape {tuple(output.shape)}, not (B, L, H, Ev)")
    if (
        weights is not None
        and hasattr(weights, "shape")
        and tuple(weights.shape) == (B, H, L, k.shape[-2])
        and dropout == 0
    ):
        tensors["weights"] = weights
    if values.get("scaling") is not None:
        scale, problem = _scale(values["scaling"], "scaling")
        if scale is not None:
            call.options["scale"] = scale
        else:
            reasons.append(str(problem))
    if values.get("softcap") is not None:
        call.options["softcap"] = float(values["softcap"])
    if mask is not None and not mask.dtype.is_floating_point:
        reasons.append("it got a boolean mask, which it adds to the logits as 0 or 1")
    for name, p in parameters.items():
        if name in EAGER_KNOWN or name in EAGER_INFORMATIONAL or p.kind is p.VAR_KEYWORD:
            continue
        if values.get(name) is not None and values.get(name) is not p.default:
            reasons.append(f"it takes {name}, which no option of sdpa describes")
    call.info = {
        "device": str(q.device),
        "dtype": dtype_name(q),
        "layout": _layout(q, k, ", transposed from the (B, L, H, Ev) it returns"),
        "mask": _mask_info(mask),
        "module": type(module).__name__,
        "training": training,
        "dropout": dropout,
    }
    if values.get("sliding_window") is not None:
        w = int(values["sliding_window"])
        call.info["sliding_window"] = w
        # transformers' sliding_window_overlay: key j is seen when j > i − w
        call.info["sliding_window_note"] = (
            f"a query sees itself and the {w - 1} keys before it (sdpa: causal, window "
            f"{w - 1},0); the mask holds it"
        )
    if dropout > 0:
        reasons.insert(0, f"dropout {dropout:g} in training: its random mask cannot be replayed")
    call.skip = "; ".join(reasons) or None
    call.differentiable = differentiable(output, tensors)
    call.dout_transposed = tensors["output"] is not output
    return call


def differentiable(output: Any, tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The tensors of a call whose gradients a backward pass gives, by the gradient's
    name (:data:`GRADIENTS`): ``output`` as the kernel returned it, and each input that
    requires grad; none when the output does not (``torch.no_grad``, frozen inputs).

    An input given twice (``q is k``, self-attention on one tensor) is left out: a
    hook on it would see the sum of its gradients as Q and as K.
    """
    if not getattr(output, "requires_grad", False):
        return {}
    found = {"dout": output}
    inputs = [tensors[n] for n in ("q", "k", "v", "mask") if n in tensors]
    for name, key in GRADIENTS.items():
        tensor = tensors.get(key) if key != "output" else None
        if tensor is None or not getattr(tensor, "requires_grad", False):
            continue
        if sum(t is tensor for t in inputs) == 1:
            found[name] = tensor
    return found


EAGER_ORDER = ("module", "query", "key", "value", "attention_mask")
"""How every transformers eager attention takes its first arguments."""
_SIGNATURES: dict[Any, inspect.Signature] = {}


def _bind(
    function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[dict[str, Any], Mapping[str, inspect.Parameter]]:
    """An eager call's arguments by name (``**kwargs`` flattened, defaults filled in),
    and the function's named parameters; by transformers' order when the function's
    signature does not name them (a wrapper taking ``*args, **kwargs``)."""
    signature = _SIGNATURES.get(function)
    try:
        if signature is None:
            signature = _SIGNATURES[function] = inspect.signature(function)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        signature = None
    else:
        bound.apply_defaults()
        values = dict(bound.arguments)
        for name, p in signature.parameters.items():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                values.update(values.pop(name, {}))
        if all(n in values for n in EAGER_ORDER[:4]):
            return values, signature.parameters
    values = dict(zip(EAGER_ORDER, args, strict=False))
    values.update(kwargs)
    return values, {}
