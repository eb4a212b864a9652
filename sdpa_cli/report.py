"""Trace → machine-readable payloads: JSON, YAML and .npz.

JSON has no infinities or NaN, so non-finite numbers are written as the strings
``"Infinity"``, ``"-Infinity"`` and ``"NaN"`` (the convention of Protocol Buffers'
JSON mapping); YAML writes them natively (``.inf``, ``-.inf``, ``.nan``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, BinaryIO

import numpy as np
from numpy.typing import NDArray

from sdpa_cli import __version__
from sdpa_cli.compute import STAGES, Trace, applicable_stages
from sdpa_cli.diagnose import Diagnosis
from sdpa_cli.loaders import write_atomic


def _json_number(x: float) -> float | str:
    if math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def _nested(a: NDArray[Any], for_json: bool) -> Any:
    lists = a.tolist()
    if not for_json or a.dtype == np.bool_ or bool(np.isfinite(a).all()):
        return lists

    def fix(node: Any) -> Any:
        return [fix(n) for n in node] if isinstance(node, list) else _json_number(node)

    return fix(lists)


def payload(
    trace: Trace, stages: tuple[str, ...], diagnosis: Diagnosis | None = None, *, for_json: bool
) -> dict[str, Any]:
    """The ``--format json|yaml`` object: shapes, scale, options, stages, findings."""
    spec = trace.spec
    o = spec.options
    shapes: dict[str, list[int]] = {n: list(s) for n, s in spec.shapes.items()}
    shapes["weights"] = list(spec.weights_shape)
    shapes["output"] = list(spec.merged_output_shape)
    data: dict[str, Any] = {
        "sdpa_version": __version__,
        "shapes": shapes,
        "scale": spec.scale,
        "scale_rule": o.scale if isinstance(o.scale, str) else "given",
        "temperature": o.temperature,
        "options": {
            "softcap": o.softcap,
            "alibi": o.alibi,
            "causal": o.causal,
            "causal_align": o.causal_align,
            "window": list(o.window) if o.window else None,
            "key_lengths": list(o.key_lengths) if o.key_lengths else None,
            "mask_true_means": o.mask_true_means,
            "mask_value": _json_number(o.mask_value) if for_json else o.mask_value,
            "dropout": o.dropout,
            "seed": o.seed,
            "heads": o.heads,
            "group": spec.group,
            "dtype": o.dtype,
            "accumulate": o.accumulate,
            "softmax_dtype": o.softmax_dtype,
            "logits_dtype": o.logits_dtype,
            "prescale": o.prescale,
        },
        "stages": [s for s in applicable_stages(spec) if s in stages],
    }
    for name in data["stages"]:
        arr = trace.merged_output if name == "output" else trace.stage(name)
        if arr is not None:
            data[name] = _nested(arr, for_json)
    if not trace.visible.all():
        data["visible"] = trace.visible.tolist()
    data.update(diagnosis_payload(diagnosis, for_json=for_json) if diagnosis else {"findings": []})
    return data


def _clean(value: Any, for_json: bool) -> Any:
    """Non-finite floats as JSON strings (or kept for YAML), recursively."""
    if isinstance(value, float):
        return _json_number(value) if for_json else value
    if isinstance(value, dict):
        return {k: _clean(v, for_json) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v, for_json) for v in value]
    if isinstance(value, np.generic):
        return _clean(value.item(), for_json)
    return value


def diagnosis_payload(diagnosis: Diagnosis, *, for_json: bool) -> dict[str, Any]:
    """``findings`` (the contract), their full counts, per-head summaries, precision."""
    out: dict[str, Any] = {
        "findings": [f.to_dict() for f in diagnosis.findings],
        "finding_counts": dict(diagnosis.counts),
        "findings_truncated": diagnosis.truncated,
        "thresholds": dataclasses.asdict(diagnosis.thresholds),
        "heads": [h.to_dict() for h in diagnosis.heads],
        "headroom_bits": {d: dict(per) for d, per in diagnosis.headroom.items()},
        "emulation": diagnosis.emulation.to_dict() if diagnosis.emulation else None,
    }
    return _clean(out, for_json)  # type: ignore[no-any-return]


def to_json(data: dict[str, Any]) -> str:
    return json.dumps(data, allow_nan=False)


def to_yaml(data: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100)


def save_npz(trace: Trace, path: str) -> None:
    """Write every computed stage (full shape) and ``visible`` to ``path``, atomically."""
    arrays: dict[str, NDArray[Any]] = {}
    for name in STAGES:
        arr = trace.merged_output if name == "output" else trace.stage(name)
        if arr is not None:
            arrays[name] = arr
    arrays["visible"] = trace.visible

    def write(fh: BinaryIO) -> None:
        np.savez(fh, **arrays)  # type: ignore[arg-type]

    write_atomic(path, write)
