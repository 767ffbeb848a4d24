"""``eagle3``: a one-layer head that drafts from the policy's own features (EAGLE-3).

The head (models/eagle3.py) has its own one-layer paged KV cache, sharing the policy's
page table. Token ``j``'s key, at the head's position ``j - 1``, is a projection of
``(t_j, g_{j-1})``; at true positions ``g`` is the fused policy feature, so those keys
are written by projections alone (`Eagle3Head.write`). Per slot (``S`` slots, ``k``
drafts, ``D`` model dim):

  prefill   keys of the prompt's tokens 1.. (token 0 has no pair); ``rows["feat"]`` =
            ``g_{length-1}``, the fused feature of the last prompt token.
  propose   step 0 runs the layer on ``(last, rows["feat"])`` (token ``length``): its
            output ``a_length`` gives ``q_1``; step ``i`` feeds ``(x_i, a_{length+i-1})``
            (token ``length + i``), the head's own output in place of the policy's.
  observe   the verification returned the policy's features at ``length + i``
            (``i = 0..k``): keys of tokens ``length + 1 .. length + k`` are rewritten
            from them (drafted keys replaced by true ones where accepted; past the new
            length they are overwritten later) and ``rows["feat"] = g_{new length - 1}``.

After plain AR calls (``k = 0``) the engine re-prefills the head's cache
(``catches_up``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from flax import nnx

from spec_rl_jax import checkpoint, sharding
from spec_rl_jax.models import eagle3
from spec_rl_jax.models.eagle3 import Eagle3Head
from spec_rl_jax.rollout.paged_cache import PagedKVCache
from spec_rl_jax.spec.proposers.base import (DraftContext, Feedback, PrefillBatch, Proposer,
                                             ProposerState, register, sample_drafts)


@dataclasses.dataclass(frozen=True)
class Eagle3ProposerConfig:
  """``path``: the head's checkpoint (the public Eagle3 layout, models/eagle3_io.py);
  relative = under the cache."""

  path: str = "eagle3"


@register
class Eagle3Proposer(Proposer):
  """Drafts with an `Eagle3Head` over the policy's features."""

  name = "eagle3"
  Config = Eagle3ProposerConfig
  catches_up = True

  def __init__(self, config: Eagle3ProposerConfig, head: Eagle3Head, policy,
               policy_vocab: dict[str, int] | None = None):
    super().__init__(config)
    head.cfg.check_policy(policy.cfg, eagle3.policy_fingerprint(policy.cfg, policy_vocab)
                          if policy_vocab is not None else None)
    self.head_config = head.cfg
    self.hidden_layers = head.cfg.hidden_layers
    self._head = head
    self._graphdef = nnx.graphdef(head)
    self._policy_graphdef = nnx.graphdef(policy)

  @classmethod
  def build(cls, config: Eagle3ProposerConfig, policy, tokenizer=None, mesh=None):
    from spec_rl_jax.models import eagle3_io  # noqa: PLC0415 (safetensors reader)
    path = checkpoint.resolve_path(config.path)
    head = eagle3_io.load_eagle3(path, policy.cfg)
    if mesh is not None:  # loaded whole on the first device
      nnx.update(head, sharding.device_put_state(nnx.state(head), mesh))
    vocab = tokenizer.backend.get_vocab() if tokenizer is not None else None
    return cls(config, head, policy, vocab)

  @property
  def vocab_size(self) -> int:
    return self.head_config.vocab_size

  def model(self) -> Eagle3Head:
    return self._head

  def set_model(self, model: Eagle3Head) -> None:
    if model.cfg != self.head_config:
      raise ValueError("set_model needs an Eagle3 head with the same Eagle3Config")
    self._head = model

  def init_state(self, engine_config) -> ProposerState:
    c = engine_config
    cache = PagedKVCache.init(self.head_config.layer_config(), 1, c.num_pages, c.page_size, 1)
    feat = jnp.zeros((c.num_slots, self.head_config.embed_dim),
                     self.head_config.layer_config().dtype)
    return ProposerState(pools=cache.layers, rows={"feat": feat})

  def request_rows(self, request) -> dict[str, np.ndarray]:
    del request
    return {"feat": np.zeros((self.head_config.embed_dim,),
                             self.head_config.layer_config().dtype)}

  def _head_and_embed(self, weights, target_weights):
    head = nnx.merge(self._graphdef, weights.state)
    return head, functools.partial(eagle3.embed, target_weights, self._policy_graphdef)

  def prefill(self, weights, state: ProposerState, batch: PrefillBatch) -> ProposerState:
    head, embed = self._head_and_embed(weights, batch.target_weights)
    g = head.fuse(batch.hidden)  # [n, T, D]
    prev = jnp.concatenate([jnp.zeros_like(g[:, :1]), g[:, :-1]], 1)
    # Token j's pair at j - 1: token 0 (and padding) lands at a negative position, dropped.
    cache = head.write(embed(batch.tokens), prev, batch.positions - 1,
                       PagedKVCache(state.pools, batch.pages))
    feat = state.rows["feat"].at[batch.slots].set(g[:, -1], mode="drop")
    return state.replace(pools=cache.layers, rows={"feat": feat})

  def propose(self, weights, state: ProposerState, ctx: DraftContext, num_draft: int,
              sampling):
    head, embed = self._head_and_embed(weights, ctx.target_weights)

    def layer(tokens, g, pos, pools):
      """Tokens ``tokens [S]`` at ``pos [S]`` with features ``g [S, D]`` → ``(a [S, D],
      pools)``."""
      p = jnp.where(ctx.active, pos - 1, -1)[:, None]  # token j's pair at j - 1
      a, cache = head(embed(tokens)[:, None], g[:, None], p,
                      PagedKVCache(pools, ctx.page_table))
      return a[:, 0], cache.layers

    a, pools = layer(ctx.last, state.rows["feat"], ctx.length, state.pools)

    def step(carry, x, i):
      pools, a = carry
      a, pools = layer(x, a, ctx.length + i, pools)
      return (pools, a), head.policy_logits(a)

    drafts, logprobs, (pools, _) = sample_drafts(step, (pools, a), head.policy_logits(a), ctx,
                                                 num_draft, sampling)
    return drafts, logprobs, state.replace(pools=pools)

  def observe(self, weights, state: ProposerState, feedback: Feedback) -> ProposerState:
    fb = feedback
    head, embed = self._head_and_embed(weights, fb.target_weights)
    g = head.fuse(fb.hidden)  # [S, k+1, D]: features at length + i
    pos = jnp.where(fb.positions[:, 1:] >= 0, fb.positions[:, 1:] - 1, -1)  # pairs at j - 1
    cache = head.write(embed(fb.inputs[:, 1:]), g[:, :-1], pos,
                       PagedKVCache(state.pools, fb.page_table))
    last = jnp.take_along_axis(g, jnp.maximum(fb.num_emitted - 1, 0)[:, None, None], 1)[:, 0]
    feat = jnp.where((fb.num_emitted > 0)[:, None], last, state.rows["feat"])
    return state.replace(pools=cache.layers, rows={"feat": feat})
