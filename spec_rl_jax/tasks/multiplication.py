"""Long multiplication with every partial product and the final column sum written out.

Prompt ``What is 483*25?``; worked answer (the default task's SFT target)::

  483*5: 3*5=15, 8*5+1=41, 4*5+4=24, so 2415.
  483*2: 3*2=6, 8*2=16, 4*2+1=9, so 966.
  2415+9660: 5+0=5, 1+6=7, 4+6=10, 2+9+1=12, so 12075. #### 12075

(one line per step in the record, here wrapped). A partial product multiplies the first
operand ``a`` by one digit ``b_j`` of the second, least significant digit first: each
step is ``a_i*b_j[+c]=v`` with the carry ``c`` the tens of the previous ``v`` (no ``+c``
when zero) and the partial is the last ``v`` followed by the units of the earlier ones,
newest first. A zero digit contributes ``a*0=0`` and is left out of the sum. The sum
adds the partials shifted by their place (``9660`` is ``966`` shifted by one) column by
column as in `arithmetic.scratchpad`; with one non-zero partial the sum line is absent.

Every step is local (one multiplication fact, one carry, one digit looked up), so a
small model can learn to execute it, while a whole solution is long (at the default
2-3 x 2 digits 37-152 tokens of the default tokenizer, median 112; 4 x 3 digits ~250);
errors compound along the chain, which leaves the SFT policy room to improve under RL. The reward reads only the final answer, with math-verify
(`math_answer.math_reward`); `well_formed` checks the worked part's grammar, for the
optional format reward (``data.format_weight``).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from spec_rl_jax.tasks.arithmetic import scratchpad
from spec_rl_jax.tasks.base import FINAL_MARKER, Problem, final_answer
from spec_rl_jax.tasks.math_answer import math_reward

_STEP = r"\d\*\d(\+\d)?=\d+"
_PARTIAL = rf"(\d+\*\d: ({_STEP}, )*{_STEP}, so \d+\.|\d+\*0=0\.)"
_SUM = r"\d+(\+\d+)+: (\d(\+\d)*=\d+, )*\d(\+\d)*=\d+, so \d+\."
_WORKED = re.compile(rf"({_PARTIAL}\n)+({_SUM}\n?)?")


@dataclasses.dataclass(frozen=True)
class Multiplication:
  """``a * b`` with ``a`` of ``min_digits..max_digits`` digits and ``b`` of
  ``min_multiplier_digits..max_multiplier_digits``."""

  min_digits: int = 2
  max_digits: int = 3
  min_multiplier_digits: int = 2
  max_multiplier_digits: int = 2
  name: str = "multiplication"

  def __post_init__(self):
    if not 1 <= self.min_digits <= self.max_digits <= 9:
      raise ValueError("need 1 <= min_digits <= max_digits <= 9, got"
                       f" {self.min_digits}, {self.max_digits}")
    if not 1 <= self.min_multiplier_digits <= self.max_multiplier_digits <= 9:
      raise ValueError("need 1 <= min_multiplier_digits <= max_multiplier_digits <= 9, got"
                       f" {self.min_multiplier_digits}, {self.max_multiplier_digits}")

  def sample(self, rng: np.random.Generator) -> Problem:
    a = _number(rng, self.min_digits, self.max_digits)
    b = _number(rng, self.min_multiplier_digits, self.max_multiplier_digits)
    return Problem(key=f"{a}*{b}", prompt=f"What is {a}*{b}?",
                   solution=worked_solution(a, b), final=str(a * b))

  def verify(self, response: str, answer: str) -> float:
    """1.0 iff the response has a final answer (after ``####``, the format the task
    teaches) and math-verify finds it equal to the reference's."""
    if final_answer(response) is None:
      return 0.0
    return math_reward(response, answer)

  def well_formed(self, response: str) -> bool:
    """Whether the worked part (before ``####``) follows the solution grammar; says
    nothing about whether its arithmetic is right."""
    worked, marker, _ = response.rpartition(FINAL_MARKER)
    return bool(marker) and _WORKED.fullmatch(worked.strip() + "\n") is not None


def _number(rng: np.random.Generator, lo: int, hi: int) -> int:
  """A number of ``lo..hi`` digits (uniform length, then uniform value; no leading 0)."""
  n = int(rng.integers(lo, hi + 1))
  return int(rng.integers(10 ** (n - 1), 10**n)) if n > 1 else int(rng.integers(2, 10))


def partial_product(a: int, digit: int) -> str:
  """``483*5: 3*5=15, 8*5+1=41, 4*5+4=24, so 2415.`` (``a*0=0.`` for a zero digit)."""
  if digit == 0:
    return f"{a}*0=0."
  steps, carry, units = [], 0, []
  for d in map(int, reversed(str(a))):
    v = d * digit + carry
    steps.append(f"{d}*{digit}" + (f"+{carry}" if carry else "") + f"={v}")
    units.append(v % 10)
    carry = v // 10
  value = str(v) + "".join(map(str, reversed(units[:-1])))
  return f"{a}*{digit}: " + ", ".join(steps) + f", so {value}."


def worked_solution(a: int, b: int) -> str:
  """The partial product lines of ``a*b``, then the column sum of the shifted non-zero
  partials (`arithmetic.scratchpad`) when there are several."""
  lines, shifted = [], []
  for place, digit in enumerate(map(int, reversed(str(b)))):
    lines.append(partial_product(a, digit))
    if digit:
      shifted.append(a * digit * 10**place)
  if len(shifted) > 1:
    sums = scratchpad(shifted).rstrip(".")
    lines.append("+".join(map(str, shifted)) + f": {sums}, so {sum(shifted)}.")
  return "\n".join(lines)
