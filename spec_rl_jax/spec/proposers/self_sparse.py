"""``self_sparse``: the policy drafts for itself with sparse attention (S³R).

No second model: draft step ``i`` runs the *policy's own weights* on ``x_i`` at position
``length + i`` (``x_0 = last``), but every layer attends only

  (a) the selected pages of the policy's paged cache (positions ``< length``): the
      first ``n_sink`` pages (attention sinks), the last ``n_window`` used pages and
      the top pages by the Quest score ``sum_d max(q_d min_d, q_d max_d)`` over the
      per-page key bounds, up to a budget of pages (a fixed count, or a fraction of the
      slot's used pages); and
  (b) a ``K``-row scratch buffer with the keys/values of the draft steps themselves
      (positions ``length .. length + i``),

merged by log-sum-exp (`kernels_pallas.merge_partials`). The verifier then runs the
usual full-attention forward over the ``K + 1`` positions, which writes their KV into
the cache. Drafting never writes the policy's cache, so verification sees exactly what
AR decoding would, and the key bounds stay tight. The draft distribution ``q`` is the
policy's sparse-attention distribution with the same sampling processing as ``p``;
the rejection sampler makes the output exactly the policy's whatever the budget.

Selection is chosen at draft step 0 and reused for the round's remaining steps (the
default), or refreshed at every draft step with that step's own queries
(``reselect=True``). Reuse skips the per-step scoring of every page's key bounds and,
in ``bench.sparse``, loses no acceptance (docs/benchmarks.md).

Shape legend: ``S`` slots, ``K`` draft length, ``L`` layers, ``H`` query heads, ``Hk``
KV heads, ``G = H // Hk``, ``Dh`` head dim, ``M`` pages per slot, ``B`` selected pages,
``Ps`` page size, ``V`` vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx, struct

import kernels_pallas
from spec_rl_jax.models import transformer
from spec_rl_jax.models.transformer import Decoder
from spec_rl_jax.spec.proposers.base import DraftContext, Proposer, register, sample_drafts


@dataclasses.dataclass(frozen=True)
class PageBudget:
  """Which pages a sparse draft step reads, per slot and KV head.

  Exactly one of ``pages`` (a fixed count ``B``, sinks and window included) and
  ``fraction`` (``ceil(fraction * used pages)``, at least ``n_sink + n_window``) is set.
  """

  n_sink: int = 1
  n_window: int = 2
  pages: int = 0
  fraction: float = 0.0

  def __post_init__(self):
    if (self.pages > 0) == (self.fraction > 0):
      raise ValueError(f"set exactly one of pages ({self.pages}) and fraction"
                       f" ({self.fraction}) for the self-sparse page budget")
    if not 0 <= self.fraction <= 1:
      raise ValueError(f"budget fraction must be in (0, 1], got {self.fraction}")
    if min(self.n_sink, self.n_window) < 0 or self.n_sink + self.n_window < 1:
      raise ValueError("n_sink and n_window must be >= 0 with at least one page fixed")

  def size(self, max_pages: int) -> int:
    """Static ``B`` for slots of ``max_pages`` pages."""
    fixed = self.n_sink + self.n_window
    want = self.pages if self.pages else math.ceil(self.fraction * max_pages)
    return max(fixed, min(want, max_pages))

  def choose(self, q, k_min, k_max, page_table, kv_lens, page_size):
    """``(sel_idx, sel_valid) [S, Hk, B]`` for queries ``q [S, 1, H, Dh]``."""
    B = self.size(page_table.shape[1])
    idx, ok = kernels_pallas.select_pages(
        q, k_min, k_max, page_table, kv_lens, page_size=page_size, n_sink=self.n_sink,
        n_window=self.n_window, top_k=B - self.n_sink - self.n_window)
    if self.fraction:  # entries are sinks, window, then top-k best first: cut the tail
      used = (kv_lens + page_size - 1) // page_size  # [S]
      keep = jnp.maximum(jnp.ceil(self.fraction * used).astype(jnp.int32),
                         self.n_sink + self.n_window)
      ok &= jnp.arange(B)[None, None, :] < keep[:, None, None]
    return idx, ok


def scratch_attention(q, k, v, step):
  """Causal attention of ``q [S, 1, H, Dh]`` over scratch rows ``0..step`` of
  ``k, v [S, K, Hk, Dh]``; ``(out [S, 1, H, Dh], m, l [S, 1, H])`` like
  `kernels_pallas.sparse_attention`, to be merged with it."""
  S, _, H, Dh = q.shape
  K, Hk = k.shape[1], k.shape[2]
  qg = q.reshape(S, Hk, H // Hk, Dh).astype(jnp.float32)
  logits = jnp.einsum("skgd,sjkd->skgj", qg, k.astype(jnp.float32)) * Dh ** -0.5
  logits = jnp.where(jnp.arange(K) <= step, logits, -jnp.inf)  # [S, Hk, G, K]
  m = logits.max(-1)  # row 0 is always visible: finite
  p = jnp.exp(logits - m[..., None])
  l = p.sum(-1)
  out = jnp.einsum("skgj,sjkd->skgd", p, v.astype(jnp.float32)) / l[..., None]
  return out.reshape(S, 1, H, Dh), m.reshape(S, 1, H), l.reshape(S, 1, H)


@struct.dataclass
class SparseDraftView:
  """Attention context of one draft step (see models/attention.py for the protocol).

  ``layers = (k_scratch, v_scratch [L, S, K, Hk, Dh], sel_idx, sel_valid [L, S, Hk, B])``
  rides in the layer scan; the policy's pools are read only.
  """

  pools: tuple  # the policy cache's (k_pages, v_pages, k_min, k_max), [L, ...]
  page_table: jax.Array  # [S, M]
  ctx_len: jax.Array  # [S]: positions in the pools (the slots' ``length``)
  step: jax.Array  # int32: this step's scratch row ``i``
  layers: tuple
  budget: PageBudget = struct.field(pytree_node=False)
  select: bool = struct.field(pytree_node=False)  # choose pages now, else reuse

  def attend(self, impl, layers, l, q, k, v, positions):
    del positions  # the step's position is ctx_len + step; inactive slots are ignored
    k_scr, v_scr, sel_idx, sel_valid = layers
    k_pages, v_pages, k_min, k_max = (x[l] for x in self.pools)
    k_scr = k_scr.at[l, :, self.step].set(k[:, 0].astype(k_scr.dtype))
    v_scr = v_scr.at[l, :, self.step].set(v[:, 0].astype(v_scr.dtype))
    if self.select:
      idx, ok = self.budget.choose(q, k_min, k_max, self.page_table, self.ctx_len,
                                   k_pages.shape[2])
      sel_idx, sel_valid = sel_idx.at[l].set(idx), sel_valid.at[l].set(ok)
    else:
      idx, ok = sel_idx[l], sel_valid[l]
    pages = impl.sparse(q, k_pages, v_pages, self.page_table, self.ctx_len, idx, ok)
    own = scratch_attention(q, k_scr[l], v_scr[l], self.step)
    out, _, _ = kernels_pallas.merge_partials(*(jnp.stack(x) for x in zip(pages, own)))
    return out, (k_scr, v_scr, sel_idx, sel_valid)

  def replace(self, **kw):
    return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class SelfSparseConfig:
  """The page budget (`PageBudget` with ``fraction = budget``) and whether pages are
  chosen at every draft step (``reselect``) or once per round."""

  budget: float = 0.25  # fraction of the context's KV pages a draft step reads
  sinks: int = 1  # first pages always read
  window: int = 2  # newest pages always read
  reselect: bool = False

  def page_budget(self) -> PageBudget:
    return PageBudget(n_sink=self.sinks, n_window=self.window, fraction=self.budget)


@register
class SelfSparseProposer(Proposer):
  """Drafts with the policy itself under a sparse-attention page budget."""

  name = "self_sparse"
  Config = SelfSparseConfig

  def __init__(self, config: SelfSparseConfig, policy: Decoder):
    super().__init__(config)
    self.budget = config.page_budget()  # validates the budget before any device work
    self.model_config = policy.cfg
    self._graphdef = nnx.graphdef(policy)

  @classmethod
  def build(cls, config: SelfSparseConfig, policy, tokenizer=None, mesh=None):
    del tokenizer, mesh
    return cls(config, policy)

  def propose(self, weights, state, ctx: DraftContext, num_draft: int, sampling):
    del weights  # drafts with the policy's weights (DraftContext.target_weights)
    model = functools.partial(transformer.apply, self._graphdef, ctx.target_weights)
    cfg, S = self.model_config, ctx.last.shape[0]
    k_pages = ctx.cache.layers[0]
    B = self.budget.size(ctx.page_table.shape[1])
    scratch = (cfg.num_layers, S, num_draft, cfg.num_kv_heads, cfg.head_dim)
    layers = (jnp.zeros(scratch, k_pages.dtype), jnp.zeros(scratch, k_pages.dtype),
              jnp.zeros((cfg.num_layers, S, cfg.num_kv_heads, B), jnp.int32),
              jnp.zeros((cfg.num_layers, S, cfg.num_kv_heads, B), bool))

    def forward(layers, x, i, select):
      view = SparseDraftView(pools=ctx.cache.layers, page_table=ctx.page_table,
                             ctx_len=ctx.length, step=jnp.int32(i), layers=layers,
                             budget=self.budget, select=select)
      pos = jnp.where(ctx.active, ctx.length + i, -1)[:, None]
      out = model(x[:, None], pos, cache=view)
      return out.cache.layers, out.logits[:, 0]

    layers, logits = forward(layers, ctx.last, 0, True)
    step = lambda layers, x, i: forward(layers, x, i, self.config.reselect)
    drafts, logprobs, _ = sample_drafts(step, layers, logits, ctx, num_draft, sampling)
    return drafts, logprobs, state
