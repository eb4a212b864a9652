"""FlexAttention-style modifications: ``--score-mod`` and ``--mask-mod`` expressions.

An expression is written over ``score`` (score-mod only), ``b``, ``h`` (the batch and
head indices), ``q_idx`` and ``kv_idx`` (query and key positions), as PyTorch's
``flex_attention`` passes them to ``score_mod(score, b, h, q_idx, kv_idx)`` and
``mask_mod(b, h, q_idx, kv_idx)``. The text is parsed with :mod:`ast` into a small tree
of allowed nodes (numbers, those names, + - * / // % **, unary -, comparisons,
and/or/not, calls to :data:`FUNCTIONS`); anything else is refused, naming the token.
The user's text is never compiled or evaluated by Python: the tree is walked here,
with numpy, over a block's broadcast index grids (q_idx a (rows, 1) column, kv_idx a
(1, keys) row), so one evaluation gives the whole (rows, keys) block.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.errors import SpecError
from sdpa_cli.text import shown

SCORE_NAMES = ("score", "b", "h", "q_idx", "kv_idx")
MASK_NAMES = ("b", "h", "q_idx", "kv_idx")

FUNCTIONS: dict[str, tuple[int, Callable[..., Any]]] = {
    "where": (3, lambda c, a, b: np.where(np.asarray(c) != 0, a, b)),
    "abs": (1, np.abs),
    "tanh": (1, np.tanh),
    "exp": (1, np.exp),
    "log": (1, np.log),
    "sqrt": (1, np.sqrt),
    "minimum": (2, np.minimum),
    "maximum": (2, np.maximum),
}
"""The functions an expression may call: name → (number of arguments, numpy function)."""

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: np.add,
    ast.Sub: np.subtract,
    ast.Mult: np.multiply,
    ast.Div: np.true_divide,
    ast.FloorDiv: np.floor_divide,
    ast.Mod: np.mod,
    ast.Pow: np.power,
}
_COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], Any]] = {
    ast.Lt: np.less,
    ast.LtE: np.less_equal,
    ast.Gt: np.greater,
    ast.GtE: np.greater_equal,
    ast.Eq: np.equal,
    ast.NotEq: np.not_equal,
}
_WHAT = {
    ast.Attribute: "attribute access",
    ast.Subscript: "subscripting",
    ast.Lambda: "lambda",
    ast.Starred: "unpacking",
    ast.IfExp: "'x if c else y' (use where(c, x, y))",
    ast.MatMult: "the @ operator",
}


@dataclass(frozen=True)
class Num:
    value: float


@dataclass(frozen=True)
class Var:
    name: str


@dataclass(frozen=True)
class Op:
    """An operator or function applied to its operands (``fn`` a numpy function)."""

    fn: Callable[..., Any]
    args: tuple[Node, ...]


Node = Num | Var | Op


def _and(*xs: Any) -> Any:
    return functools.reduce(np.logical_and, (np.asarray(x) != 0 for x in xs))


def _or(*xs: Any) -> Any:
    return functools.reduce(np.logical_or, (np.asarray(x) != 0 for x in xs))


def _not(x: Any) -> Any:
    return np.asarray(x) == 0


class _Parser:
    def __init__(self, text: str, flag: str, names: tuple[str, ...]) -> None:
        self.text, self.flag, self.names = text, flag, names

    def refuse(self, node: ast.AST, why: str, column: int | None = None) -> SpecError:
        segment = ast.get_source_segment(self.text, node) or type(node).__name__
        col = getattr(node, "col_offset", 0) if column is None else column
        return SpecError(self.flag, f"{shown(segment)} at column {col + 1}: {why}")

    def node(self, n: ast.AST) -> Node:
        if isinstance(n, ast.Constant):
            v = n.value
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise self.refuse(n, "only numbers are allowed as constants")
            try:
                return Num(float(v))
            except OverflowError:  # an integer beyond float64: as far as a float goes
                return Num(float("inf"))
        if isinstance(n, ast.Name):
            if n.id not in self.names:
                allowed = ", ".join(self.names)
                hint = " (call it)" if n.id in FUNCTIONS else ""
                raise self.refuse(n, f"unknown name{hint}; allowed: {allowed}")
            return Var(n.id)
        if isinstance(n, ast.BinOp) and type(n.op) in _BINARY:
            return Op(_BINARY[type(n.op)], (self.node(n.left), self.node(n.right)))
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd, ast.Not)):
            operand = self.node(n.operand)
            if isinstance(n.op, ast.UAdd):
                return operand
            return Op(np.negative if isinstance(n.op, ast.USub) else _not, (operand,))
        if isinstance(n, ast.BoolOp):
            fn = _and if isinstance(n.op, ast.And) else _or
            return Op(fn, tuple(self.node(v) for v in n.values))
        if isinstance(n, ast.Compare):
            return self.compare(n)
        if isinstance(n, ast.Call):
            return self.call(n)
        if isinstance(n, ast.Attribute):  # point at the dot
            end = getattr(n.value, "end_col_offset", None)
            raise self.refuse(n, "attribute access is not allowed", end)
        what = _WHAT.get(type(n)) or _WHAT.get(type(getattr(n, "op", None)))
        raise self.refuse(n, f"{what or type(n).__name__ + ' expressions'} is not allowed")

    def compare(self, n: ast.Compare) -> Node:
        terms = [self.node(n.left), *(self.node(c) for c in n.comparators)]
        parts: list[Node] = []
        for i, op in enumerate(n.ops):
            if type(op) not in _COMPARE:
                raise self.refuse(n, f"the comparison {type(op).__name__} is not allowed")
            parts.append(Op(_COMPARE[type(op)], (terms[i], terms[i + 1])))
        return parts[0] if len(parts) == 1 else Op(_and, tuple(parts))

    def call(self, n: ast.Call) -> Node:
        if not isinstance(n.func, ast.Name):
            self.node(n.func)  # refuses an attribute, a lambda, a subscript as such
            raise self.refuse(n.func, "only the named functions may be called")
        name = n.func.id
        if name not in FUNCTIONS:
            allowed = ", ".join(FUNCTIONS)
            raise self.refuse(n.func, f"unknown function; allowed: {allowed}")
        if n.keywords:
            raise self.refuse(n.keywords[0], "keyword arguments are not allowed")
        arity, fn = FUNCTIONS[name]
        if len(n.args) != arity:
            raise self.refuse(n, f"{name} takes {arity} argument{'s' * (arity > 1)}")
        return Op(fn, tuple(self.node(a) for a in n.args))


MAX_EXPRESSION = 2000
"""The longest ``--score-mod`` or ``--mask-mod`` text: far more than any mask a model
uses, and short enough that Python's parser never runs out of stack on it."""


