"""For test suites: ``assert_attention_close``, ``sdpa check`` as an assertion.

    from sdpa_cli import assert_attention_close

    out = my_kernel(q, k, v, causal=True)             # numpy arrays or torch tensors
    assert_attention_close(q, k, v, output=out, causal=True)

    out.backward(dout)                                # a backward kernel's gradients
    assert_attention_close(q, k, v, output=out, dout=dout,
                           dq=q.grad, dk=k.grad, dv=v.grad, causal=True)

On failure it raises ``AssertionError`` carrying the same report ``sdpa check``
prints: each failed check, the mismatch counts, the greatest differences with their
full index, and the tolerances that would have passed.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.api.judge import judge
from sdpa_cli.check.records import CheckReport, Expected, failure_lines
from sdpa_cli.check.settings import CheckSettings
from sdpa_cli.diagnosis.findings import Thresholds
from sdpa_cli.engine.arrays import resolve, using
from sdpa_cli.engine.inputs import spec_of
from sdpa_cli.engine.options import OPTION_NAMES, parse_options
from sdpa_cli.names import DESCALES, EXPORTS, GRADIENTS, INPUT_TENSORS, NUMPYLESS
from sdpa_cli.text import plural


def _as_array(x: Any, name: str) -> tuple[NDArray[Any], str]:
    """A numpy array (or a torch tensor, moved to the CPU) and its dtype's name.

    bfloat16 tensors come back as float32 arrays (numpy has no bfloat16 of its own)
    with the name ``bfloat16``, so the check still knows the export's format.
    """
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor, without importing torch
        t = x.detach().cpu()
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype in NUMPYLESS:
            t = t.float()
        return np.asarray(t.numpy()), dtype
    a = np.asarray(x)
    return a, str(a.dtype)


def report_text(report: CheckReport) -> str:
    """A plain-text report: a line per check, the mismatch report under each failure.

    A failure's lines that repeat its summary or an earlier line of its own report
    are left out (a check without a mismatch report restates its summary).
    """
    lines = [
        f"sdpa check: {_verdict(report)} (export {report.export_dtype}, reference {report.reference}):"
    ]
    for c in report.checks:
        lines.append(f"  {c.status.upper():4} {c.name}: {c.summary}")
        if c.status == "fail":
            seen = {c.summary}
            for line in failure_lines(c):
                if line not in seen:
                    seen.add(line)
                    lines.append("         " + line)
    return "\n".join(lines)


def _verdict(report: CheckReport) -> str:
    """``2 of 5 checks failed, output.range and output.close``, or ``all 5 checks
    passed``: a report's first line after ``sdpa check:``."""
    total = plural(len(report.checks), "check")
    if report.passed:
        return f"{'the' if len(report.checks) == 1 else 'all'} {total} passed"
    names = [c.name for c in report.failed]
    return f"{len(names)} of {total} failed, {_listed(names)}"


TENSOR_KEYWORDS = INPUT_TENSORS[5:]
"""The inputs besides Q, K, V, the bias and the mask, taken as keywords beside the
options: ``sinks``, ``segment_ids``, ..., ``block_table`` (K and V as a paged cache's
pages), ``qv``, ``q_descale`` (a number or an array)..."""


def _check_keywords(options: Mapping[str, Any]) -> None:
    """Refuse a keyword that is neither an option, an input nor a setting, as Python
    refuses an unexpected keyword, naming the closest valid one."""
    for name in options:
        if name in OPTION_NAMES or name in TENSOR_KEYWORDS:
            continue
        message = f"assert_attention_close() got an unexpected keyword argument {name!r}"
        close = difflib.get_close_matches(name, _keywords(), n=1)
        if close:
            message += f"; did you mean {close[0]!r}?"
        raise TypeError(message)


def _check_gradients(given: Mapping[str, Any]) -> None:
    """Refuse a gradient without ``dout`` (the loss it is the gradient of is unknown),
    and a ``dout`` with no gradient to judge, as Python refuses a missing argument."""
    grads = [n for n in GRADIENTS if given[n] is not None]
    if grads and given["dout"] is None:
        raise TypeError(
            f"assert_attention_close() got {_listed(grads)} without dout: give dout=, the "
            "gradient of the output the backward kernel was given"
        )
    if given["dout"] is not None and not grads:
        raise TypeError(
            "assert_attention_close() got dout without a gradient to judge: give dq=, dk=, "
            "dv= or dbias=, the gradients the backward kernel computed from it"
        )


