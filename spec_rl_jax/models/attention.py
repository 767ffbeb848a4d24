"""The attention dispatch point and the cache-free attention context.

Model code never calls an attention implementation directly: it hands ``q, k, v`` to
an *attention context* — `NoCache` here, `ContiguousKVCache` (models/kv_cache.py) or
the rollout engine's paged cache — and the context picks the implementation registered
under ``ModelConfig.attention_impl`` with `get_impl`. Kernels (``kernels_pallas``)
plug in by registering a name; layer code does not change.

A context is a pytree with:
  * ``layers``: per-layer state with a leading ``[L]`` axis (``None`` when there is
    none). It rides in the layer scan's *carry* and each layer updates its ``[l]``
    slice in place, so a donated cache is never copied per token.
  * ``attend(impl, layers, l, q, k, v, positions) -> (out, new_layers)`` for layer
    ``l`` (a traced int),
  * ``replace(layers=...)``.

Shape legend: ``B`` batch, ``T`` query tokens, ``S`` key tokens, ``H`` query heads,
``K`` KV heads, ``G = H // K``, ``Dh`` head dim.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

import kernels_pallas

NEG_INF = -1e30  # finite so fully-masked rows stay NaN-free


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                          mask: jax.Array) -> jax.Array:
  """Reference GQA attention (pure XLA, fp32 softmax).

  Args:
    q: ``[B, T, H, Dh]`` queries (RoPE applied).
    k: ``[B, S, K, Dh]`` keys (RoPE applied).
    v: ``[B, S, K, Dh]`` values.
    mask: ``[B, T, S]`` bool, True where query ``t`` may attend key ``s``.
  Returns:
    ``[B, T, H, Dh]`` in fp32; rows with no visible key are zero.
  """
  B, T, H, Dh = q.shape
  K = k.shape[2]
  qg = q.reshape(B, T, K, H // K, Dh)
  logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
  logits = logits * (Dh ** -0.5)
  m = mask[:, None, None, :, :]
  logits = jnp.where(m, logits, NEG_INF)
  probs = jax.nn.softmax(logits, axis=-1)
  probs = jnp.where(m, probs, 0.0)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(jnp.float32))
  return out.reshape(B, T, H, Dh)


@dataclasses.dataclass(frozen=True)
class AttentionImpl:
  """The functions one implementation provides."""

  dense: Callable[..., jax.Array]  # (q, k, v, mask) -> out
  # (q [S,T,H,Dh], k_pages [Hk,P,Ps,Dh], v_pages, page_table [S,M], kv_lens [S]) -> out
  paged: Callable[..., jax.Array]
  # paged arguments + (sel_idx, sel_valid [S,Hk,B]) -> (out, m, l): selected pages only
  sparse: Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


# "pallas": Mosaic kernels on TPU; elsewhere kernels_pallas falls back to the reference
# (logged once). Dense (cache-free) attention has no kernel: training uses XLA's.
_IMPLS: dict[str, AttentionImpl] = {
    name: AttentionImpl(dense=dot_product_attention,
                        paged=functools.partial(kernels_pallas.verify_attention, impl=name),
                        sparse=functools.partial(kernels_pallas.sparse_attention, impl=name))
    for name in ("xla", "pallas")
}


def get_impl(name: str) -> AttentionImpl:
  if name not in _IMPLS:
    raise ValueError(f"unknown attention_impl {name!r}; registered: {sorted(_IMPLS)}")
  return _IMPLS[name]


# Query rows per block of `NoCache` attention. Gradient of the long-response policy on
# [4, 2048] tokens, 2 CPU cores: 11.0 s unblocked, 6.1 s / 4.4 s / 4.0 s with blocks of
# 512 / 256 / 128 rows (compile 11 s at 256, 16 s at 128).
NOCACHE_BLOCK = 256


@struct.dataclass
class NoCache:
  """Attention over the tokens of this call only (training, teacher forcing, scoring).

  Causal by index: query ``t`` sees the keys ``s <= t`` that ``valid[B, T]`` marks
  real (padding on either side is masked out; ``positions`` only set the RoPE angles).

  Queries run in blocks of `NOCACHE_BLOCK` rows, block ``i`` against keys
  ``[0, (i + 1)·C)`` only: the keys after a block are masked for all its rows, so
  skipping them is exact, saves about half the attention FLOPs of a long sequence and
  keeps the ``[B, H, C, ·]`` score blocks small.
  """

  valid: jax.Array | None = None
  layers: Any = None

  def attend(self, impl: AttentionImpl, layers, l, q, k, v, positions):
    del l, positions
    B, T = q.shape[:2]
    idx = jnp.arange(T)
    out = []
    for start in range(0, T, NOCACHE_BLOCK):
      end = min(start + NOCACHE_BLOCK, T)
      mask = idx[start:end, None] >= idx[None, :end]  # [C, end]
      mask = jnp.broadcast_to(mask, (B, end - start, end))
      if self.valid is not None:
        mask &= self.valid[:, None, :end]
      out.append(impl.dense(q[:, start:end], k[:, :end], v[:, :end], mask))
    return jnp.concatenate(out, axis=1), layers

  def replace(self, **kw):
    return dataclasses.replace(self, **kw)
