"""``mtp``: DeepSeek-V3-shaped multi-token-prediction heads (models/mtp.py) draft from
the policy's own last hidden state; draft ``d`` comes from module ``d``.

Notation of models/mtp.py: module ``d`` at position ``j`` reads the token ``t_j`` and
``h^{d-1}_{j-1}`` and predicts ``t_{j+1}``; ``h^0`` is the policy's last layer. ``ℓ`` is
a slot's ``length`` (tokens in the policy's KV cache); its newest token ``t_ℓ`` (``last``)
is known, its ``h^0_ℓ`` is not (the verification computes it).

Device state:
  pools      one paged KV pool whose layers are the ``D_m`` modules, on the policy's
             page table; after every call it holds each module's keys at the positions
             ``< ℓ`` (and anything at positions ``>= ℓ``: rewritten before it is read).
  rows ``h`` ``[S, D_m, D]``: ``h^{d-1}_{ℓ-1}`` for ``d = 1..D_m``, the features the
             modules read at position ``ℓ`` (``h^0_{ℓ-1}``, then the modules' own).

A round (``k <= D_m`` drafts; ``u`` the uniforms of `base.draft_key`, as `sample_drafts`):
  1. every module at position ``ℓ`` with ``t_ℓ`` and its row (one position each, all
     independent): ``h^d_ℓ`` and the modules' keys at ``ℓ``;
  2. ``x_1 ~ q_1`` from ``head(h^1_ℓ)``;
  3. for ``d = 2..k``: module ``d`` over the window ``ℓ+1 .. ℓ+d-1`` with tokens
     ``x_1..x_{d-1}`` and features ``[h^{d-1}_ℓ, module d-1's window outputs]``; its
     output at ``ℓ+d-1`` gives ``q_d``, and ``x_d ~ q_d``.
  observe (``n`` tokens emitted, ``ℓ' = ℓ + n``): the chain of modules over the verified
  window ``ℓ .. ℓ+k`` with the true tokens there (``last``, then ``tokens[:n]``) and
  ``h^0`` from the verification, keeping ``h^{d-1}_{ℓ'-1}`` (column ``n - 1``) as the new
  rows. Columns ``>= n`` sit at positions ``>= ℓ'``, which the next round rewrites before
  any query reads them.

Positions written stay below ``ℓ + k + 1``, the room the engine guarantees a round:
the newest token's keys are written at the start of the next round (step 1), not at
the end of this one, where an all-accepted round would need position ``ℓ + k + 1``.
Drafts cost ``D_m + k(k-1)/2`` module positions per slot, the observe ``D_m (k+1)``.

Shape legend: ``S`` slots, ``k`` draft length, ``D_m`` modules, ``D`` model dim, ``V``
vocab, ``B`` prefill batch, ``T`` prefill length.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spec_rl_jax import checkpoint, sharding
from spec_rl_jax.models import mtp
from spec_rl_jax.models.eagle3 import policy_fingerprint
from spec_rl_jax.models.transformer import Decoder
from spec_rl_jax.rollout.paged_cache import PagedKVCache
from spec_rl_jax.sampling import inverse_cdf, process_logits
from spec_rl_jax.spec.proposers.base import (DraftContext, Feedback, PrefillBatch, Proposer,
                                             ProposerState, draft_key, register)


@dataclasses.dataclass(frozen=True)
class MTPProposerConfig:
  """``path``: the heads' directory (`models.mtp.save_mtp`); relative = under the cache."""

  path: str = "mtp"


