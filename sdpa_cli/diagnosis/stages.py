"""The stages of attention, forward and backward, and the formula of each: the one
table that every view of them (``compute``, ``explain``, ``grad``, the plots) reads.

Forward stages are the engine's (:data:`~sdpa_cli.engine.block.STAGES`), each with a
title. Backward stages are ``explain --backward``'s, in the order the gradient flows
(``d_scaled`` only with a softcap, ``d_bias`` only with a bias), titled by their names;
their values' shapes::

    d_output  dO                              (rows, Ev)
    d_weights dA = dO · Vᵀ                    (rows, S)
    d_scores  dS = A ⊙ (dA − Σ A ⊙ dA)        (rows, S)
    d_scaled  dS ⊙ (1 − tanh²(scaled / C))    (rows, S)
    d_query   dQ = dS · K · scale             (rows, E)
    d_key     dK = dSᵀ · Q · scale            (S, E)   the whole kv head, every row
    d_value   dV = Aᵀ · dO                    (S, Ev)  the whole kv head, every row
    d_bias    d(bias) = dS                    (rows, S)
"""

from __future__ import annotations

TITLES = {
    "raw": "raw scores",
    "scaled": "scaled scores",
    "capped": "soft-capped",
    "biased": "biased",
    "masked": "masked logits",
    "weights": "weights",
    "dropped": "after dropout",
    "output": "output",
}
"""Forward stage → its title."""

FORMULAS = {
    "raw": "Q·Kᵀ",
    "scaled": "raw · scale / temperature",
    "capped": "C · tanh(scaled / C)",
    "biased": "+ bias / ALiBi",
    "masked": "hidden keys set to the mask value",
    "weights": "softmax over keys",
    "dropped": "kept weights / (1 − p)",
    "output": "weights · V",
    "d_output": "dO",
    "d_weights": "dA = dO · Vᵀ",
    "d_scores": "dS = A ⊙ (dA − Σ A ⊙ dA)",
    "d_scaled": "dS ⊙ (1 − tanh²(scaled / C))",
    "d_query": "dQ = dS · K · scale",
    "d_key": "dK = dSᵀ · Q · scale",
    "d_value": "dV = Aᵀ · dO",
    "d_bias": "d(bias) = dS",
}
"""Every stage, forward then backward, → its formula."""

BACKWARD_STAGES = tuple(s for s in FORMULAS if s not in TITLES)
"""The backward stages, in the order the gradient flows."""

GRADIENT_STAGE = {"dq": "d_query", "dk": "d_key", "dv": "d_value", "dbias": "d_bias"}
"""A gradient (as ``sdpa grad`` and its findings name it) → its backward stage."""


def gradient_formula(name: str) -> str:
    """The right side of a gradient's formula: ``dS · K · scale`` for ``dq``."""
    return FORMULAS[GRADIENT_STAGE[name]].partition(" = ")[2]
