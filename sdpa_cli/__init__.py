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
    "AttentionSpec": "sdpa_cli.engine.spec",
    "build_spec": "sdpa_cli.engine.spec",
    "Trace": "sdpa_cli.engine.block",
    "trace": "sdpa_cli.engine.block",
    "load_array": "sdpa_cli.files.loaders",
    "diagnose": "sdpa_cli.diagnose.rules",
    "Diagnosis": "sdpa_cli.diagnose.rules",
    "Finding": "sdpa_cli.diagnose.rules",
    "Thresholds": "sdpa_cli.diagnose.rules",
    "assert_attention_close": "sdpa_cli.testing",
    "SdpaError": "sdpa_cli.errors",
    "InputError": "sdpa_cli.errors",
    "SpecError": "sdpa_cli.errors",
}

if TYPE_CHECKING:
    from sdpa_cli.diagnose.rules import Diagnosis, Finding, Thresholds, diagnose
    from sdpa_cli.engine.block import Trace, trace
    from sdpa_cli.engine.spec import AttentionSpec, build_spec
    from sdpa_cli.errors import InputError, SdpaError, SpecError
    from sdpa_cli.files.loaders import load_array
    from sdpa_cli.testing import assert_attention_close


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sdpa_cli' has no attribute {name!r}")
