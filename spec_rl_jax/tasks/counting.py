"""Counting: the long-response workload (~450-2,500-token responses from a tiny model).

Prompt ``Count from 137 to 342.``; answer every integer in order, space separated::

  137 138 139 ... 342 #### 342

Digits and spaces are single tokens, so a span of 500 numbers is a ~2,000-2,500-token
response. Most of the work is local (increment the previous number, carries included),
but stopping needs the target from the prompt, up to 2,500 positions back: the shape of
long reasoning traces that sparse drafting (spec/proposers/self_sparse.py) exploits.

Difficulty: the span (numbers to write) is uniform in ``[min_span, max_span]``, the
start uniform in ``[0, max_start]``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from spec_rl_jax.tasks.base import FINAL_MARKER, Problem


@dataclasses.dataclass(frozen=True)
class Counting:
  """Write every integer from ``a`` to ``b``; ``b - a + 1`` in ``[min_span, max_span]``."""

  min_span: int = 100
  max_span: int = 500
  max_start: int = 999
  name: str = "counting"

  def __post_init__(self):
    if not 2 <= self.min_span <= self.max_span:
      raise ValueError(f"need 2 <= min_span <= max_span, got {self.min_span},"
                       f" {self.max_span}")
    if self.max_start < 0:
      raise ValueError(f"max_start must be >= 0, got {self.max_start}")

  def sample(self, rng: np.random.Generator) -> Problem:
    a = int(rng.integers(0, self.max_start + 1))
    b = a + int(rng.integers(self.min_span, self.max_span + 1)) - 1
    return Problem(key=f"{a}-{b}", prompt=f"Count from {a} to {b}.",
                   solution=" ".join(map(str, range(a, b + 1))), final=str(b))

  def verify(self, response: str, answer: str) -> float:
    """1.0 iff the numbers before the response's last ``####`` are exactly the
    answer's and the final answer matches."""
    def parts(text):
      pos = text.rfind(FINAL_MARKER)
      if pos < 0:
        return None
      return text[:pos].split(), text[pos + len(FINAL_MARKER):].split()[:1]

    got, want = parts(response), parts(answer)
    return float(got is not None and want is not None and got == want)
