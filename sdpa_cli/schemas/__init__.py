"""JSON Schemas (draft 2020-12) of every JSON document sdpa prints or writes, shipped
with the package: ``schema("check")`` is the schema of ``sdpa check --format json``
and of its ``--report``.

Every document starts with ``schema_version`` (:data:`SCHEMA_VERSION`, an integer)
and ``sdpa_version``. The schema version goes up by one when a document changes in a
way that can break a script reading it (a key removed, renamed or retyped, a value's
meaning changed); new keys and new values of open fields (finding kinds, options)
keep it.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

SCHEMA_VERSION = 1
"""The version of every document's shape, written as each document's first key."""

NAMES = (
    "compute",
    "explain",
    "grad",
    "frameworks",
    "check",
    "inspect",
    "report-model",
    "samples",
    "diff",
)
"""One schema per kind of document; ``defs`` holds the parts they share."""


DEFS_REF = "defs.json#/$defs/"
"""How a schema file points into ``defs.json``, the parts the documents share."""


def _read(name: str) -> dict[str, Any]:
    text = resources.files(__name__).joinpath(f"{name}.json").read_text(encoding="utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def _local(node: Any) -> Any:
    """``node`` with every ``defs.json#/$defs/X`` reference made ``#/$defs/X``."""
    if isinstance(node, dict):
        return {
            k: "#/$defs/" + v.removeprefix(DEFS_REF)
            if k == "$ref" and isinstance(v, str) and v.startswith(DEFS_REF)
            else _local(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_local(v) for v in node]
    return node


def schema(name: str) -> dict[str, Any]:
    """The JSON Schema of the documents of ``name`` (one of :data:`NAMES`), whole: the
    shared parts of ``defs.json`` copied into its ``$defs``, so that any validator takes
    it alone (``jsonschema.validate(document, schema("check"))``). The files beside
    this module are the same schemas, pointing into ``defs.json``.

    Raises:
        ValueError: ``name`` is no schema of sdpa's.
    """
    if name not in NAMES:
        raise ValueError(f"no schema {name!r}; the schemas are {', '.join(NAMES)}")
    bundled = _local(_read(name))
    bundled["$defs"] = {**_read("defs")["$defs"], **bundled.get("$defs", {})}
    return bundled  # type: ignore[no-any-return]
