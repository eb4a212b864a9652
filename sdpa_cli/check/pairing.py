"""Two runs' calls paired (``sdpa diff``): by name, else by layer, else by order.

A capture names each call by the module it came from and how many times that module
had attended before (``model.layers.3.self_attn``, ``model.layers.3.self_attn#2``):
two runs of one model pair by name, whatever each run left out or added. Another
framework names its modules otherwise; where no name is shared, calls pair by the
layer ``calls.yaml`` records for each (and its occurrence in that layer), and where
neither pairs anything, by order, when both runs made as many calls. Otherwise
nothing pairs: order would be a guess, and a guess would put a divergence where
there is none.

Plain Python: names in, a :class:`Pairing` out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from sdpa_cli.errors import InputError
from sdpa_cli.text import plural

LISTED = 3
"""The calls a message names before ``and N more``."""


@dataclass(frozen=True)
class Pairing:
    """How two runs' calls were paired.

    Attributes:
        pairs: each pair's index in run A's calls and in run B's, in A's order.
        by: what paired them (:data:`~sdpa_cli.names.PAIRINGS`): ``name``, ``layer``
            or ``order``.
        only_a: the calls of run A that pair with none of B's, by name.
        only_b: the calls of run B that pair with none of A's.
    """

    pairs: tuple[tuple[int, int], ...]
    by: str
    only_a: tuple[str, ...] = ()
    only_b: tuple[str, ...] = ()

    def note(self) -> str:
        """``4 calls paired by name``, then the calls of each run left unpaired:
        ``; only in A: model.layers.3.self_attn#2; only in B: none``."""
        text = f"{plural(len(self.pairs), 'call')} paired by {self.by}"
        if self.only_a or self.only_b:
            text += f"; only in A: {listed(self.only_a)}; only in B: {listed(self.only_b)}"
        return text

    def to_dict(self) -> dict[str, object]:
        return {
            "by": self.by,
            "pairs": len(self.pairs),
            "only_a": list(self.only_a),
            "only_b": list(self.only_b),
        }


def listed(names: Sequence[str], most: int = LISTED) -> str:
    """``a, b, c and 4 more``; ``none``."""
    if not names:
        return "none"
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def pair_calls(
    a: Sequence[str],
    b: Sequence[str],
    layers_a: Mapping[str, int] | None = None,
    layers_b: Mapping[str, int] | None = None,
    labels: tuple[str, str] = ("A", "B"),
) -> Pairing:
    """Pair the calls named ``a`` (run A's, in order) with those named ``b``: by name
    where any name is shared; else by layer (``layers_*``: a call's name → its layer,
    from ``calls.yaml``) and occurrence in that layer, where any is shared; else by
    order, when the runs made as many calls.

    Raises:
        InputError: nothing pairs, naming run B's file (``labels``: the runs' files).
    """
    paired = _by_key(a, b, {n: n for n in a}, {n: n for n in b}, "name")
    if paired is None and layers_a and layers_b:
        paired = _by_key(a, b, _layer_keys(a, layers_a), _layer_keys(b, layers_b), "layer")
    if paired is not None:
        return paired
    if len(a) == len(b):
        return Pairing(tuple((i, i) for i in range(len(a))), "order")
    layers = "no layer in common" if layers_a and layers_b else "no layers recorded (calls.yaml)"
    raise InputError(
        labels[1],
        f"no call pairs with those of {labels[0]}: no name in common (A: {listed(a, 2)}; "
        f"B: {listed(b, 2)}), {layers}, and {len(a)} calls against {len(b)}, so that "
        "pairing them in order would be a guess",
    )


def _layer_keys(names: Sequence[str], layers: Mapping[str, int]) -> dict[str, Hashable]:
    """Each call with a layer → (its layer, how many calls of that layer came before
    it): the second call of a layer pairs with the other run's second."""
    seen: Counter[int] = Counter()
    keys: dict[str, Hashable] = {}
    for name in names:
        if name in layers:
            keys[name] = (layers[name], seen[layers[name]])
            seen[layers[name]] += 1
    return keys


def _by_key(
    a: Sequence[str],
    b: Sequence[str],
    keys_a: Mapping[str, Hashable],
    keys_b: Mapping[str, Hashable],
    by: str,
) -> Pairing | None:
    """The calls whose keys are equal paired, in A's order; None when none is."""
    where_b = {keys_b[n]: j for j, n in enumerate(b) if n in keys_b}
    pairs = tuple(
        (i, where_b[keys_a[n]]) for i, n in enumerate(a) if n in keys_a and keys_a[n] in where_b
    )
    if not pairs:
        return None
    used_a = {i for i, _ in pairs}
    used_b = {j for _, j in pairs}
    return Pairing(
        pairs,
        by,
        tuple(n for i, n in enumerate(a) if i not in used_a),
        tuple(n for j, n in enumerate(b) if j not in used_b),
    )
