"""Countdown: combine every given number once with + - * / to reach a target.

Prompt ``Use 25 19 4 3 to make 27.``; worked answer, one operation per step, then the
whole expression::

  25-19=6, 6*4=24, 24+3=27. #### (25-19)*4+3

Problems are built backwards from a random expression tree over the drawn numbers
(positive integer intermediates, exact divisions), so each one has a solution; any
expression that uses exactly the given numbers and evaluates to the target is
accepted. Difficulty: ``num_numbers`` (search depth) and ``max_number``/``max_target``
(how many combinations look plausible).
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import operator
from fractions import Fraction

import numpy as np

from spec_rl_jax.tasks.base import Problem, final_answer, parse_int

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}
_AST_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
            ast.Div: operator.truediv}
MAX_EXPR_CHARS = 200  # longer "expressions" are rejected unparsed


@dataclasses.dataclass(frozen=True)
class _Node:
  """A partial expression: its value, its text, its operator precedence (3 = atom)."""

  value: int
  text: str
  prec: int


def _combine(a: _Node, op: str, b: _Node) -> _Node:
  """``a op b`` with the minimal parentheses."""
  p = _PREC[op]
  left = f"({a.text})" if a.prec < p else a.text
  right = f"({b.text})" if b.prec < p or (b.prec == p and op in "-/") else b.text
  return _Node(int(_OPS[op](a.value, b.value)), f"{left}{op}{right}", p)


@dataclasses.dataclass(frozen=True)
class Countdown:
  """``num_numbers`` numbers in ``[1, max_number]``, target in ``[1, max_target]``."""

  num_numbers: int = 3
  max_number: int = 10
  max_target: int = 50
  name: str = "countdown"

  def __post_init__(self):
    if not 2 <= self.num_numbers <= 6:
      raise ValueError(f"num_numbers must be in [2, 6], got {self.num_numbers}")
    if self.max_number < 2 or self.max_target < 1:
      raise ValueError("need max_number >= 2 and max_target >= 1, got"
                       f" {self.max_number}, {self.max_target}")

  def _valid_ops(self, a: int, b: int) -> list[str]:
    ops = ["+"]
    if a > b:
      ops.append("-")
    if a * b <= 10 * self.max_target:
      ops.append("*")
    if b > 1 and a % b == 0:
      ops.append("/")
    return ops

  def sample(self, rng: np.random.Generator) -> Problem:
    while True:
      numbers = [int(x) for x in rng.integers(1, self.max_number + 1, self.num_numbers)]
      pool = [_Node(n, str(n), 3) for n in numbers]
      steps = []
      while len(pool) > 1:
        i, j = (int(x) for x in rng.choice(len(pool), 2, replace=False))
        a, b = pool[i], pool[j]
        ops = self._valid_ops(a.value, b.value)
        op = ops[int(rng.integers(len(ops)))]
        node = _combine(a, op, b)
        steps.append(f"{a.value}{op}{b.value}={node.value}")
        pool = [n for k, n in enumerate(pool) if k not in (i, j)] + [node]
      target = pool[0].value
      if 1 <= target <= self.max_target:
        break
    key = ",".join(map(str, sorted(numbers))) + f"->{target}"
    return Problem(key=key, prompt=f"Use {' '.join(map(str, numbers))} to make {target}.",
                   solution=", ".join(steps) + ".", final=pool[0].text)

  def verify(self, response: str, answer: str) -> float:
    """1.0 iff the response's final expression uses exactly the answer's numbers
    (each once) and has the same value; ``expr=target`` is accepted too."""
    ref = evaluate(final_answer(answer) or "")
    if ref is None:
      raise ValueError(f"countdown answer has no valid final expression: {answer!r}")
    got = final_answer(response)
    if got is None:
      return 0.0
    expr, _, rhs = got.partition("=")
    if rhs and parse_int(rhs) != ref[0]:
      return 0.0
    out = evaluate(expr)
    return float(out is not None and out == ref)


def _literals_and_value(node: ast.AST, literals: list[int]) -> Fraction:
  if isinstance(node, ast.Constant) and type(node.value) is int:
    literals.append(node.value)
    return Fraction(node.value)
  if isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS:
    left = _literals_and_value(node.left, literals)
    right = _literals_and_value(node.right, literals)
    return _AST_OPS[type(node.op)](left, right)
  raise ValueError(f"disallowed syntax {type(node).__name__}")


def evaluate(expr: str) -> tuple[Fraction, collections.Counter] | None:
  """``(value, multiset of integer literals)`` of a + - * / expression; None if invalid.

  Only non-negative integer literals, binary + - * / and parentheses are allowed
  (no unary minus, no exponent, no names); division is exact (rationals).
  """
  expr = expr.strip().rstrip(".").replace("×", "*").replace("÷", "/")
  if not expr or len(expr) > MAX_EXPR_CHARS:
    return None
  try:
    tree = ast.parse(expr, mode="eval")
    literals: list[int] = []
    value = _literals_and_value(tree.body, literals)
  except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
    return None
  return value, collections.Counter(literals)
