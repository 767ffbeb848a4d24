"""Verification attention in pure JAX: the semantics and the CPU/GPU fallback.

Gathers each slot's pages into a contiguous ``[M * Ps]`` strip and runs masked
softmax attention in fp32. It reads all ``M`` pages of every slot (masking the unused
ones), so it costs ``O(S * M * Ps)`` memory per call; the kernel reads only used pages.
The rollout engine passes only the page-table columns its slots hold (``M_c``, a
power-of-two bucket: rollout/buckets.py), so ``M`` here is that bucket.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import validation

HIGHEST = jax.lax.Precision.HIGHEST


@functools.partial(jax.jit, static_argnames=("scale",))
def verify_attention_reference(
    q: jax.Array,  # [S, Q, H, Dh]
    k_pages: jax.Array,  # [Hk, P, Ps, Dh]
    v_pages: jax.Array,  # [Hk, P, Ps, Dh]
    page_table: jax.Array,  # [S, M] int32
    kv_lens: jax.Array,  # [S] int32
    *,
    scale: float | None = None,
) -> jax.Array:  # [S, Q, H, Dh] fp32
  """Causal attention of the last ``Q`` positions of each slot over its paged KV."""
  d = validation.check_paged_attention(q, k_pages, v_pages, page_table, kv_lens)
  S, Q, Hk, G, Dh = d.slots, d.queries, d.kv_heads, d.group, d.head_dim
  T = d.max_pages * d.page_size
  scale = Dh ** -0.5 if scale is None else scale

  ids = jnp.clip(page_table, 0, d.num_pages - 1)  # never-read entries may be garbage
  key_pos = jnp.arange(T)  # [T]
  key_ok = key_pos[None, :] < kv_lens[:, None]  # [S, T]

  # Everything stays KV-head-major, [Hk, S, ...]: the gather then needs no transpose
  # and both einsums batch over (Hk, S) in place (faster on CPU than [S, Hk]).
  def strip(pages):  # [Hk, P, Ps, Dh] -> [Hk, S, T, Dh], unused rows zeroed
    x = pages[:, ids].reshape(Hk, S, T, Dh)
    return jnp.where(key_ok[None, :, :, None], x, jnp.zeros((), x.dtype))

  k, v = strip(k_pages), strip(v_pages)
  q_pos = kv_lens[:, None] - Q + jnp.arange(Q)  # [S, Q]
  mask = key_ok[:, None, :] & (key_pos[None, None, :] <= q_pos[:, :, None])  # [S, Q, T]
  mask = jnp.broadcast_to(mask[None, :, None], (1, S, G, Q, T)).reshape(1, S, G * Q, T)

  # R = G * Q query rows per (KV head, slot).
  qr = q.reshape(S, Q, Hk, G, Dh).transpose(2, 0, 3, 1, 4).reshape(Hk, S, G * Q, Dh)
  logits = jnp.einsum("ksrd,kstd->ksrt", qr, k, precision=HIGHEST,
                      preferred_element_type=jnp.float32) * scale
  logits = jnp.where(mask, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  probs = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  l = probs.sum(-1, keepdims=True)
  out = jnp.einsum("ksrt,kstd->ksrd", probs / jnp.where(l > 0, l, 1.0),
                   v.astype(jnp.float32), precision=HIGHEST)  # [Hk, S, R, Dh]
  out = out.reshape(Hk, S, G, Q, Dh).transpose(1, 3, 0, 2, 4)  # [S, Q, Hk, G, Dh]
  return out.reshape(S, Q, Hk * G, Dh)