@register
class MTPProposer(Proposer):
  """Drafts ``k <= D_m`` tokens with the MTP heads of the policy."""

  name = "mtp"
  Config = MTPProposerConfig
  catches_up = True

  def __init__(self, config: MTPProposerConfig, heads: mtp.MTPHeads, policy: Decoder,
               fingerprint: str | None = None):
    super().__init__(config)
    heads.cfg.check_policy(policy.cfg, fingerprint)
    self.mtp_config = heads.cfg
    self.hidden_layers = heads.cfg.hidden_layers
    self._heads = heads
    self._graphdef = nnx.graphdef(heads)
    self._policy_graphdef = nnx.graphdef(policy)

  @classmethod
  def build(cls, config: MTPProposerConfig, policy, tokenizer=None, mesh=None):
    path = checkpoint.resolve_path(config.path)
    fingerprint = (policy_fingerprint(policy.cfg, tokenizer.backend.get_vocab())
                   if tokenizer is not None else None)
    heads = mtp.load_mtp(path, policy.cfg, fingerprint)
    if mesh is not None:  # loaded whole on the first device
      nnx.update(heads, sharding.device_put_state(nnx.state(heads), mesh))
    return cls(config, heads, policy, fingerprint)

  def model(self) -> mtp.MTPHeads:
    return self._heads

  def set_model(self, model: mtp.MTPHeads) -> None:
    if model.cfg != self.mtp_config:
      raise ValueError("set_model needs MTP heads with the same MTPConfig")
    self._heads = model

  @property
  def draft_limit(self) -> int:
    """One draft per module."""
    return self.mtp_config.num_modules

  # ---------------------------------------------------------------- device side

  def init_state(self, engine_config) -> ProposerState:
    c, Dm = engine_config, self.mtp_config.num_modules
    pcfg = self.mtp_config.policy
    cache = PagedKVCache.init(self.mtp_config.pool_config(), 1, c.num_pages, c.page_size, 1)
    return ProposerState(pools=cache.layers,
                         rows={"h": jnp.zeros((c.num_slots, Dm, pcfg.embed_dim), pcfg.dtype)})

  def request_rows(self, request) -> dict[str, np.ndarray]:
    del request  # prefill writes the rows
    pcfg = self.mtp_config.policy
    return {"h": np.zeros((self.mtp_config.num_modules, pcfg.embed_dim), pcfg.dtype)}

  def _setup(self, weights, target_weights):
    return (nnx.merge(self._graphdef, weights.state),
            mtp.policy_tables(self._policy_graphdef, target_weights.state))

  def prefill(self, weights, state: ProposerState, batch: PrefillBatch) -> ProposerState:
    heads, tables = self._setup(weights, batch.target_weights)
    h0 = batch.hidden[0]  # [B, T, D]
    e = jnp.take(tables.embed, batch.tokens, axis=0)
    first = jnp.zeros((self.mtp_config.num_modules,) + h0[:, 0].shape, h0.dtype)
    h, cache = heads.chain(e, h0, first, batch.positions,
                           PagedKVCache(state.pools, batch.pages))
    feats = jnp.concatenate([h0[None], h[:-1].astype(h0.dtype)], 0)[:, :, -1]  # [D_m, B, D]
    rows = state.rows["h"].at[batch.slots].set(feats.transpose(1, 0, 2), mode="drop")
    return ProposerState(pools=cache.layers, rows={"h": rows})

  def propose(self, weights, state: ProposerState, ctx: DraftContext, num_draft: int,
              sampling):
    heads, tables = self._setup(weights, ctx.target_weights)
    embed = lambda t: jnp.take(tables.embed, t, axis=0)
    cache = PagedKVCache(state.pools, ctx.page_table)
    # 1. Every module at ℓ: with T = 1 the chain feeds each module its own row.
    pos = jnp.where(ctx.active, ctx.length, -1)[:, None]
    first = state.rows["h"].transpose(1, 0, 2)  # [D_m, S, D]
    at_len, cache = heads.chain(embed(ctx.last[:, None]), jnp.zeros_like(first[0][:, None]),
                                first, pos, cache)  # [D_m, S, 1, D]: h^d_ℓ

    # `sample_drafts`' uniforms and processing, unrolled: draft d runs module d over a
    # window that grows with d, which one scanned step function cannot express.
    keys = draft_key(ctx.key, ctx.rid, ctx.length + 1)
    u = jax.vmap(lambda k: jax.random.uniform(k, (num_draft,)))(keys)  # [S, k]

    def draw(logits, i):
      lp = process_logits(logits, sampling, ctx.temperature)  # [S, V]
      return inverse_cdf(u[:, i], jnp.exp(lp)), lp

    # 2. x_1 from module 1 at ℓ.
    x, lp = draw(heads.logits(at_len[0, :, 0], tables.head, 0), 0)
    drafts, logprobs = [x], [lp]
    window = at_len[0][:, :0]  # module d-1's outputs at ℓ+1 .. ℓ+d-2 (none for d = 2)
    # 3. Module d (0-based i = d - 1) over ℓ+1 .. ℓ+d-1.
    for i in range(1, num_draft):
      g = jnp.concatenate([at_len[i - 1], window], 1)  # [S, i, D]
      pos = jnp.where(ctx.active[:, None], ctx.length[:, None] + 1 + jnp.arange(i), -1)
      window, cache = heads.module(i, embed(jnp.stack(drafts, 1)), g, pos, cache)
      x, lp = draw(heads.logits(window[:, -1], tables.head, i), i)
      drafts.append(x)
      logprobs.append(lp)
    return (jnp.stack(drafts, 1), jnp.stack(logprobs, 1),
            state.replace(pools=cache.layers))

  def observe(self, weights, state: ProposerState, fb: Feedback) -> ProposerState:
    heads, tables = self._setup(weights, fb.target_weights)
    n = fb.num_emitted
    h0 = fb.hidden[0]  # [S, k+1, D]: h^0 at ℓ .. ℓ+k
    # The true token at ℓ + i is inputs[0] (i = 0), then tokens[i - 1] for i <= n.
    tokens = jnp.concatenate([fb.inputs[:, :1], fb.tokens[:, :-1]], 1)
    pos = jnp.where((n > 0)[:, None], fb.positions, -1)
    first = state.rows["h"].transpose(1, 0, 2)
    h, cache = heads.chain(jnp.take(tables.embed, tokens, axis=0), h0, first, pos,
                           PagedKVCache(state.pools, fb.page_table))
    feats = jnp.concatenate([h0[None], h[:-1].astype(h0.dtype)], 0)  # [D_m, S, k+1, D]
    col = jnp.maximum(n - 1, 0)[None, :, None, None]  # ℓ' - 1
    new = jnp.take_along_axis(feats, col, axis=2)[:, :, 0].transpose(1, 0, 2)  # [S, D_m, D]
    rows = jnp.where((n > 0)[:, None, None], new, state.rows["h"])
    return ProposerState(pools=cache.layers, rows={"h": rows})
