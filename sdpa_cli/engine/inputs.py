"""Files and flags → what the engine computes with: a validated
:class:`~sdpa_cli.engine.spec.AttentionSpec` (:func:`load_spec`) and the output's
gradient dO (:func:`load_dout`); shared by commands."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from numpy.typing import NDArray

from sdpa_cli.engine.fp8 import read_descale, with_descales
from sdpa_cli.engine.grad import make_dout
from sdpa_cli.engine.options import OPTION_NAMES, Options, parse_options
from sdpa_cli.engine.paged import gather_pages
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.errors import SpecError
from sdpa_cli.files.cases import is_case_file, load_case
from sdpa_cli.files.loaders import Source, load_array
from sdpa_cli.files.opening import is_stdin
from sdpa_cli.names import DESCALES, DOUT_SOURCES, TENSOR_FLAGS
from sdpa_cli.text import printable


def load_spec(
    inputs: tuple[str, ...],
    tensors: Mapping[str, str | None] | None = None,
    flags: Mapping[str, Any] | None = None,
    flag_where: Mapping[str, str] | None = None,
) -> tuple[AttentionSpec, str | None]:
    """Files and flags → a validated spec (and the case file's description, if any).

    One input is a case file; three are Q, K and V. ``tensors`` names the files of
    the other inputs (``bias``, ``mask``, and those of
    :data:`~sdpa_cli.names.TENSOR_FLAGS`), over a case file's; ``flags`` the options
    (name → value as typed, None: not given), over the case file's. ``flag_where``
    names where a flag's value came from (a manifest entry) for messages; by default
    a flag is named by its spelling, ``--causal-align``.
    """
    tensor_paths = {k: v for k, v in (tensors or {}).items() if v is not None}
    flags = flags or {}
    loaded: dict[str, Any] = {}
    names: dict[str, str] = {}
    raw: dict[str, Any] = {}
    where: dict[str, str] = {}
    description = None
    if len(inputs) == 1:
        if not is_case_file(inputs[0]):
            raise SpecError(
                printable(inputs[0]),
                "one input must be a case file (.yaml or .json holding q, k, v); otherwise give Q K V",
            )
        case = load_case(inputs[0], OPTION_NAMES)
        loaded, names, raw, where = (
            dict(case.tensors),
            dict(case.sources),
            dict(case.options),
            dict(case.where),
        )
        description = case.description
    elif len(inputs) == 3:
        for key, path in zip(("q", "k", "v"), inputs, strict=True):
            loaded[key] = load_array(path, name=key)
            names[key] = printable(path)
    else:
        raise SpecError(
            printable(" ".join(inputs)),
            f"expected Q K V (three files) or one case file, got {len(inputs)} inputs",
        )
    for key in ("bias", "mask", *TENSOR_FLAGS):
        if (given := tensor_paths.get(key)) is not None:
            loaded[key] = load_array(given, name=key)
            # bias, mask, the block table and qv by their file; the others by their flag (--sinks)
            by_file = key in ("bias", "mask", "block_table", "qv")
            names[key] = printable(given) if by_file else _flag(key)
    for key in DESCALES:  # --q-descale X|FILE: a number, or a file holding them
        if (given := tensor_paths.get(key)) is not None:
            loaded[key], names[key] = read_descale(given, key)
    for name, value in flags.items():
        if value is not None:
            raw[name] = value
            where.pop(name, None)  # a flag is named by its spelling, --causal-align
            if flag_where and name in flag_where:
                where[name] = flag_where[name]
    return spec_of(loaded, parse_options(raw, where), names), description


def spec_of(arrays: Mapping[str, Any], options: Options, names: Mapping[str, str]) -> AttentionSpec:
    """Arrays by input name (``q``, ``k``, ``v`` and those of
    :data:`~sdpa_cli.names.INPUT_TENSORS` and :data:`~sdpa_cli.names.DESCALES` given)
    and the options → a validated spec: a paged cache's K and V gathered through its
    block table, FP8 values kept with their descales. What :func:`load_spec` builds from
    files, and :func:`~sdpa_cli.testing.assert_attention_close` from arrays."""
    loaded = dict(arrays)
    paging = None
    if (table := loaded.get("block_table")) is not None:  # a paged cache: K, V gathered once
        q_shape = tuple(loaded["q"].shape)
        loaded["k"], loaded["v"], paging = gather_pages(
            loaded["k"], loaded["v"], table, options, names, q_shape
        )
    spec = build_spec(
        loaded["q"],
        loaded["k"],
        loaded["v"],
        bias=loaded.get("bias"),
        mask=loaded.get("mask"),
        options=options,
        names=names,
        sinks=loaded.get("sinks"),
        segment_ids=loaded.get("segment_ids"),
        segment_ids_kv=loaded.get("segment_ids_kv"),
        dropout_mask=loaded.get("dropout_mask"),
        qv=loaded.get("qv"),
    )
    if paging is not None:
        spec = dataclasses.replace(spec, paging=paging)
    return with_descales(spec, loaded, names)  # FP8 values with descales: kept dequantized


def _flag(name: str) -> str:
    """A tensor's flag, as messages name it: ``--segment-ids``."""
    return f"--{name.replace('_', '-')}"


def load_dout(spec: AttentionSpec, dout: str) -> tuple[NDArray[Any], str, dict[str, Any]]:
    """``--dout`` → dO in the engine's layout (:func:`make_dout`); how it reads in a view (a
    label) and in a report (a JSON record).

    ``dout`` is ``ones``, ``random`` (standard normal from ``--seed``) or a file
    shaped like the output.

    Raises:
        SpecError: a word that is neither a file nor a source, or a file whose shape
            is not the output's.
    """
    seed = spec.options.seed
    if dout in DOUT_SOURCES:
        values = make_dout(spec, dout, seed, "--dout")
        info: dict[str, Any] = {"source": dout, "seed": seed if dout == "random" else None}
        label = f"standard normal, seed {seed}" if dout == "random" else "all ones"
        return values, label, info
    path = Source.parse(dout).path
    if not is_stdin(dout) and not path.exists() and not path.suffix:  # a word, not a file
        raise SpecError("--dout", f"expected a file, ones or random, got {dout!r}")
    values = make_dout(spec, load_array(dout, name="dout"), seed, dout)
    return values, dout, {"source": "file", "path": dout}
