"""The glossary (docs/reference/glossary.md) defines every technical term the docs'
examples print: a term of :data:`JARGON` that any shown output uses must be one of the
glossary's entries. JARGON is the list of terms a newcomer may not know, kept with the
outputs: each must still appear in some output, so that a term dropped from them is
dropped here too, and a new one is added with its definition."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_docs import console_examples

ROOT = Path(__file__).resolve().parent.parent
GLOSSARY = ROOT / "docs" / "reference" / "glossary.md"

JARGON = (
    "scale",
    "logits",
    "mask value",
    "visible keys",
    "weights",
    "LSE",
    "entropy",
    "saturated",
    "one-hot",
    "fully masked",
    "attention sink",
    "dead head",
    "overflow",
    "non-finite",
    "flush to zero",
    "headroom",
    "1−Σw²",
    "vanishing",
    "reference",
    "plain computation",
    "ulp",
    "fudge",
    "not rounding",
    "RMS error",
    "mismatched elements",
    "unit roundoff",
    "first divergence",
    "upstream of attention",
    "in the kernel",
)


def entries() -> set[str]:
    """The glossary's terms: every name in bold (an entry's, or one it defines)."""
    text = GLOSSARY.read_text(encoding="utf-8")
    return {n.lower() for n in re.findall(r"\*\*(.+?)\*\*", text)}


def shown_outputs() -> str:
    return "\n".join(e.expected for e in console_examples()).lower()


def defined(term: str, names: set[str]) -> bool:
    """``term`` is an entry, or the start of one (``passing rtol`` of ``passing rtol / atol``)."""
    t = term.lower()
    return any(name == t or name.startswith(t) or t in name.split(", ") for name in names)


@pytest.mark.parametrize("term", JARGON)
def test_every_term_the_outputs_use_is_defined(term: str) -> None:
    assert defined(term, entries()), f"the glossary lacks {term!r}"


def test_every_listed_term_is_still_printed() -> None:
    outputs = shown_outputs()
    assert [t for t in JARGON if t.lower() not in outputs] == []
