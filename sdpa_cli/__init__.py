"""sdpa: numerical inspection of scaled dot-product attention.

``softmax(Q Kᵀ · scale + bias + mask) · V``, computed stage by stage in float64.
Kept free of heavy imports so that ``sdpa --help`` starts instantly: the public
API below is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sdpa_cli._version import __version__

__all__ = [
    "AttentionSpec",
    "Diagnosis",
    "Finding",
    "InputError",
    "SdpaError",
    "SpecError",
    "Thresholds",
    "Trace",
    "__version__",
    "assert_attention_close",
    "build_spec",
    "diagnose",
    "load_array",
    "trace",
]

_LAZY = {
    "AttentionSpec": "sdpa_cli.engine.spec",
    "build_spec": "sdpa_cli.engine.spec",
    "Trace": "sdpa_cli.engine.trace",
    "trace": "sdpa_cli.engine.trace",
    "load_array": "sdpa_cli.files.loaders",
    "diagnose": "sdpa_cli.diagnosis.rules",
    "Diagnosis": "sdpa_cli.diagnosis.findings",
    "Finding": "sdpa_cli.diagnosis.findings",
    "Thresholds": "sdpa_cli.diagnosis.findings",
    "assert_attention_close": "sdpa_cli.testing",
    "SdpaError": "sdpa_cli.errors",
    "InputError": "sdpa_cli.errors",
    "SpecError": "sdpa_cli.errors",
}

if TYPE_CHECKING:
    from sdpa_cli.diagnosis.findings import Diagnosis, Finding, Thresholds
    from sdpa_cli.diagnosis.rules import diagnose
    from sdpa_cli.engine.spec import AttentionSpec, build_spec
    from sdpa_cli.engine.trace import Trace, trace
    from sdpa_cli.errors import InputError, SdpaError, SpecError
    from sdpa_cli.files.loaders import load_array
    from sdpa_cli.testing import assert_attention_close


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sdpa_cli' has no attribute {name!r}")
