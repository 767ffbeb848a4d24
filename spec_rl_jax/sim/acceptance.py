"""Acceptance per draft position and the draft-length choice.

  a_i    P(drafts 0..i all accepted), i < K: what the engine reports as
         ``spec/acceptance_at`` (the fraction of speculative slot-rounds whose draft i
         was accepted). In [0, 1] and non-increasing in i (draft i is kept only if every
         earlier one is). Positions past the given ones extend the last conditional rate
         ``a_i / a_{i−1}``, as `spec.adaptive.AdaptiveK` does.
  E(k)   expected tokens per slot-round with k drafts: ``1 + Σ_{i<k} a_i``.
  choice ``argmax_k E(k) / c(k)`` over ``k = 0..K`` with ``c(k)`` the simulated round
         cost at the live batch (the adaptive controller's rule, costs from the model
         instead of measured calls).
"""

from __future__ import annotations

import json

import numpy as np


def validate(a) -> np.ndarray:
  """``a`` as an array, or a clear error when an entry is outside [0, 1] or the
  sequence increases with position."""
  a = np.asarray(a, float)
  if a.ndim != 1 or not len(a):
    raise ValueError(f"acceptance must be a non-empty list of per-position rates, got {a!r}")
  bad = [(i, x) for i, x in enumerate(a) if not 0.0 <= x <= 1.0]
  if bad:
    raise ValueError(f"acceptance must lie in [0, 1]: position {bad[0][0]} is {bad[0][1]}")
  up = np.nonzero(np.diff(a) > 1e-12)[0]
  if len(up):
    i = int(up[0])
    raise ValueError(
        f"acceptance must not increase with position (a_i = P(drafts 0..i accepted)):"
        f" a_{i} = {a[i]} < a_{i + 1} = {a[i + 1]}")
  return a


def extend(a: np.ndarray, K: int) -> np.ndarray:
  """``a`` over ``K`` positions: cut, or extended by the last conditional rate."""
  a = validate(a)
  if len(a) >= K:
    return a[:K]
  rate = a[-1] / a[-2] if len(a) > 1 and a[-2] > 0 else a[-1]
  tail = a[-1] * rate ** np.arange(1, K - len(a) + 1)
  return np.concatenate([a, tail])


def geometric(alpha: float, K: int) -> np.ndarray:
  """``a_i = α^(i+1)``: every draft accepted with probability α given its predecessors."""
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f"acceptance must lie in [0, 1], got {alpha}")
  return alpha ** np.arange(1, K + 1, dtype=float)


def alpha_for_length(length: float, K: int) -> float:
  """The α whose geometric ``E(K)`` equals a reported acceptance length (bisection)."""
  if not 1.0 <= length <= K + 1:
    raise ValueError(f"an acceptance length with K={K} lies in [1, {K + 1}], got {length}")
  lo, hi = 0.0, 1.0
  for _ in range(60):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if expected_tokens(geometric(mid, K))[K] < length else (lo, mid)
  return (lo + hi) / 2


def expected_tokens(a: np.ndarray) -> np.ndarray:
  """``E(k) = 1 + Σ_{i<k} a_i`` for ``k = 0..len(a)``."""
  return 1.0 + np.concatenate([[0.0], np.cumsum(a)])


def choose_k(a: np.ndarray, costs: np.ndarray) -> int:
  """``argmax_k E(k)/c(k)``; ties go to the shorter draft."""
  rate = expected_tokens(a)[:len(costs)] / np.asarray(costs)
  return int(np.argmax(rate))


def load(path: str) -> np.ndarray:
  """Per-position acceptance from a JSON file: a list ``[a_0, a_1, ...]`` or an object
  with ``acceptance_at`` (the engine's metric name)."""
  with open(path) as f:
    data = json.load(f)
  return validate(data["acceptance_at"] if isinstance(data, dict) else data)
