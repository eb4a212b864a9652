"""Shape validation and option parsing: errors name the tensor or option, expected and got."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from sdpa_cli.engine.options import Options, parse_options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.errors import SpecError


def z(*shape: int, dtype: Any = np.float64) -> NDArray[Any]:
    return np.zeros(shape, dtype=dtype)


def spec_error(q: NDArray[Any], k: NDArray[Any], v: NDArray[Any], **kwargs: Any) -> SpecError:
    with pytest.raises(SpecError) as info:
        build_spec(q, k, v, **kwargs)
    assert str(info.value) == f"{info.value.where}: {info.value.problem}"
    return info.value


# --- shapes ---


def test_key_dim_mismatch_names_k_with_expected_and_got() -> None:
    err = spec_error(z(3, 4), z(5, 3), z(5, 2))
    assert err.where == "K"
    assert "E = 4" in err.problem
    assert "(5, 3)" in err.problem


def test_errors_name_the_file_the_tensor_came_from() -> None:
    err = spec_error(z(3, 4), z(5, 3), z(5, 2), names={"q": "q.npy", "k": "keys.npy"})
    assert err.where == "keys.npy"


def test_value_rows_must_equal_key_rows() -> None:
    err = spec_error(z(3, 4), z(5, 4), z(6, 2))
    assert err.where == "V"
    assert "S = 5" in err.problem
    assert "(6, 2)" in err.problem


def test_kv_heads_must_divide_query_heads() -> None:
    err = spec_error(z(2, 6, 3, 4), z(2, 4, 5, 4), z(2, 4, 5, 2))
    assert err.where == "K"
    assert "6 heads" in err.problem
    assert "K/V have 4" in err.problem


def test_k_and_v_heads_must_agree() -> None:
    err = spec_error(z(2, 6, 3, 4), z(2, 3, 5, 4), z(2, 2, 5, 2))
    assert err.where == "V"
    assert "K has 3 heads but V has 2" in err.problem


def test_leading_axes_must_broadcast() -> None:
    err = spec_error(z(2, 3, 3, 4), z(3, 3, 5, 4), z(3, 3, 5, 2))
    assert "do not broadcast" in err.problem
    assert "(2, 3, 3, 4)" in err.problem
    assert "(3, 3, 5, 4)" in err.problem


@pytest.mark.parametrize("name", ["bias", "mask"])
@pytest.mark.parametrize("shape", [(4, 5), (3, 6), (3, 2, 3, 5), (2, 2, 3, 5)])
def test_bias_and_mask_must_broadcast_to_the_scores(name: str, shape: tuple[int, ...]) -> None:
    err = spec_error(z(2, 3, 3, 4), z(2, 3, 5, 4), z(2, 3, 5, 2), **{name: z(*shape)})
    assert err.where == f"--{name}"
    assert str(shape) in err.problem
    assert "(2, 3, 3, 5)" in err.problem


@pytest.mark.parametrize("shape", [(), (5,), (3, 1), (1, 3, 3, 5), (1, 1, 2, 3, 3, 5)])
def test_bias_and_mask_shapes_that_broadcast_are_accepted(shape: tuple[int, ...]) -> None:
    spec = build_spec(z(2, 3, 3, 4), z(2, 3, 5, 4), z(2, 3, 5, 2), mask=z(*shape, dtype=bool))
    assert spec.mask is not None
    assert spec.mask.ndim == 4


def test_key_lengths_count_must_match_the_batch() -> None:
    err = spec_error(
        z(2, 3, 3, 4), z(2, 3, 5, 4), z(2, 3, 5, 2), options=Options(key_lengths=(1, 2, 3))
    )
    assert err.where == "--key-lengths"
    assert "3 lengths" in err.problem
    assert "2 items" in err.problem


def test_key_lengths_per_item_need_a_batch_axis() -> None:
    err = spec_error(z(3, 3, 4), z(3, 5, 4), z(3, 5, 2), options=Options(key_lengths=(1, 2, 3)))
    assert err.where == "--key-lengths"
    assert "no batch axis" in err.problem


def test_key_lengths_cannot_exceed_the_keys() -> None:
    err = spec_error(z(2, 3, 3, 4), z(2, 3, 5, 4), z(2, 3, 5, 2), options=Options(key_lengths=(6,)))
    assert err.where == "--key-lengths"
    assert "6" in err.problem
    assert "S = 5" in err.problem


@pytest.mark.parametrize(
    ("shapes", "culprit"),
    [
        (((3, 6), (5, 6), (5, 4)), "Q's last axis (6"),
        (((3, 8), (5, 8), (5, 6)), "V's last axis (6"),
    ],
)
def test_heads_must_divide_d_model(shapes: tuple[tuple[int, ...], ...], culprit: str) -> None:
    q, k, v = (z(*s) for s in shapes)
    err = spec_error(q, k, v, options=Options(heads=4))
    assert err.where == "--heads"
    assert culprit in err.problem
    assert "by 4" in err.problem


def test_scalar_and_non_numeric_tensors_are_refused() -> None:
    assert spec_error(z(), z(5, 4), z(5, 2)).where == "Q"
    assert "dtype" in spec_error(z(3, 4, dtype="U1"), z(5, 4), z(5, 2)).problem


def test_mask_true_means_masked_needs_a_boolean_mask() -> None:
    err = spec_error(
        z(3, 4), z(5, 4), z(5, 2), mask=z(3, 5), options=Options(mask_true_means="masked")
    )
    assert err.where == "--mask-true-means"


def test_spec_reads_the_shapes() -> None:
    spec = build_spec(z(2, 6, 3, 4), z(2, 2, 5, 4), z(2, 2, 5, 7))
    assert (spec.lead, spec.L, spec.S, spec.E, spec.Ev, spec.group) == ((2, 6), 3, 5, 4, 7, 3)
    assert spec.scale == pytest.approx(0.5, rel=1e-15)
    assert build_spec(z(3, 4), z(5, 4), z(5, 2), options=Options(scale="dk")).scale == 0.25
    assert build_spec(z(4), z(5, 4), z(5, 2)).weights_shape == (1, 5)


# --- options ---


@pytest.mark.parametrize("name", ["temperature", "scale", "softcap"])
@pytest.mark.parametrize("value", ["nan", math.nan, "inf", math.inf, "-inf", -1, "-0.5", 0, "0"])
def test_positive_options_reject_non_positive_and_non_finite(name: str, value: Any) -> None:
    with pytest.raises(SpecError) as info:
        parse_options({name: value})
    assert info.value.where == "--" + name
    assert repr(value) in info.value.problem or "NaN" in info.value.problem


@pytest.mark.parametrize("value", [1.0, "1", 1.5, "-0.1", -1e-9, "nan", "x", True])
def test_dropout_must_be_in_zero_one(value: Any) -> None:
    with pytest.raises(SpecError) as info:
        parse_options({"dropout": value})
    assert info.value.where == "--dropout"


@pytest.mark.parametrize(
    "value", ["a", "1,2,3", "-1", "1,", ",1", "", "1.5", "2,-1", [1, 2, 3], True]
)
def test_window_garbage_is_refused(value: Any) -> None:
    with pytest.raises(SpecError) as info:
        parse_options({"window": value})
    assert info.value.where == "--window"


@pytest.mark.parametrize("value", [0, "0", "-0", 1, "1e9", "inf", "nan", "finfo-max", "x"])
def test_mask_value_must_be_negative(value: Any) -> None:
    with pytest.raises(SpecError) as info:
        parse_options({"mask_value": value})
    assert info.value.where == "--mask-value"


def test_unknown_option_is_refused_by_its_name() -> None:
    with pytest.raises(SpecError) as info:
        parse_options({"windw": 3}, {"windw": "case.yaml: windw"})
    assert (info.value.where, info.value.problem) == ("case.yaml: windw", "is not an option")


def test_errors_use_the_given_label() -> None:
    with pytest.raises(SpecError) as info:
        parse_options({"temperature": "0"}, {"temperature": "case.yaml: temperature"})
    assert info.value.where == "case.yaml: temperature"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"scale": "sqrt-dk"}, Options(scale="sqrt-dk")),
        ({"scale": "dk"}, Options(scale="dk")),
        ({"scale": " None "}, Options(scale="none")),
        ({"scale": "0.5"}, Options(scale=0.5)),
        ({"mask_value": "-1e9"}, Options(mask_value=-1e9)),
        ({"mask_value": "-inf"}, Options(mask_value=-math.inf)),
        ({"mask_value": "finfo-min"}, Options(mask_value=-1.7976931348623157e308)),
        ({"window": "3"}, Options(window=(3, 3))),
        ({"window": "4,0"}, Options(window=(4, 0))),
        ({"window": [2, 5]}, Options(window=(2, 5))),
        ({"temperature": "0.5", "softcap": 30}, Options(temperature=0.5, softcap=30.0)),
        ({"dropout": "0", "seed": "7"}, Options(dropout=0.0, seed=7)),
        ({"dropout": 0.999}, Options(dropout=0.999)),
        ({"key_lengths": "3, 4"}, Options(key_lengths=(3, 4))),
        (
            {"causal": True, "causal_align": "lower-right"},
            Options(causal=True, causal_align="lower-right"),
        ),
        ({"heads": "8", "alibi": True}, Options(heads=8, alibi=True)),
        ({"causal": None, "window": None}, Options()),
    ],
)
def test_accepted_forms(raw: dict[str, Any], expected: Options) -> None:
    assert parse_options(raw) == expected


# --- formats by their usual aliases ---


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("fp16", "float16"),
        ("half", "float16"),
        ("f16", "float16"),
        ("FP16", "float16"),
        ("torch.float16", "float16"),
        ("bf16", "bfloat16"),
        ("torch.bfloat16", "bfloat16"),
        ("fp32", "float32"),
        ("f32", "float32"),
        ("float", "float32"),  # C's and torch.float
        ("single", "float32"),
        ("fp64", "float64"),
        ("double", "float64"),
        ("fp8_e4m3", "float8_e4m3fn"),
        ("e5m2", "float8_e5m2"),
        ("float16", "float16"),
    ],
)
def test_a_format_is_taken_by_its_usual_alias_and_kept_by_its_name(typed: str, meant: str) -> None:
    assert parse_options({"dtype": typed}).dtype == meant
    assert Options(dtype=typed).dtype == meant  # the Python API, built directly


def test_working_formats_take_aliases_and_same() -> None:
    options = parse_options(
        {"dtype": "bf16", "accumulate": "fp32", "softmax_dtype": "double", "logits_dtype": "same"}
    )
    assert (options.dtype, options.accumulate, options.softmax_dtype, options.logits_dtype) == (
        "bfloat16",
        "float32",
        "float64",
        "bfloat16",
    )
    assert Options(dtype="half", accumulate="half").accumulate == "float16"


def test_an_unknown_format_is_refused_naming_the_formats_not_the_aliases() -> None:
    with pytest.raises(SpecError) as info:
        parse_options({"dtype": "fp12"})
    assert (info.value.where, info.value.problem) == (
        "--dtype",
        "expected one of float64, float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, "
        "got 'fp12'",
    )
    # ml_dtypes' float8_e4m3 (with inf) is another format than e4m3fn: no alias.
    with pytest.raises(SpecError):
        parse_options({"dtype": "float8_e4m3"})


def test_a_working_format_refused_is_quoted_as_typed() -> None:
    with pytest.raises(SpecError) as info:
        parse_options({"dtype": "fp32", "accumulate": "fp16"})
    assert (info.value.where, info.value.problem) == (
        "--accumulate",
        "must be float64, float32 or the --dtype format (float32), got 'fp16'",
    )
