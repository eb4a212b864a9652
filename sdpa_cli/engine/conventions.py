"""What each framework does where attention's definition leaves a choice (``--as``).

Five frameworks compute the same formula and still disagree on four things a case can
reach: where the causal diagonal sits when L ≠ S, whether a sliding window's size
counts the query itself, the value hidden logits take, and so what a row with no
visible key gives. Each framework is one frozen :class:`Convention` in
:data:`CONVENTIONS`, the one place these facts live; ``--as NAME`` turns its values
into defaults that explicit flags override (``engine/options.py``).

What each record says, checked against the framework's own code:

- ``torch``: ``scaled_dot_product_attention(is_causal=True)`` puts the diagonal at the
  top left (``tril`` over (L, S)); hidden logits are −inf; PyTorch ≥ 2.5 gives a row
  with no visible key zeros (its safe softmax). No window argument: a window is a
  mask, read as the engine's ``--window``.
- ``flash``: FlashAttention ≥ 2.1 puts it at the bottom right of each item's own
  lengths (the queries are the last of the item's keys: ``seqused_k``,
  ``cache_seqlens``, varlen's lengths; S − L without them); ``window_size=(left,
  right)`` leaves the query itself out (key j visible when i + S_b − L_b − left ≤ j ≤
  i + S_b − L_b + right); −inf; zeros.
- ``jax``: ``jax.nn.dot_product_attention`` masks with ``tril`` (top left) and
  ``local_window_size=(left, right)`` counted as FlashAttention's; hidden logits take
  −0.7·finfo(float32).max (``_get_large_negative``, capped at float32's range), so a
  row with no visible key is uniform: the mean of V.
- ``onnx``: ONNX ``Attention`` places the diagonal at the past length (the keys read
  as ``past_key`` followed by the new keys: S − L, bottom right; with opset 24's
  ``nonpad_kv_seqlen`` each item's own, its valid keys less L);
  ``left_window_size`` leaves the query out; −inf; zeros (its reference softmax).
- ``hf``: Hugging Face's ``eager_attention_forward`` with the masks of
  ``masking_utils``: causal through the cache positions (bottom right);
  ``sliding_window=W`` shows keys i − W < j ≤ i, W keys with the query's own (LEFT =
  W − 1 in ``--window``'s terms); hidden logits get ``torch.finfo(dtype).min``, so a
  row with no visible key is the mean of V.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sdpa_cli.errors import SpecError
from sdpa_cli.names import FRAMEWORKS
from sdpa_cli.text import shown

FLOAT32_MAX = 3.4028234663852886e38
"""float32's largest number, (2 − 2⁻²³)·2¹²⁷, written out: the command line reads this
module for ``--as``'s help without loading numpy (a test holds it to numpy's)."""

JAX_MASK_VALUE = -0.7 * FLOAT32_MAX
"""JAX's large negative: −0.7 of float32's largest number, so that it stays finite in
float32 (where JAX's softmax always runs) while exp(it − max) is still 0."""


@dataclass(frozen=True)
class Convention:
    """One framework's choices.

    Attributes:
        name: the ``--as`` value (``flash``).
        title: the framework and function, as its users call it.
        causal_align: ``upper-left``, ``lower-right`` or ``lower-right-per-item``
            (``--causal-align``).
        mask_value: the hidden logits' value, as ``--mask-value`` takes it
            (``-inf``, ``finfo-min`` or a number).
        window_counts_query: whether the framework's window size counts the query
            itself (Hugging Face's ``sliding_window``): LEFT keys before the query
            in its terms are LEFT − 1 in ``--window``'s.
        float32_logits: whether the framework's logits are at least float32 whatever
            the inputs' format (JAX's ``promote_types(query.dtype, float32)``): its
            mask value is never stored in a 16-bit format.
    """

    name: str
    title: str
    causal_align: str
    mask_value: str
    window_counts_query: bool = False
    float32_logits: bool = False

    @property
    def empty_row(self) -> str:
        """What a row with no visible key gives: zeros under −inf (a safe softmax),
        the mean of V under a finite mask value (every logit equal: uniform weights)."""
        return "zeros" if self.mask_value == "-inf" else "mean of V"

    def defaults(self) -> dict[str, str]:
        """The options ``--as`` sets where no flag does, as their flags take them."""
        return {"causal_align": self.causal_align, "mask_value": self.mask_value}

    @property
    def mask_label(self) -> str:
        """The mask value as people write it: ``−0.7·finfo(float32).max`` for JAX's."""
        return (
            "−0.7·finfo(float32).max"
            if self.mask_value == repr(JAX_MASK_VALUE)
            else self.mask_value
        )

    @property
    def window_label(self) -> str:
        return "counts the query" if self.window_counts_query else "query left out"

    def window(self, given: tuple[int, int], where: str = "--window") -> tuple[int, int]:
        """``(LEFT, RIGHT)`` in this framework's terms → in ``--window``'s (the query
        left out): Hugging Face's ``sliding_window=W`` is W − 1 keys before the query."""
        left, right = given
        if not self.window_counts_query:
            return given
        if left < 1:
            raise SpecError(
                where,
                f"{self.name}'s sliding window counts the query itself: must be ≥ 1, got {left}",
            )
        return left - 1, right


CONVENTIONS: Mapping[str, Convention] = {
    c.name: c
    for c in (
        Convention("torch", "PyTorch scaled_dot_product_attention", "upper-left", "-inf"),
        Convention("flash", "FlashAttention ≥ 2.1 flash_attn_func", "lower-right-per-item", "-inf"),
        Convention(
            "jax",
            "JAX nn.dot_product_attention",
            "upper-left",
            repr(JAX_MASK_VALUE),
            float32_logits=True,
        ),
        Convention("onnx", "ONNX Attention (past cache)", "lower-right-per-item", "-inf"),
        Convention(
            "hf",
            "Hugging Face eager_attention_forward",
            "lower-right",
            "finfo-min",
            window_counts_query=True,
        ),
    )
}
"""One record for each framework of :data:`~sdpa_cli.names.FRAMEWORKS`, in its order
(``tests/engine/test_conventions.py`` holds the two the same)."""


def convention(name: Any, where: str = "--as") -> Convention:
    """The convention named ``name``; a name not in :data:`FRAMEWORKS` is refused."""
    if isinstance(name, str) and name.strip().lower() in CONVENTIONS:
        return CONVENTIONS[name.strip().lower()]
    raise SpecError(where, f"expected one of {', '.join(FRAMEWORKS)}, got {shown(name)}")
