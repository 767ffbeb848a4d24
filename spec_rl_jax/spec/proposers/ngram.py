"""``ngram``: model-free drafts by suffix matching (prompt lookup; SPEC-RL / DAS idea).

For each slot the last ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``)
are searched in three corpora, and the ``K`` tokens that followed the match become the
draft (a point mass: ``q(x) = 1``):
  * the slot's own prompt and response so far,
  * the sibling responses of the same prompt group (other slots with the same group
    id — GRPO samples several responses per prompt; finished siblings still count
    until their slot is reused),
  * ``reference``: earlier rollouts of the same prompt, kept by the engine across RL
    steps and loaded at admission.
The longest ``n`` wins; ties prefer the own history, then siblings, then references,
and the most recent occurrence. Continuations that run past a corpus' valid end, and
slots with no match at all, are filled with the last token: they are simply rejected.
Exactness never depends on the drafts: every draft is verified.

Shape legend: ``S`` slots, ``Lh`` history length, ``R`` reference length, ``K`` drafts.
Cost per round: ``O(max_ngram · S · (S·Lh + R))`` integer compares.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spec_rl_jax.rollout.types import EngineConfig
from spec_rl_jax.spec.proposers.base import DraftContext, register


@register("ngram")
class NGramProposer:
  """Suffix-match drafting over own history, siblings and earlier rollouts."""

  def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
    if not 1 <= min_ngram <= max_ngram:
      raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    self.max_ngram, self.min_ngram = max_ngram, min_ngram

  def params(self):
    return None

  def init_state(self, config: EngineConfig):
    return None

  def prefill(self, params, state, tokens, positions, pages):
    return state

  def propose(self, params, state, ctx: DraftContext, num_draft: int, sampling):
    hist, ref, K = ctx.history, ctx.reference, num_draft
    S, Lh = hist.shape
    R = ref.shape[1]
    cur = ctx.length  # position of ``last`` in each slot's history
    rows = jnp.arange(S)
    # Only slots that ever held a request have a group id >= 0.
    same_group = (ctx.group[:, None] == ctx.group[None, :]) & (ctx.group[None, :] >= 0)
    pos = jnp.arange(Lh)
    # Valid match end j (exclusive of the current suffix itself for the own row) and
    # the valid extent of each row's tokens.
    own_end = cur[:, None]  # matches must end before ``cur``
    row_len = (ctx.length + 1)[None, :]  # [1, S]: tokens 0..length of each row
    best_src = jnp.full((S,), -1, jnp.int32)  # 0 = history rows, 1 = reference
    best_row = jnp.zeros((S,), jnp.int32)
    best_end = jnp.zeros((S,), jnp.int32)
    found = jnp.zeros((S,), bool)
    for n in range(self.min_ngram, self.max_ngram + 1):  # longer n overrides
      idx = cur[:, None] - (n - 1) + jnp.arange(n)[None, :]  # [S, n]
      suffix = jnp.take_along_axis(hist, jnp.maximum(idx, 0), axis=1)
      has_suffix = cur >= n - 1
      # history rows: m[s, r, j]
      eq = None
      for i in range(n):
        shifted = jnp.roll(hist, i, axis=1).at[:, :i].set(-2)  # shifted[r, j] = hist[r, j-i]
        e = shifted[None, :, :] == suffix[:, n - 1 - i][:, None, None]
        eq = e if eq is None else eq & e
      ok_row = jnp.where(rows[None, :] == rows[:, None], True, same_group)  # [S, S]
      end_ok = jnp.where(rows[None, :, None] == rows[:, None, None],
                         pos[None, None, :] < own_end[:, :, None],
                         pos[None, None, :] < row_len[:, :, None] - 1)
      m_hist = eq & ok_row[:, :, None] & end_ok & (pos >= n - 1)[None, None, :]
      # rank: own row first, then siblings; later positions first
      rank = jnp.where(rows[None, :, None] == rows[:, None, None], 2 * Lh, Lh) + pos
      score_h = jnp.where(m_hist, rank, -1).reshape(S, S * Lh)
      flat = jnp.argmax(score_h, axis=1)
      hit_h = jnp.max(score_h, axis=1) >= 0
      # reference rows: m[s, j] (none when the engine keeps no references)
      score_r = jnp.full((S, 1), -1, jnp.int32)
      if R:
        eq_r = None
        for i in range(n):
          shifted = jnp.roll(ref, i, axis=1).at[:, :i].set(-2)
          e = shifted == suffix[:, n - 1 - i][:, None]
          eq_r = e if eq_r is None else eq_r & e
        rpos = jnp.arange(R)
        score_r = jnp.where(eq_r & (rpos >= n - 1)[None, :] & (rpos < R - 1)[None, :], rpos, -1)
      hit_r = jnp.max(score_r, axis=1) >= 0
      hit = has_suffix & (hit_h | hit_r)
      src = jnp.where(hit_h, 0, 1)
      best_src = jnp.where(hit, src, best_src)
      best_row = jnp.where(hit, jnp.where(hit_h, flat // Lh, 0), best_row)
      best_end = jnp.where(hit, jnp.where(hit_h, flat % Lh, jnp.argmax(score_r, axis=1)),
                           best_end)
      found |= hit

    take = best_end[:, None] + 1 + jnp.arange(K)[None, :]  # [S, K] continuation positions
    from_hist = hist[best_row[:, None], jnp.minimum(take, Lh - 1)]
    hist_limit = jnp.where(best_row == rows, cur + 1, ctx.length[best_row] + 1)
    from_hist = jnp.where(take < hist_limit[:, None], from_hist, -1)
    from_ref = (jnp.where(take < R, jnp.take_along_axis(ref, jnp.minimum(take, R - 1), axis=1), -1)
                if R else jnp.full((S, K), -1, jnp.int32))
    drafts = jnp.where((best_src == 0)[:, None], from_hist, from_ref)
    drafts = jnp.where(found[:, None] & (drafts >= 0), drafts, ctx.last[:, None])
    return drafts.astype(jnp.int32), None, state
