"""``ngram``: model-free drafts by suffix matching (prompt lookup; SPEC-RL / DAS idea).

For each slot the last ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``)
are searched in three corpora, and the ``K`` tokens that followed the match become the
draft (a point mass: ``q(x) = 1``):
  * the slot's own prompt and response so far,
  * the sibling responses of the same prompt group (other slots with the same group
    id — GRPO samples several responses per prompt; finished siblings still count
    until their slot is reused),
  * ``reference``: earlier rollouts of the same prompt, kept by this proposer across RL
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

import collections
import dataclasses

import jax.numpy as jnp
import numpy as np

from spec_rl_jax.spec.proposers.base import DraftContext, Proposer, ProposerState, register

ROLLOUTS_PER_PROMPT = 4  # earlier rollouts of a prompt kept as references


@dataclasses.dataclass(frozen=True)
class NGramConfig:
  """Suffix lengths ``min_ngram..max_ngram``; ``max_siblings`` sibling rows searched;
  ``reference_len`` (``R``) tokens of earlier rollouts of the prompt (0: none kept)."""

  max_ngram: int = 4
  min_ngram: int = 1
  max_siblings: int = 8
  reference_len: int = 0

  def __post_init__(self):
    if not 1 <= self.min_ngram <= self.max_ngram:
      raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram},"
                       f" {self.max_ngram}")
    if self.max_siblings < 0 or self.reference_len < 0:
      raise ValueError("max_siblings and reference_len must be >= 0")


@register
class NGramProposer(Proposer):
  """Suffix-match drafting over own history, siblings and earlier rollouts.

  Host memory: the last `ROLLOUTS_PER_PROMPT` finished sequences (prompt + response)
  per prompt, newest first; a request's ``reference`` row is read from it at admission
  and the memory is checkpointed with the run (`host_state`).
  """

  name = "ngram"
  Config = NGramConfig
  reads_other_slots = True  # sibling rows are corpora

  def __init__(self, config: NGramConfig):
    super().__init__(config)
    self._memory: dict[tuple[int, ...], collections.deque] = {}

  def init_state(self, engine_config) -> ProposerState:
    R = self.config.reference_len
    if not R:
      return ProposerState()
    return ProposerState(rows={"reference": jnp.full((engine_config.num_slots, R), -1,
                                                      jnp.int32)})

  def request_rows(self, request) -> dict[str, np.ndarray]:
    """Earlier rollouts of the request's prompt (newest first), ``-1`` separated and
    padded to ``R``."""
    R = self.config.reference_len
    if not R:
      return {}
    row = np.full((R,), -1, np.int32)
    pos = 0
    for seq in self._memory.get(tuple(request.prompt), ()):
      take = min(len(seq), R - pos)
      row[pos:pos + take] = seq[:take]
      pos += take + 1
      if pos >= R:
        break
    return {"reference": row}

  def on_finished(self, request, tokens: list[int]) -> None:
    if self.config.reference_len:
      mem = self._memory.setdefault(tuple(request.prompt),
                                    collections.deque(maxlen=ROLLOUTS_PER_PROMPT))
      mem.appendleft(list(request.prompt) + list(tokens))

  def host_state(self) -> dict:
    """``{"prompts": [...], "rollouts": [[seq, ...], ...]}``, newest first."""
    prompts = list(self._memory)
    return {"prompts": [list(p) for p in prompts],
            "rollouts": [[list(s) for s in self._memory[p]] for p in prompts]}

  def load_host_state(self, state: dict) -> None:
    self._memory = {tuple(p): collections.deque((list(s) for s in seqs),
                                                maxlen=ROLLOUTS_PER_PROMPT)
                    for p, seqs in zip(state.get("prompts", []), state.get("rollouts", []))}

  def propose(self, weights, state: ProposerState, ctx: DraftContext, num_draft: int,
              sampling):
    del weights, sampling
    hist, K = ctx.history, num_draft
    S, Lh = hist.shape
    cur = ctx.length  # position of ``last`` in each slot's history
    rows = jnp.arange(S)
    # Corpus rows of slot s: [own, up to G siblings] (C = 1 + G), gathered so the cost
    # grows with the group size, not with S. Slots that never held a request of this
    # group sort last and are masked out.
    G = min(self.config.max_siblings, S - 1)
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
    reference = state.rows["reference"] if self.config.reference_len else None
    R = 0 if reference is None else reference.shape[1]
    W = max(Lh, R)  # rank bands: own row > siblings > references; later positions first
    ranks = [jnp.where(jnp.arange(1 + G)[None, :, None] == 0, 2 * W, W)
             + jnp.arange(Lh)[None, None, :]]
    if R:  # earlier rollouts of this prompt: lowest rank
      corpora.append(reference[:, None, :])
      valid.append(jnp.broadcast_to(jnp.arange(R) < R - 1, (S, 1, R)))
      ranks.append(jnp.arange(R)[None, None, :])
    best = [jnp.full((S,), -1, jnp.int32) for _ in corpora]  # best rank per corpus
    best_at = [jnp.zeros((S,), jnp.int32) for _ in corpora]  # flat index of that match
    match = [v for v in valid]
    for n in range(1, self.config.max_ngram + 1):  # incremental: n-gram = (n-1)-gram & one more
      want = jnp.take_along_axis(hist, jnp.maximum(cur - (n - 1), 0)[:, None], axis=1)[:, 0]
      has_suffix = cur >= n - 1
      for c, corpus in enumerate(corpora):
        L = corpus.shape[-1]
        back = jnp.pad(corpus, ((0, 0), (0, 0), (n - 1, 0)), constant_values=-2)[..., :L]
        match[c] = match[c] & (back == want[:, None, None]) & has_suffix[:, None, None]
        if n < self.config.min_ngram:
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
