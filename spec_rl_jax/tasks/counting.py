"""Counting: the long-response workload (~450-2,500-token responses from a tiny model).

Prompt ``Count from 137 to 342.``; answer every integer in order, space separated::

  137 138 139 ... 342 #### 342

Digits and spaces are single tokens, so a span of 500 numbers is a ~2,000-2,500-token
response. Most of the work is local (increment the previous number, carries included),
but stopping needs the target from the prompt, up to 2,500 positions back: the shape of
long reasoning traces that sparse drafting (spec/proposers/self_sparse.py) exploits.

Difficulty: the span (numbers to write) is uniform in ``[min_span, max_span]``, or,
with ``stop_hazard`` h > 0, geometric: after each number from ``min_span`` on the count
stops with probability h (truncated at ``max_span``). The start is uniform in
``[0, max_start]``.

Why the geometric option exists (the long policy's SFT, sft.py): with uniform spans a
small model learns to stop by length (at the true end the stop token gets the hazard of
the span distribution), or, on short spans, at the first
number whose last digit matches the end number's. Under a flat hazard the count so far
says nothing about the stop, so only comparing the number just written with the
prompt's end number lowers the loss.
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
  stop_hazard: float = 0.0  # 0: uniform spans; h > 0: P(stop | reached span s) = h
  name: str = "counting"

  def __post_init__(self):
    if not 2 <= self.min_span <= self.max_span:
      raise ValueError(f"need 2 <= min_span <= max_span, got {self.min_span},"
                       f" {self.max_span}")
    if self.max_start < 0:
      raise ValueError(f"max_start must be >= 0, got {self.max_start}")
    if not 0.0 <= self.stop_hazard < 1.0:
      raise ValueError(f"stop_hazard must be in [0, 1), got {self.stop_hazard}")

  def _span(self, rng: np.random.Generator) -> int:
    if self.stop_hazard == 0.0:
      return int(rng.integers(self.min_span, self.max_span + 1))
    while True:  # rejection keeps the hazard flat below max_span
      span = self.min_span - 1 + int(rng.geometric(self.stop_hazard))
      if span <= self.max_span:
        return span

  def sample(self, rng: np.random.Generator) -> Problem:
    a = int(rng.integers(0, self.max_start + 1))
    b = a + self._span(rng) - 1
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
