"""``draft_model``: a small external model with its own paged KV cache.

The draft cache has its own pools (its own layers, KV heads, head dim) but shares the
target's page table: position ``j`` of a slot sits in the same page id in both, so
admission, release and rollback stay one piece of bookkeeping.

Each round, for every slot (``S`` slots, ``K`` drafts, ``V`` vocab):
  1. catch up: feed ``[history[length-1], last]`` at positions ``[length-1, length]``.
     Re-writing ``length-1`` is harmless (same token) and covers the one position the
     draft never saw when the previous round accepted all ``K`` drafts;
  2. sample ``x_1 ~ q_1`` from the processed draft distribution, then feed ``x_i`` at
     ``length+i`` for ``i = 1..K-1`` to get ``q_{i+1}``.
Drafts at rejected positions stay in the draft cache and are overwritten later.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from spec_rl_jax.models.tokenizer import Tokenizer
from spec_rl_jax.models import transformer
from spec_rl_jax.models.transformer import Decoder
from spec_rl_jax.rollout.paged_cache import PagedKVCache
from spec_rl_jax.rollout.types import EngineConfig
from spec_rl_jax.spec.proposers.base import DraftContext, register, sample_drafts


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


@register("draft_model")
class DraftModelProposer:
  """Drafts with a smaller `Decoder` sharing the policy's vocabulary."""

  reads_other_slots = False

  def __init__(self, model: Decoder, tokenizer: Tokenizer | None = None,
               policy_tokenizer: Tokenizer | None = None):
    if tokenizer is not None and policy_tokenizer is not None:
      check_tokenizers_match(policy_tokenizer, tokenizer)
    self.model_config = model.cfg
    self._graphdef = nnx.graphdef(model)
    self._model = model
    self._laid_out: tuple[int, transformer.Weights] | None = None  # (rows, weights)

  def params(self, rows):
    if self._laid_out is None or self._laid_out[0] != rows:
      self._laid_out = rows, transformer.inference_weights(self._model, rows)
    return self._laid_out[1]

  @property
  def vocab_size(self) -> int:
    return self.model_config.vocab_size

  def update_params(self, model: Decoder) -> None:
    if model.cfg != self.model_config:
      raise ValueError("update_params needs a draft model with the same ModelConfig")
    self._model, self._laid_out = model, None

  def init_state(self, config: EngineConfig) -> PagedKVCache:
    return PagedKVCache.init(self.model_config, config.num_slots, config.num_pages,
                             config.page_size, config.max_pages_per_slot)

  def prefill(self, params, state: PagedKVCache, tokens, positions, pages) -> PagedKVCache:
    out = transformer.apply(self._graphdef, params, tokens, positions,
                            cache=state.replace(page_table=pages),
                            logits_at=jnp.zeros((tokens.shape[0], 1), jnp.int32))
    return out.cache.replace(page_table=state.page_table)

  def propose(self, params, state: PagedKVCache, ctx: DraftContext, num_draft: int,
              sampling):
    model = functools.partial(transformer.apply, self._graphdef, params)
    S = ctx.last.shape[0]
    cache = state.replace(page_table=ctx.page_table)
    prev = jnp.take_along_axis(ctx.history, jnp.maximum(ctx.length - 1, 0)[:, None], 1)[:, 0]
    pos = jnp.where(ctx.active[:, None], ctx.length[:, None] + jnp.arange(-1, 1), -1)
    out = model(jnp.stack([prev, ctx.last], 1), pos, cache=cache,
                logits_at=jnp.ones((S, 1), jnp.int32))

    def step(cache, x, i):
      p = jnp.where(ctx.active, ctx.length + i, -1)[:, None]
      o = model(x[:, None], p, cache=cache)
      return o.cache, o.logits[:, 0]

    drafts, logprobs, cache = sample_drafts(step, out.cache, out.logits[:, 0], ctx, num_draft,
                                            sampling)
    return drafts, logprobs, cache.replace(page_table=state.page_table)
