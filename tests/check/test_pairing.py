"""check/pairing.py: two runs' calls paired by name, else by layer, else by order;
a different number of calls survives with the unpaired calls named; nothing that
pairs is refused in one line naming run B."""

from __future__ import annotations

import pytest

from sdpa_cli.check.pairing import Pairing, listed, pair_calls
from sdpa_cli.errors import InputError

LAYERS = [f"model.layers.{i}.self_attn" for i in range(4)]


def test_the_same_calls_pair_by_name_in_a_s_order() -> None:
    pairing = pair_calls(LAYERS, list(reversed(LAYERS)))
    assert pairing == Pairing(((0, 3), (1, 2), (2, 1), (3, 0)), "name")
    assert pairing.note() == "4 calls paired by name"


def test_a_run_with_fewer_calls_pairs_what_it_has_and_names_the_rest() -> None:
    """A framework that fuses two layers' calls, or records one more decode step."""
    a = [*LAYERS, "model.layers.3.self_attn#2"]
    b = [LAYERS[0], LAYERS[2], LAYERS[3], "model.layers.4.self_attn"]
    pairing = pair_calls(a, b)
    assert pairing.pairs == ((0, 0), (2, 1), (3, 2))
    assert pairing.only_a == ("model.layers.1.self_attn", "model.layers.3.self_attn#2")
    assert pairing.only_b == ("model.layers.4.self_attn",)
    assert pairing.note() == (
        "3 calls paired by name; only in A: model.layers.1.self_attn, "
        "model.layers.3.self_attn#2; only in B: model.layers.4.self_attn"
    )
    assert pairing.to_dict() == {
        "by": "name",
        "pairs": 3,
        "only_a": ["model.layers.1.self_attn", "model.layers.3.self_attn#2"],
        "only_b": ["model.layers.4.self_attn"],
    }


def test_another_framework_s_names_pair_by_layer_and_occurrence() -> None:
    a = ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.1.self_attn#2"]
    b = ["blocks_0_attn", "blocks_1_attn", "blocks_1_attn_again", "blocks_2_attn"]
    layers_a = {a[0]: 0, a[1]: 1, a[2]: 1}
    layers_b = {b[0]: 0, b[1]: 1, b[2]: 1, b[3]: 2}
    pairing = pair_calls(a, b, layers_a, layers_b)
    assert (pairing.by, pairing.pairs) == ("layer", ((0, 0), (1, 1), (2, 2)))
    assert (pairing.only_a, pairing.only_b) == ((), ("blocks_2_attn",))


def test_names_in_common_win_over_layers() -> None:
    pairing = pair_calls(LAYERS[:2], LAYERS[1:], {LAYERS[0]: 1}, {LAYERS[1]: 1})
    assert (pairing.by, pairing.pairs) == ("name", ((1, 0),))


def test_nothing_in_common_pairs_in_order_when_the_counts_agree() -> None:
    pairing = pair_calls(["call-1", "call-2"], ["attn_a", "attn_b"])
    assert pairing == Pairing(((0, 0), (1, 1)), "order")
    assert pairing.note() == "2 calls paired by order"


def test_nothing_that_pairs_is_refused_in_one_line_naming_run_b() -> None:
    with pytest.raises(InputError) as caught:
        pair_calls(["call-1", "call-2", "call-3"], ["attn_a"], labels=("a.yaml", "b.yaml"))
    message = str(caught.value)
    assert "\n" not in message
    assert message == (
        "b.yaml: no call pairs with those of a.yaml: no name in common (A: call-1, call-2 "
        "and 1 more; B: attn_a), no layers recorded (calls.yaml), and 3 calls against 1, "
        "so that pairing them in order would be a guess"
    )


def test_layers_that_share_nothing_are_said_so() -> None:
    with pytest.raises(InputError, match="no layer in common"):
        pair_calls(["x"], ["y", "z"], {"x": 0}, {"y": 1, "z": 2})


def test_listed_names_a_few_and_counts_the_rest() -> None:
    assert listed([]) == "none"
    assert listed(["a", "b", "c"]) == "a, b, c"
    assert listed(["a", "b", "c", "d", "e"]) == "a, b, c and 2 more"