def _listed(names: list[str]) -> str:
    """``dq``, ``dq and dk``, ``dq, dk and dv``."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _keywords() -> tuple[str, ...]:
    """Every keyword :func:`assert_attention_close` takes: its settings, read off its
    signature, and the options of the computation."""
    parameters = inspect.signature(assert_attention_close).parameters.values()
    own = tuple(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)
    return own + OPTION_NAMES + TENSOR_KEYWORDS


def assert_attention_close(
    q: Any,
    k: Any,
    v: Any,
    *,
    output: Any = None,
    weights: Any = None,
    lse: Any = None,
    bias: Any = None,
    mask: Any = None,
    dout: Any = None,
    dq: Any = None,
    dk: Any = None,
    dv: Any = None,
    dbias: Any = None,
    dsinks: Any = None,
    rtol: float | None = None,
    atol: float | None = None,
    reference: str | None = None,
    tolerance: str | None = None,
    fudge: float | None = None,
    fail_on: tuple[str, ...] | list[str] | None = None,
    fail_on_severity: str | None = None,
    equal_nan: bool = False,
    thresholds: Thresholds | None = None,
    backend: str = "auto",
    device: str | None = None,
    **options: Any,
) -> CheckReport:
    """Assert that exported attention tensors match a recomputed reference.

    ``softmax(Q·Kᵀ·scale + bias + mask)·V`` is recomputed from ``q``, ``k``, ``v``
    with ``options`` (the options of ``sdpa compute``, as keywords: ``causal=True``,
    ``scale=0.125``, ``key_lengths=[5, 3]``, ``dtype="float16"``...; the inputs of
    :data:`TENSOR_KEYWORDS` too: ``sinks=``, ``block_table=`` for K and V given as a
    paged cache's pages, ``qv=``, ``q_descale=0.02``...) and the given
    ``output`` ``(..., L, Ev)``, ``weights`` ``(..., L, S)`` and ``lse`` ``(..., L)``
    are judged as ``sdpa check`` judges them, by default as ``sdpa check`` does
    (``tolerance=None``: :class:`~sdpa_cli.check.settings.CheckSettings`' default;
    ``"dtype"``, ``"measured"``... as ``--tolerance``); the export's format is its
    dtype (a torch bfloat16 tensor counts as bfloat16).

    A backward kernel's gradients ``dq``, ``dk``, ``dv`` (each shaped as its input:
    ``q.grad``, ``k.grad``, ``v.grad``; ``dbias`` as the bias) of the loss ``Σ O ⊙ dout`` (``dout`` shaped as
    the output, the gradient the kernel was given) are judged as ``sdpa check --dout
    FILE --expect-dq FILE`` judges them (:mod:`~sdpa_cli.check.gradients`), any of
    them, with or without ``output``. One function, not a sibling for gradients: a
    kernel's forward and backward share their inputs and options, ``sdpa check``
    judges both in one run, and one call gives one report of both.

    The reference is computed by ``backend`` on ``device`` (``auto``: torch on the
    tensors' device when ``q``, ``k`` or ``v`` is a torch tensor on a GPU, numpy on the
    host otherwise, the faster on a CPU; ``backend="torch", device="cuda"`` takes numpy
    arrays to the GPU): see
    :mod:`~sdpa_cli.engine.arrays`. The report says which (``report.backend``,
    ``report.device``).

    Returns:
        The report, when every check passed.

    Raises:
        AssertionError: a check failed; the message is the report.
        TypeError: an unknown keyword (before anything is computed), with the closest
            valid one: ``casual`` → ``did you mean 'causal'?``; a gradient without
            ``dout``, or ``dout`` without a gradient.
        SdpaError: the inputs or options are invalid (not a failed check).
    """
    _check_keywords(options)
    given = {"q": q, "k": k, "v": v, "bias": bias, "mask": mask, "dout": dout}
    given |= {"output": output, "weights": weights, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    given |= {"dbias": dbias, "dsinks": dsinks}
    _check_gradients(given)
    computing = resolve(backend, device, (q, k, v))
    arrays: dict[str, NDArray[Any]] = {}
    dtypes: set[str] = set()
    for name, value in given.items():
        if value is not None:
            arrays[name], dtype = _as_array(value, name)
            dtypes.add(dtype)
    raw = {n: value for n, value in options.items() if n not in TENSOR_KEYWORDS}
    inputs = {n: _as_array(value, n)[0] for n, value in options.items() if n in TENSOR_KEYWORDS}
    # with descales, the FP8 inputs' format is the computation's (its output's, bfloat16,
    # is not): the spec takes it from them
    descaled = any(n in inputs for n in DESCALES)
    for narrow in NUMPYLESS:
        if narrow in dtypes and "dtype" not in raw and not descaled:
            raw["dtype"] = narrow  # no numpy dtype says so: the computation's format does
    inputs |= {n: arrays[n] for n in ("q", "k", "v", "bias", "mask") if n in arrays}
    spec = spec_of(inputs, parse_options(raw, {n: n for n in raw}), {n: n for n in inputs})
    # sdpa check's own default tolerance unless one is asked for.
    chosen: dict[str, Any] = {} if tolerance is None else {"tolerance": tolerance}
    settings = CheckSettings(
        rtol=rtol,
        atol=atol,
        reference=reference,
        fudge=fudge,
        fail_on=None if fail_on is None else tuple(fail_on),
        fail_on_severity=fail_on_severity,
        equal_nan=equal_nan,
        **chosen,
    )
    expected = [Expected(n, arrays[n], n) for n in EXPORTS if n in arrays]
    with using(computing):
        report = judge(
            spec, expected, settings, thresholds, dout=arrays.get("dout"), dout_label="dout"
        )
    if not report.passed:
        raise AssertionError(report_text(report))
    return report


__all__ = ["assert_attention_close", "report_text"]
