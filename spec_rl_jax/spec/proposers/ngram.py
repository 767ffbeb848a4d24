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

Shape legend: ``S`` slots, ``G`` siblings searched per slot (``max_siblings``), ``Lh``
history length, ``R`` reference length, ``K`` drafts. Matching is incremental over
``n`` (an ``n``-gram match is an ``(n-1)``-gram match plus one compare), so a round
costs ``O(max_ngram · S · ((1 + G)·Lh + R))`` integer compares.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spec_rl_jax.rollout.types import EngineConfig
from spec_rl_jax.spec.proposers.base import DraftContext, register


@register("ngram")
class NGramProposer:
  """Suffix-match drafting over own history, siblings and earlier rollouts."""

  reads_other_slots = True  # sibling rows are corpora

  def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_siblings: int = 8):
    if not 1 <= min_ngram <= max_ngram:
      raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    if max_siblings < 0:
      raise ValueError(f"max_siblings must be >= 0, got {max_siblings}")
    self.max_ngram, self.min_ngram, self.max_siblings = max_ngram, min_ngram, max_siblings

  def params(self, rows):
    return None

  def init_state(self, config: EngineConfig):
    return None

  def prefill(self, params, state, tokens, positions, pages):
    return state

  def propose(self, params, state, ctx: DraftContext, num_draft: int, sampling):
    hist, K = ctx.history, num_draft
    S, Lh = hist.shape
    cur = ctx.length  # position of ``last`` in each slot's history
    rows = jnp.arange(S)
    # Corpus rows of slot s: [own, up to G siblings] (C = 1 + G), gathered so the cost
    # grows with the group size, not with S. Slots that never held a request of this
    # group sort last and are masked out.
    G = min(self.max_siblings, S - 1)
    sibling = (ctx.group[:, None] == ctx.group[None, :]) & (ctx.group[None, :] >= 0) & (
        rows[None, :] != rows[:, None])  # [S, S]
    order = jnp.argsort(jnp.where(sibling, rows[None, :], S + rows[None, :]), axis=1)[:, :G]
    src_rows = jnp.concatenate([rows[:, None], order], axis=1)  # [S, C]
    src_ok = jnp.concatenate([jnp.ones((S, 1), bool),
                              jnp.take_along_axis(sibling, order, axis=1)], axis=1)
    corpora = [hist[src_rows]]  # [S, C, Lh]
    # Valid match ends j: own row before ``cur`` (the suffix itself ends at cur);
    # sibling rows before their last token (at least one continuation token).
    limit = jnp.where(src_rows == rows[:, None], cur[:, None], ctx.length[src_rows])  # [S, C]
    valid = [src_ok[:, :, None] & (jnp.arange(Lh)[None, None, :] < limit[:, :, None])]
    R = ctx.reference.shape[1]
    W = max(Lh, R)  # rank bands: own row > siblings > references; later positions first
    ranks = [jnp.where(jnp.arange(1 + G)[None, :, None] == 0, 2 * W, W)
             + jnp.arange(Lh)[None, None, :]]
    if R:  # earlier rollouts of this prompt: lowest rank
      corpora.append(ctx.reference[:, None, :])
      valid.append(jnp.broadcast_to(jnp.arange(R) < R - 1, (S, 1, R)))
      ranks.append(jnp.arange(R)[None, None, :])
    best = [jnp.full((S,), -1, jnp.int32) for _ in corpora]  # best rank per corpus
    best_at = [jnp.zeros((S,), jnp.int32) for _ in corpora]  # flat index of that match
    match = [v for v in valid]
    for n in range(1, self.max_ngram + 1):  # incremental: n-gram = (n-1)-gram & one more
      want = jnp.take_along_axis(hist, jnp.maximum(cur - (n - 1), 0)[:, None], axis=1)[:, 0]
      has_suffix = cur >= n - 1
      for c, corpus in enumerate(corpora):
        L = corpus.shape[-1]
        back = jnp.pad(corpus, ((0, 0), (0, 0), (n - 1, 0)), constant_values=-2)[..., :L]
        match[c] = match[c] & (back == want[:, None, None]) & has_suffix[:, None, None]
        if n < self.min_ngram:
          continue
        score = jnp.where(match[c], ranks[c], -1).reshape(S, -1)
        top = jnp.max(score, axis=1)
        hit = top >= 0  # a longer n overrides a shorter one
        best[c] = jnp.where(hit, top + n * 3 * W, best[c])  # longer n first
        best_at[c] = jnp.where(hit, jnp.argmax(score, axis=1), best_at[c])

    # Pick the corpus with the best (longest n, then rank) match; read K tokens after it.
    scores = jnp.stack(best, 1)  # [S, #corpora]
    c_star = jnp.argmax(scores, axis=1)
    found = jnp.max(scores, axis=1) >= 0
    drafts = jnp.full((S, K), -1, jnp.int32)
    for c, corpus in enumerate(corpora):
      L = corpus.shape[-1]
      row, end = best_at[c] // L, best_at[c] % L
      take = end[:, None] + 1 + jnp.arange(K)[None, :]  # [S, K]
      toks = jnp.take_along_axis(corpus[rows, row], jnp.minimum(take, L - 1), axis=1)
      if c == 0:  # history rows end at their slot's current length
        row_end = jnp.where(row == 0, cur, ctx.length[src_rows[rows, row]])
        toks = jnp.where(take <= row_end[:, None], toks, -1)
      toks = jnp.where(take < L, toks, -1)
      drafts = jnp.where((c_star == c)[:, None], toks, drafts)
    drafts = jnp.where(found[:, None] & (drafts >= 0), drafts, ctx.last[:, None])
    return drafts.astype(jnp.int32), None, state
