"""sdpa: numerical inspection of scaled dot-product attention.

``softmax(Q Kᵀ · scale + bias + mask) · V``, computed stage by stage in float64.
Kept free of heavy imports so that ``sdpa --help`` starts instantly: the public
API below is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

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
    "AttentionSpec": "sdpa_cli.spec",
    "build_spec": "sdpa_cli.spec",
    "Trace": "sdpa_cli.compute",
    "trace": "sdpa_cli.compute",
    "load_array": "sdpa_cli.loaders",
    "diagnose": "sdpa_cli.diagnose",
    "Diagnosis": "sdpa_cli.diagnose",
    "Finding": "sdpa_cli.diagnose",
    "Thresholds": "sdpa_cli.diagnose",
    "assert_attention_close": "sdpa_cli.testing",
    "SdpaError": "sdpa_cli.errors",
    "InputError": "sdpa_cli.errors",
    "SpecError": "sdpa_cli.errors",
}

if TYPE_CHECKING:
    from sdpa_cli.compute import Trace, trace
    from sdpa_cli.diagnose import Diagnosis, Finding, Thresholds, diagnose
    from sdpa_cli.errors import InputError, SdpaError, SpecError
    from sdpa_cli.loaders import load_array
    from sdpa_cli.spec import AttentionSpec, build_spec
    from sdpa_cli.testing import assert_attention_close


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sdpa_cli' has no attribute {name!r}")
