"""``--tokens FILE``: a label for each position, one token a line or JSON."""

from __future__ import annotations

from pathlib import Path

import pytest

from sdpa_cli.errors import InputError
from sdpa_cli.files.tokens import Tokens, read_tokens


def test_one_token_a_line_labels_queries_and_keys_alike(tmp_path: Path) -> None:
    path = tmp_path / "tokens.txt"
    path.write_text("The\n cat\n\nsat\n", encoding="utf-8")  # a blank token is a token
    assert read_tokens(str(path)) == Tokens(("The", " cat", "", "sat"), ("The", " cat", "", "sat"))


def test_json_gives_a_list_or_queries_and_keys_apart(tmp_path: Path) -> None:
    one = tmp_path / "one.json"
    one.write_text('["<s>", "hi"]')
    assert read_tokens(str(one)).keys == ("<s>", "hi")
    two = tmp_path / "two.json"
    two.write_text('{"queries": ["a"], "keys": ["x", "y"]}')
    assert read_tokens(str(two)) == Tokens(("a",), ("x", "y"))


def test_a_cache_s_queries_are_its_last_keys() -> None:
    tokens = Tokens(("a", "b", "c", "d"), ("a", "b", "c", "d"))
    assert tokens.fit(2, 4, "--tokens t").queries == ("c", "d")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"queries": ["a"]}', 'must hold a list of strings, or {"queries": [...], "keys": [...]}'),
        ("[1, 2]", "the list must be a list of strings"),
        ('{"queries": "a", "keys": []}', "queries must be a list of strings"),
    ],
)
def test_a_bad_file_is_one_line_naming_it(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(InputError) as caught:
        read_tokens(str(path))
    assert str(caught.value) == f"--tokens {path}: {problem}"


def test_labels_that_do_not_fit_the_lengths_are_refused() -> None:
    with pytest.raises(
        InputError, match="labels 3 queries and 3 keys; the computation has 4 and 4"
    ):
        Tokens(("a", "b", "c"), ("a", "b", "c")).fit(4, 4, "--tokens t")
