"""The rollout as a discrete-event simulation of continuous batching.

Each of ``R`` replicas owns ``S`` slots and takes every R-th request, in order. Events
are slot completions: between two, ``b`` slots are busy and each decode round (one call:
``k`` draft steps, then one verification of ``k + 1`` positions) advances every busy slot
by ``E(k)`` tokens (expected progress: acceptance is a rate, not a draw). A finished
slot takes the next waiting request, whose prompt is prefilled in one call. When the
queue is empty the slots drain: ``b`` falls, rounds get cheaper per slot but no cheaper
per token emitted, and the last long responses decide when the replica is done. That
tail is where speculative decoding and asynchrony pay: a round of a few busy slots is
bound by reading the weights, so ``k`` drafts verified at once cost about one round.

Per segment of ``n`` rounds between events, with ``C_0`` cached tokens in busy slots:

  C_r       = C_0 + b·E(k)·r                       (context read at round r < n)
  verify_r  = forward(target, n = b(k+1), C = C_r, Q = (k+1)·C_r + b(k+1)(k+2)/2)
  draft_r   = k · forward(drafter, n = b, C = C_r + b(k−1)/2, Q = same)   (k = 0: none)
  prefill   = forward(target, n = ΣP, C = 0, Q = ΣP²/2) (+ the drafter's, when drafting)
  replica   = Σ_segments Σ_r (verify_r + draft_r) + Σ prefills
  rollout   = max over replicas

``k`` is fixed or, for ``auto``, chosen per segment (one "decode call") by
`acceptance.choose_k` over the round costs at the segment's start.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from spec_rl_jax.sim import acceptance as acc
from spec_rl_jax.sim.cost import forward_cost
from spec_rl_jax.sim.hardware import Pod
from spec_rl_jax.sim.models import Drafter, SimModel


@dataclasses.dataclass(frozen=True)
class RolloutSetup:
  """One rollout pool: ``replicas`` x ``tp`` chips of ``pod``, ``slots`` per replica,
  acceptance ``a`` (``K = len(a)`` drafts at most), ``k`` fixed (0: AR) or None (auto)."""

  model: SimModel
  drafter: Drafter
  pod: Pod
  tp: int
  replicas: int
  slots: int
  a: np.ndarray
  k: int | None

  def round_costs(self, k: int, b: int, ctx):
    """(verify, draft) seconds of rounds at draft length ``k``, ``b`` busy slots and
    context sums ``ctx`` (one per round); formulas in the module docstring."""
    q = (k + 1) * ctx + b * (k + 1) * (k + 2) / 2
    verify = forward_cost(self.model, self.pod, self.tp, b * (k + 1), ctx, q).total
    draft = np.zeros_like(verify)
    if k and self.drafter.model is not None:
      mid = ctx + b * (k - 1) / 2
      draft = k * forward_cost(self.drafter.model, self.pod, self.tp, b, mid, mid).total
    return verify, draft

  def prefill(self, prompt_tokens: float, prompt_sq: float) -> float:
    t = float(forward_cost(self.model, self.pod, self.tp, prompt_tokens, 0.0,
                           prompt_sq / 2).total)
    if self.drafter.model is not None and (self.k is None or self.k > 0):
      t += float(forward_cost(self.drafter.model, self.pod, self.tp, prompt_tokens, 0.0,
                              prompt_sq / 2).total)
    return t

  def choose(self, b: int, ctx: float, memo: dict) -> int:
    """``k`` of a decode call at ``b`` busy slots holding ``ctx`` cached tokens; auto
    choices are memoised per ``(b, ctx)`` on a 1/8-octave grid of ``ctx`` (costs are
    smooth in it)."""
    if self.k is not None:
      return self.k
    key = (b, round(8 * math.log2(max(ctx, 1.0))))
    if key not in memo:
      costs = [sum(float(np.sum(x)) for x in self.round_costs(k, b, np.asarray([ctx])))
               for k in range(len(self.a) + 1)]
      memo[key] = acc.choose_k(self.a, np.asarray(costs))
    return memo[key]


@dataclasses.dataclass(frozen=True)
class RolloutResult:
  """The slowest replica's seconds by part (``prefill``, ``verify``, ``draft``), its
  ``tail`` (seconds with the queue empty and slots free), ``rounds`` and the decode
  rounds at each ``k``; ``time`` = prefill + verify + draft; ``replica_times`` all."""

  time: float
  prefill: float
  verify: float
  draft: float
  tail: float
  rounds: int
  rounds_at_k: dict
  replica_times: tuple


def simulate_replica(setup: RolloutSetup, lengths: np.ndarray, prompts: np.ndarray,
                     memo: dict) -> dict:
  """One replica's event loop over its requests (``lengths``, ``prompts`` in order);
  ``memo`` holds the auto choices of ``k`` (`RolloutSetup.choose`)."""
  E = acc.expected_tokens(setup.a)
  S = setup.slots
  queue = collections.deque(range(len(lengths)))
  rem, ctx, busy = np.zeros(S), np.zeros(S), np.zeros(S, bool)
  out = {"prefill": 0.0, "verify": 0.0, "draft": 0.0, "tail": 0.0, "rounds": 0}
  at_k = collections.Counter()

  def admit():
    free = np.nonzero(~busy)[0][:len(queue)]
    if not len(free):
      return
    reqs = [queue.popleft() for _ in free]
    rem[free], ctx[free], busy[free] = lengths[reqs], prompts[reqs], True
    p = prompts[reqs].astype(float)
    out["prefill"] += setup.prefill(p.sum(), float(np.sum(p * p)))

  admit()
  while busy.any():
    b = int(busy.sum())
    c0 = float(ctx[busy].sum())
    k = setup.choose(b, c0, memo)
    e = E[k]
    n = max(1, math.ceil(float(rem[busy].min()) / e - 1e-9))
    verify, draft = setup.round_costs(k, b, c0 + b * e * np.arange(n))
    seg = float(verify.sum() + draft.sum())
    out["verify"] += float(verify.sum())
    out["draft"] += float(draft.sum())
    if not queue and b < S:
      out["tail"] += seg
    out["rounds"] += n
    at_k[k] += n
    rem[busy] -= n * e
    ctx[busy] += n * e
    busy &= rem > 1e-9
    admit()
  out["time"] = out["prefill"] + out["verify"] + out["draft"]
  out["rounds_at_k"] = dict(at_k)
  return out


def simulate_rollout(setup: RolloutSetup, lengths: np.ndarray,
                     prompts: np.ndarray) -> RolloutResult:
  """All replicas (request ``i`` to replica ``i mod R``); the slowest sets the time."""
  R = setup.replicas
  memo = {}
  reps = [simulate_replica(setup, lengths[r::R], prompts[r::R], memo)
          for r in range(R) if len(lengths[r::R])]
  worst = max(reps, key=lambda x: x["time"])
  return RolloutResult(worst["time"], worst["prefill"], worst["verify"], worst["draft"],
                       worst["tail"], worst["rounds"], worst["rounds_at_k"],
                       tuple(x["time"] for x in reps))
