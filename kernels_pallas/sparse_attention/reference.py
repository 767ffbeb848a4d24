"""Sparse draft attention and the partial-result merge in pure JAX.

`sparse_attention_reference` is the semantics of the Pallas kernel and its CPU/GPU
fallback: it gathers only the selected pages (``B`` per slot and KV head), so its
cost scales with the budget, not with the context. `merge_partials` combines results
over disjoint key sets by log-sum-exp; it is the one merge for every backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import validation

HIGHEST = jax.lax.Precision.HIGHEST


@functools.partial(jax.jit, static_argnames=("scale",))
def sparse_attention_reference(
    q: jax.Array,  # [S, Q, H, Dh]
    k_pages: jax.Array,  # [Hk, P, Ps, Dh]
    v_pages: jax.Array,  # [Hk, P, Ps, Dh]
    page_table: jax.Array,  # [S, M] int32
    kv_lens: jax.Array,  # [S] int32
    sel_idx: jax.Array,  # [S, Hk, B] int32 page slots (indices into page_table rows)
    sel_valid: jax.Array,  # [S, Hk, B] bool
    *,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # out [S, Q, H, Dh], m, l [S, Q, H]; fp32
  """Causal attention of the last ``Q`` positions of each slot over its selected pages.

  Query ``t`` sees the keys of valid selected pages at positions
  ``<= kv_lens[s] - Q + t``. Returns ``out`` normalised by ``l``, the row max ``m`` of
  the scaled logits and ``l = sum(exp(logits - m))``; a row that sees no key gives
  ``out = 0, m = -inf, l = 0``.
  """
  d = validation.check_paged_attention(q, k_pages, v_pages, page_table, kv_lens)
  B = validation.check_selection(d, sel_idx, sel_valid)
  S, Q, Hk, G, Dh, Ps = (d.slots, d.queries, d.kv_heads, d.group, d.head_dim,
                         d.page_size)
  scale = Dh ** -0.5 if scale is None else scale

  slots = jnp.clip(sel_idx, 0, d.max_pages - 1)
  ids = jnp.take_along_axis(page_table[:, None, :], slots, axis=2)  # [S, Hk, B]
  ids = jnp.clip(ids, 0, d.num_pages - 1)  # invalid entries may point anywhere
  key_pos = (sel_idx[..., None] * Ps + jnp.arange(Ps)).reshape(S, Hk, B * Ps)
  key_ok = (jnp.repeat(sel_valid & (sel_idx >= 0), Ps, axis=2)
            & (key_pos < kv_lens[:, None, None]))  # [S, Hk, B*Ps]

  def gather(pages):  # [Hk, P, Ps, Dh] -> [S, Hk, B*Ps, Dh], unread rows zeroed
    x = pages[jnp.arange(Hk)[None, :, None], ids].reshape(S, Hk, B * Ps, Dh)
    return jnp.where(key_ok[..., None], x, jnp.zeros((), x.dtype))

  k, v = gather(k_pages), gather(v_pages)
  q_pos = kv_lens[:, None] - Q + jnp.arange(Q)  # [S, Q]
  mask = key_ok[:, :, None, :] & (key_pos[:, :, None, :] <= q_pos[:, None, :, None])
  mask = mask[:, :, None]  # [S, Hk, 1, Q, B*Ps]

  qg = q.reshape(S, Q, Hk, G, Dh)
  logits = jnp.einsum("sqkgd,sktd->skgqt", qg, k, precision=HIGHEST,
                      preferred_element_type=jnp.float32) * scale
  logits = jnp.where(mask, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1)  # [S, Hk, G, Q]
  probs = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)[..., None]),
                    0.0)
  l = probs.sum(-1)
  out = jnp.einsum("skgqt,sktd->skgqd", probs, v.astype(jnp.float32), precision=HIGHEST)
  out = out / jnp.where(l > 0, l, 1.0)[..., None]

  def by_query(x):  # [S, Hk, G, Q, *rest] -> [S, Q, H, *rest]
    x = jnp.moveaxis(x, 3, 1)
    return x.reshape(S, Q, Hk * G, *x.shape[4:])

  return by_query(out), by_query(m), by_query(l)


def merge_partials(
    out: jax.Array,  # [N, S, Q, H, Dh] normalised partial outputs
    m: jax.Array,  # [N, S, Q, H] partial row maxima (-inf where empty)
    l: jax.Array,  # [N, S, Q, H] partial softmax sums (0 where empty)
) -> tuple[jax.Array, jax.Array, jax.Array]:  # out [S, Q, H, Dh], m, l [S, Q, H]; fp32
  """Log-sum-exp merge of ``N`` attention results over disjoint key sets.

  Associative and exact up to rounding: merging the results over a partition of the
  keys equals attention over their union; empty partials contribute nothing.
  """
  if out.ndim != 5 or m.shape != out.shape[:-1] or l.shape != m.shape:
    raise ValueError(f"want out [N, S, Q, H, Dh], m, l [N, S, Q, H]; got "
                     f"{out.shape}, {m.shape}, {l.shape}")
  m_all = jnp.max(m, axis=0)
  w = jnp.where(l > 0, l * jnp.exp(m - jnp.where(jnp.isfinite(m_all), m_all, 0.0)), 0.0)
  l_all = w.sum(0)
  out_all = jnp.einsum("nsqh,nsqhd->sqhd", w, out.astype(jnp.float32), precision=HIGHEST)
  return out_all / jnp.where(l_all > 0, l_all, 1.0)[..., None], m_all, l_all
