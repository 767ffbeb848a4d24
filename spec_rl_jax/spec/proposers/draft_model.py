"""``draft_model``: a small external model with its own paged KV cache.

The draft cache has its own pools (its own layers, KV heads, head dim) but shares the
target's page table: position ``j`` of a slot sits in the same page id in both, so
admission, release, preemption and rollback stay one piece of bookkeeping.

Each round, for every slot (``S`` slots, ``k`` drafts, ``V`` vocab):
  1. catch up: feed ``[history[length-1], last]`` at positions ``[length-1, length]``.
     Re-writing ``length-1`` is harmless (same token) and covers the one position the
     draft never saw when the previous round accepted all ``k`` drafts;
  2. sample ``x_1 ~ q_1`` from the processed draft distribution, then feed ``x_i`` at
     ``length+i`` for ``i = 1..k-1`` to get ``q_{i+1}``.
Drafts at rejected positions stay in the draft cache and are overwritten later. After
plain AR calls (``k = 0``) the engine re-prefills the draft cache (``catches_up``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from flax import nnx

from spec_rl_jax import checkpoint
from spec_rl_jax.models import transformer
from spec_rl_jax.models.tokenizer import Tokenizer
from spec_rl_jax.models.transformer import Decoder
from spec_rl_jax.rollout.paged_cache import PagedKVCache
from spec_rl_jax.spec.proposers.base import (DraftContext, PrefillBatch, Proposer,
                                             ProposerState, register, sample_drafts)


def check_tokenizers_match(policy: Tokenizer, draft: Tokenizer) -> None:
  """Raises if the draft tokenizer would map text to different ids than the policy's."""
  pv, dv = policy.backend.get_vocab(), draft.backend.get_vocab()
  if pv != dv:
    only_p = sorted(set(pv) - set(dv))[:5]
    differ = sorted(t for t in set(pv) & set(dv) if pv[t] != dv[t])[:5]
    raise ValueError(
        f"draft tokenizer does not match the policy's ({len(dv)} vs {len(pv)} tokens;"
        f" missing from draft e.g. {only_p}; different ids e.g. {differ}). Speculative"
        " decoding needs the same token ids.")
  if policy.eos_ids != draft.eos_ids:
    raise ValueError(f"draft EOS ids {draft.eos_ids} differ from the policy's {policy.eos_ids}")


@dataclasses.dataclass(frozen=True)
class DraftModelConfig:
  """``path``: the draft checkpoint (HF directory or run); relative = under the cache."""

  path: str = "draft"


@register
class DraftModelProposer(Proposer):
  """Drafts with a smaller `Decoder` sharing the policy's vocabulary."""

  name = "draft_model"
  Config = DraftModelConfig
  catches_up = True

  def __init__(self, config: DraftModelConfig, model: Decoder,
               tokenizer: Tokenizer | None = None, policy_tokenizer: Tokenizer | None = None):
    super().__init__(config)
    if tokenizer is not None and policy_tokenizer is not None:
      check_tokenizers_match(policy_tokenizer, tokenizer)
    self.model_config = model.cfg
    self._model = model
    self._graphdef = nnx.graphdef(model)

  @classmethod
  def build(cls, config: DraftModelConfig, policy, tokenizer=None, mesh=None):
    path = checkpoint.resolve_path(config.path)
    # Loaded onto ``mesh``: in a multi-host run each process reads its shards.
    draft, draft_tok = checkpoint.load_model(path, policy.cfg.attention_impl, mesh)
    return cls(config, draft, draft_tok, tokenizer)

  @property
  def vocab_size(self) -> int:
    return self.model_config.vocab_size

  def model(self) -> Decoder:
    return self._model

  def set_model(self, model: Decoder) -> None:
    if model.cfg != self.model_config:
      raise ValueError("set_model needs a draft model with the same ModelConfig")
    self._model = model

  def init_state(self, engine_config) -> ProposerState:
    c = engine_config
    cache = PagedKVCache.init(self.model_config, 1, c.num_pages, c.page_size, 1)
    return ProposerState(pools=cache.layers)

  def _apply(self, weights, tokens, positions, pools, page_table, **kw):
    out = transformer.apply(self._graphdef, weights, tokens, positions,
                            cache=PagedKVCache(pools, page_table), **kw)
    return out.logits, out.cache.layers

  def prefill(self, weights, state: ProposerState, batch: PrefillBatch) -> ProposerState:
    _, pools = self._apply(weights, batch.tokens, batch.positions, state.pools, batch.pages,
                           logits_at=jnp.zeros((batch.tokens.shape[0], 1), jnp.int32))
    return state.replace(pools=pools)

  def propose(self, weights, state: ProposerState, ctx: DraftContext, num_draft: int,
              sampling):
    S = ctx.last.shape[0]
    apply = functools.partial(self._apply, weights, page_table=ctx.page_table)
    prev = jnp.take_along_axis(ctx.history, jnp.maximum(ctx.length - 1, 0)[:, None], 1)[:, 0]
    pos = jnp.where(ctx.active[:, None], ctx.length[:, None] + jnp.arange(-1, 1), -1)
    logits, pools = apply(jnp.stack([prev, ctx.last], 1), pos, state.pools,
                          logits_at=jnp.ones((S, 1), jnp.int32))

    def step(pools, x, i):
      p = jnp.where(ctx.active, ctx.length + i, -1)[:, None]
      logits, pools = apply(x[:, None], p, pools)
      return pools, logits[:, 0]

    drafts, logprobs, pools = sample_drafts(step, pools, logits[:, 0], ctx, num_draft,
                                            sampling)
    return drafts, logprobs, state.replace(pools=pools)
