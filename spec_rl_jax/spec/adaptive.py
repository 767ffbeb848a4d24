"""Adaptive draft length (ReSpec's online tuning): each decode call's ``k`` maximises the
expected tokens per second from live acceptance and measured round costs.

Glossary (one decode call at slot bucket ``S_c``, page bucket ``M_c``; ``K`` the most
drafts a round may propose):

  a_i     P(drafts ``0..i`` all accepted), ``i < K``: decayed sums of the engine's
          per-position acceptance counts, ``hits_i / trials_i`` (a prior of weight
          ``prior_weight`` slot-rounds at ``prior_acceptance^(i+1)``). Positions no call
          has drafted yet extend the last measured conditional rate ``a_i / a_{i-1}``.
  E(k)    expected tokens per slot-round with ``k`` drafts: ``1 + Σ_{i<k} a_i``.
  c(k)    seconds per round at ``(k, S_c, M_c)``. Measured: decayed sums of a shape's
          call seconds and rounds (the engine's first call of a shape is skipped: it
          compiles). Unmeasured:
          the model ``θ·φ``, ``φ = [1, k, S_c, S_c·k, S_c·M_c]``, ``θ >= 0`` fitted by
          non-negative least squares to the measured shapes once two draft lengths are
          measured (before that ``1 + draft_cost·k``), scaled by the geometric mean of
          measured / model over the shape's measured ``k``.
  anchor  until an AR round cost ``c(0)`` is measured, calls run at ``k = 0`` (at most
          `ANCHOR_CALLS`; the first call of a shape compiles, unmeasured).
  choice  ``argmax_k E(k) / c(k)``; the current ``k`` is kept unless another is better by
          more than ``hysteresis``. Now and then a neighbour of the choice (``k ± 1`` or
          0) whose cost at this shape is the least recently measured runs instead, so
          costs the model gets wrong are corrected: first after ``explore_every`` calls,
          the wait doubling (up to ``max_explore_gap``) while explorations leave the
          choice unchanged, since exploring costs throughput (and, from ``k = 0``, a
          draft model's catch-up).

Costs come from the engine's own decode calls: nothing is profiled in the rollout path.
A choice holds for one call; calls end when a slot finishes while requests wait, when
a smaller slot bucket would do, when a slot needs pages, or after the round budget.
Calls whose timing is not a positive finite number (a clock glitch) update the
acceptance only and are counted in ``stats["ignored_timings"]``.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize

from spec_rl_jax.spec.controller import CallShape, CallStats, SpecController

ANCHOR_CALLS = 3  # k = 0 calls tried until an AR round cost is measured


def features(k: int, slots: int, pages: int) -> np.ndarray:
  """``φ(k, S_c, M_c)``: fixed cost, draft steps, verified rows, drafted rows, KV pages."""
  return np.asarray([1.0, k, slots, slots * k, slots * pages], np.float64)


class AdaptiveK(SpecController):
  """Chooses ``k`` per call from estimated acceptance and measured round costs (see the
  module docstring); ``stats`` counts predicted and realised tokens."""

  def __init__(self, max_draft_tokens: int, decay: float = 0.8, hysteresis: float = 0.05,
               explore_every: int = 8, max_explore_gap: int = 128, draft_cost: float = 0.25,
               prior_acceptance: float = 0.6, prior_weight: float = 1.0):
    super().__init__(max_draft_tokens)
    if max_draft_tokens < 1:
      raise ValueError("the adaptive controller needs max_draft_tokens >= 1, got"
                       f" {max_draft_tokens}")
    if not 0 < decay <= 1 or hysteresis < 0 or explore_every < 1 or draft_cost < 0:
      raise ValueError("need 0 < decay <= 1, hysteresis >= 0, explore_every >= 1,"
                       " draft_cost >= 0")
    K = max_draft_tokens
    self.decay, self.hysteresis, self.explore_every = decay, hysteresis, explore_every
    self.max_explore_gap = max(max_explore_gap, explore_every)
    self.gap, self.next_explore, self.explored_from = explore_every, explore_every, -1
    self.anchor_calls = 0  # calls run at k = 0 until an AR cost is measured
    self.draft_cost = draft_cost
    self.hits = prior_weight * prior_acceptance ** np.arange(1, K + 1)
    self.trials = np.full((K,), prior_weight, np.float64)
    self.measured = np.zeros((K,), bool)  # positions some call drafted
    self.cost_sums: dict[tuple[int, int, int], list[float]] = {}  # shape -> [s, rounds]
    self.last_measured: dict[tuple[int, int, int], int] = {}  # shape -> call index
    self.theta: np.ndarray | None = None
    self.k = K  # the incumbent
    self.calls = 0
    self.pending = (K, 1.0)  # (k, E(k)) of the call in flight

  # ---------------------------------------------------------------- estimates

  def acceptance(self) -> np.ndarray:
    """``a_i``, ``i < K``."""
    a = self.hits / self.trials
    last = None
    for i in range(len(a)):
      if self.measured[i]:
        last = a[i] / a[i - 1] if i and a[i - 1] > 0 else a[i]
      elif last is not None:
        a[i] = a[i - 1] * last
    return np.clip(a, 0.0, 1.0)

  def expected_tokens(self) -> np.ndarray:
    """``E(k)`` for ``k = 0..K``."""
    return 1.0 + np.concatenate([[0.0], np.cumsum(self.acceptance())])

  def _model(self, k: int, slots: int, pages: int) -> float:
    if self.theta is None:
      return 1.0 + self.draft_cost * k
    return max(float(features(k, slots, pages) @ self.theta), 1e-12)

  def costs(self, shape: CallShape) -> np.ndarray:
    """``c(k)`` for ``k = 0..K`` at the call's shape (each ``k`` at its own ``S_c``):
    measured, else the model scaled by the shape's measured / model ratios."""
    K, M = self.max_draft_tokens, shape.pages
    keys = [(k, shape.slots_at(k), M) for k in range(K + 1)]
    model = np.asarray([self._model(*key) for key in keys])
    measured = {key[0]: self.cost_sums[key] for key in keys if key in self.cost_sums}
    out = model.copy()
    if measured:
      ratios = [math.log(s / r / model[k]) for k, (s, r) in measured.items()]
      out *= math.exp(sum(ratios) / len(ratios))
      for k, (s, r) in measured.items():
        out[k] = s / r
    return out

  def _fit(self) -> None:
    if len({k for k, _, _ in self.cost_sums}) < 2:
      return
    rows = [(features(*shape), s / r, r) for shape, (s, r) in self.cost_sums.items()]
    w = np.sqrt([r for _, _, r in rows])
    A = np.stack([f for f, _, _ in rows]) * w[:, None]
    b = np.asarray([c for _, c, _ in rows]) * w
    scale = np.maximum(np.abs(A).max(0), 1e-12)  # columns on one scale for NNLS
    theta, _ = optimize.nnls(A / scale, b)
    if np.any(theta > 0):
      self.theta = theta / scale

  # ---------------------------------------------------------------- protocol

  def choose(self, shape: CallShape) -> int:
    self.calls += 1
    expected = self.expected_tokens()
    rate = expected / self.costs(shape)
    best = int(np.argmax(rate))
    if rate[best] <= rate[self.k] * (1 + self.hysteresis):
      best = self.k
    self.k = k = best
    anchored = any(j == 0 for j, _, _ in self.cost_sums)
    if best and not anchored and self.anchor_calls < ANCHOR_CALLS:
      # The AR cost anchors every ratio (and the model's fit): measure it first.
      self.anchor_calls += 1
      k = 0
      self.stats["anchor_calls"] += 1
    elif self.calls >= self.next_explore:
      # An exploration that leaves the choice as it was doubles the wait for the next.
      self.gap = min(2 * self.gap, self.max_explore_gap) if best == self.explored_from \
          else self.explore_every
      self.next_explore, self.explored_from = self.calls + self.gap, best
      near = sorted({best - 1, best + 1, 0} & set(range(self.max_draft_tokens + 1)) - {best})
      k = min(near, key=lambda j: self.last_measured.get((j, shape.slots_at(j), shape.pages),
                                                         -1))
      self.stats["explored"] += 1
    self.pending = (k, float(expected[k]))
    return k

  def observe(self, stats: CallStats) -> None:
    k, d = stats.k, self.decay
    if k and stats.slot_rounds:
      self.hits[:k] = d * self.hits[:k] + np.asarray(stats.accepted_at, np.float64)
      self.trials[:k] = d * self.trials[:k] + stats.slot_rounds
      self.measured[:k] = True
    if stats.slot_rounds and self.pending[0] == k:
      self.stats["predicted_tokens"] += self.pending[1] * stats.slot_rounds
      self.stats["realised_tokens"] += stats.slot_rounds + float(np.sum(stats.accepted_at))
      self.stats["slot_rounds"] += stats.slot_rounds
    shape = (k, stats.slots, stats.pages)
    if not (math.isfinite(stats.seconds) and stats.seconds > 0 and stats.rounds > 0):
      self.stats["ignored_timings"] += 1
      return
    if stats.first_call:
      return
    s, r = self.cost_sums.get(shape, (0.0, 0.0))
    self.cost_sums[shape] = [d * s + stats.seconds, d * r + stats.rounds]
    self.last_measured[shape] = self.calls
    self._fit()
