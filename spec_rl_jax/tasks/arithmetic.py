"""Multi-digit addition with a column-by-column scratchpad.

Prompt ``What is 483+295?``; worked answer, least significant column first, the carry
added as a last term when non-zero::

  3+5=8, 8+9=17, 4+2+1=7. #### 778

Difficulty: operand lengths are drawn uniformly from ``[min_digits, max_digits]`` and
``terms`` numbers are added. Each extra digit adds a column the model must align
across the operands and carry through, so accuracy falls smoothly with ``max_digits``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from spec_rl_jax.tasks.base import Problem, final_answer, parse_int


@dataclasses.dataclass(frozen=True)
class Arithmetic:
  """Addition of ``terms`` numbers of ``min_digits..max_digits`` digits each."""

  min_digits: int = 1
  max_digits: int = 3
  terms: int = 2
  name: str = "arithmetic"

  def __post_init__(self):
    if not 1 <= self.min_digits <= self.max_digits <= 18:
      raise ValueError("need 1 <= min_digits <= max_digits <= 18, got"
                       f" {self.min_digits}, {self.max_digits}")
    if not 2 <= self.terms <= 9:
      raise ValueError(f"terms must be in [2, 9] (single-digit carries), got {self.terms}")

  def _operand(self, rng: np.random.Generator) -> int:
    n = int(rng.integers(self.min_digits, self.max_digits + 1))
    if n == 1:
      return int(rng.integers(0, 10))
    return int(rng.integers(10 ** (n - 1), 10**n))

  def sample(self, rng: np.random.Generator) -> Problem:
    operands = [self._operand(rng) for _ in range(self.terms)]
    expr = "+".join(map(str, operands))
    return Problem(key=expr, prompt=f"What is {expr}?", solution=scratchpad(operands),
                   final=str(sum(operands)))

  def verify(self, response: str, answer: str) -> float:
    """1.0 iff the integer after the response's last ``####`` equals the answer's."""
    got = final_answer(response)
    want = parse_int(final_answer(answer) or "")
    if got is None or want is None:
      return 0.0
    return float(parse_int(got) == want)


def scratchpad(operands: list[int]) -> str:
  """Column sums from the units up, e.g. ``[483, 295]`` → ``3+5=8, 8+9=17, 4+2+1=7.``"""
  digits = [str(x)[::-1] for x in operands]
  steps, carry = [], 0
  for col in range(max(map(len, digits))):
    terms = [d[col] for d in digits if col < len(d)]
    if carry:
      terms.append(str(carry))
    total = sum(map(int, terms))
    steps.append(f"{'+'.join(terms)}={total}")
    carry = total // 10
  return ", ".join(steps) + "."