@functools.lru_cache(maxsize=64)
def parse(text: str, flag: str, names: tuple[str, ...] = SCORE_NAMES) -> Node:
    """The expression tree of ``text``; a :class:`SpecError` naming ``flag`` and the
    offending token for anything outside the small language."""
    if not text.strip():
        raise SpecError(flag, "expected an expression, got nothing")
    if len(text) > MAX_EXPRESSION:
        raise SpecError(
            flag, f"is {len(text)} characters long; an expression may be up to {MAX_EXPRESSION}"
        )
    try:
        tree = ast.parse(text.strip(), mode="eval")
        return _Parser(text.strip(), flag, names).node(tree.body)
    except (SyntaxError, ValueError) as e:
        col = getattr(e, "offset", None)
        where = f" at column {col}" if col else ""
        raise SpecError(flag, f"{shown(text.strip())}{where}: {getattr(e, 'msg', e)}") from None
    except (RecursionError, MemoryError):  # Python's parser on a very deep expression
        raise SpecError(flag, "is nested too deeply to parse") from None


def parse_score_mod(value: Any, where: str = "--score-mod") -> str:
    """Validate a score-mod expression; the text is kept (options stay plain data)."""
    text = value if isinstance(value, str) else str(value)
    parse(text, where, SCORE_NAMES)
    return text.strip()


def parse_mask_mod(value: Any, where: str = "--mask-mod") -> str:
    text = value if isinstance(value, str) else str(value)
    parse(text, where, MASK_NAMES)
    return text.strip()


def _evaluate(node: Node, env: dict[str, Any]) -> Any:
    if isinstance(node, Num):
        return np.float64(node.value)
    if isinstance(node, Var):
        return env[node.name]
    return node.fn(*(_evaluate(a, env) for a in node.args))


def _grids(
    lead_index: tuple[int, ...], rows: slice, keys: slice
) -> dict[str, NDArray[np.float64] | np.float64]:
    """b and h from the leading axes (…, B, H); q_idx a (rows, 1) column and kv_idx a
    (1, keys) row of positions, in float64 (exact to 2⁵³; no integer overflow)."""
    return {
        "b": np.float64(lead_index[-2] if len(lead_index) >= 2 else 0),
        "h": np.float64(lead_index[-1] if lead_index else 0),
        "q_idx": np.arange(rows.start, rows.stop, dtype=np.float64)[:, None],
        "kv_idx": np.arange(keys.start, keys.stop, dtype=np.float64)[None, :],
    }


def score_mod(
    text: str, score: NDArray[Any], lead_index: tuple[int, ...], rows: slice, keys: slice
) -> NDArray[np.float64]:
    """The block's scores through ``--score-mod``, (rows, keys), in float64."""
    env: dict[str, Any] = {**_grids(lead_index, rows, keys), "score": score.astype(np.float64)}
    with np.errstate(all="ignore"):  # overflow to inf, log(-1) to NaN: as torch does
        out = _evaluate(parse(text, "--score-mod", SCORE_NAMES), env)
    return np.broadcast_to(np.asarray(out, dtype=np.float64), score.shape).copy()


def mask_mod(text: str, lead_index: tuple[int, ...], rows: slice, keys: slice) -> NDArray[np.bool_]:
    """Which keys ``--mask-mod`` lets each row of the block see (True: visible)."""
    with np.errstate(all="ignore"):
        out = _evaluate(parse(text, "--mask-mod", MASK_NAMES), _grids(lead_index, rows, keys))
    shape = (rows.stop - rows.start, keys.stop - keys.start)
    return np.broadcast_to(np.asarray(out) != 0, shape)
