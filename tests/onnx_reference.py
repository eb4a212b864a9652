"""ONNX's reference implementation of its ``Attention`` operator (``onnx.reference``), an
independent witness for the engine's KV-cache offsets and the ``--as onnx`` conventions;
skipped where onnx (or the opset's Attention) is not installed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from sdpa_cli.engine.types import F64


def onnx_attention(opset: int, arrays: dict[str, NDArray[Any]], **attributes: Any) -> F64:
    """Run one ONNX ``Attention`` node through ``onnx.reference.ReferenceEvaluator``."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    order = ("Q", "K", "V", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen")
    names = [n if n in arrays else "" for n in order]
    while names and not names[-1]:
        names.pop()
    outputs = ["Y"]
    if "past_key" in arrays:
        outputs += ["present_key", "present_value"]
    node = helper.make_node("Attention", names, outputs, **attributes)

    def info(name: str, a: NDArray[Any]) -> Any:
        kinds = {np.dtype(np.bool_): TensorProto.BOOL, np.dtype(np.int64): TensorProto.INT64}
        kind = kinds.get(a.dtype, TensorProto.DOUBLE)
        return helper.make_tensor_value_info(name, kind, list(a.shape))

    graph = helper.make_graph(
        [node],
        "attention",
        [info(n, arrays[n]) for n in names if n],
        [helper.make_tensor_value_info(o, TensorProto.DOUBLE, None) for o in outputs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    try:
        session = ReferenceEvaluator(model)
    except Exception as exc:  # an onnx without this opset's Attention
        pytest.skip(f"onnx {onnx.__version__} has no Attention-{opset}: {exc}")
    ran: Any = session.run(None, {n: arrays[n] for n in names if n})
    result: F64 = np.asarray(ran[0], dtype=np.float64)
    return result
