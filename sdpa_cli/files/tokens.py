"""``--tokens FILE``: a label for each position, for the pages' axes and read-outs.

A file is one token a line (a text file), or JSON: a list of strings (the queries'
and the keys' labels alike, as in self-attention) or an object with ``queries`` and
``keys``, each a list (cross-attention, or a cache whose keys precede the queries).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdpa_cli.errors import InputError
from sdpa_cli.files.structured import parse_json, read_text

TOKENS_FILE = "tokens.json"
"""A capture's labels of its positions, beside its manifest (``capture(tokens=...)``):
what ``sdpa report model --html`` labels the patterns with when no ``--tokens`` is
given."""


@dataclass(frozen=True)
class Tokens:
    """The labels of the query positions and of the key positions."""

    queries: tuple[str, ...]
    keys: tuple[str, ...]

    def fit(self, L: int, S: int, label: str) -> Tokens:
        """These labels checked against a computation of ``L`` queries and ``S`` keys:
        self-attention labels (one list) of the keys serve the last ``L`` queries too
        (a cache's queries are its last keys).

        Raises:
            InputError: a count that fits neither.
        """
        queries = self.queries
        if queries == self.keys and len(queries) == S and L < S:
            queries = queries[S - L :]
        if len(queries) != L or len(self.keys) != S:
            raise InputError(
                label,
                f"labels {len(queries)} queries and {len(self.keys)} keys; the computation "
                f"has {L} and {S}",
            )
        return Tokens(queries, self.keys)


def read_tokens(path: str, label: str | None = None) -> Tokens:
    """The labels in ``path`` (see the module's docstring), named ``label`` in messages
    (default ``--tokens PATH``).

    Raises:
        InputError: naming the file: not UTF-8, bad JSON, a label that is not a string.
    """
    label = label or f"--tokens {path}"
    text = read_text(Path(path), "json", label)
    if path.endswith(".json") or text.lstrip().startswith(("[", "{")):
        return _from_json(parse_json(text, label), label)
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the file's final newline ends its last token, not a new one
    return Tokens(tuple(lines), tuple(lines))


def _from_json(data: Any, label: str) -> Tokens:
    if isinstance(data, list):
        one = _strings(data, label, "the list")
        return Tokens(one, one)
    if isinstance(data, dict) and set(data) == {"queries", "keys"}:
        return Tokens(
            _strings(data["queries"], label, "queries"), _strings(data["keys"], label, "keys")
        )
    raise InputError(label, 'must hold a list of strings, or {"queries": [...], "keys": [...]}')


def _strings(items: Any, label: str, what: str) -> tuple[str, ...]:
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise InputError(label, f"{what} must be a list of strings")
    return tuple(items)
