"""Contiguous KV cache: one ``[S_max]`` strip per sequence.

The simple cache behind `spec_rl_jax.models.generate` (reference decoding, parity
tests). The rollout engine's paged cache implements the same attention-context
interface (see models/attention.py).

Cache index = token position: a token at position ``p`` is written to slot ``p`` and a
query at position ``p`` reads slots ``0..p``. Padding tokens carry positions past the
real length; their writes land on slots that the next real token overwrites before any
real query can see them, so ragged batches need no extra mask. Writes past ``S_max``
are dropped.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from spec_rl_jax.models.attention import AttentionImpl
from spec_rl_jax.models.config import ModelConfig


@struct.dataclass
class ContiguousKVCache:
  """``layers = (k, v)``, each ``[L, B, S_max, K, Dh]``."""

  layers: tuple[jax.Array, jax.Array]

  @classmethod
  def init(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> "ContiguousKVCache":
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    dtype = cfg.dtype if dtype is None else dtype
    return cls(layers=(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)))

  @property
  def max_len(self) -> int:
    return self.layers[0].shape[2]

  def attend(self, impl: AttentionImpl, layers, l, q, k, v, positions):
    """Writes ``k, v [B,T,K,Dh]`` of layer ``l`` at ``positions [B,T]``, then attends
    over slots ``<= pos``."""
    k_all, v_all = layers  # [L, B, S, K, Dh]
    b = jnp.arange(q.shape[0])[:, None]
    k_all = k_all.at[l, b, positions].set(k.astype(k_all.dtype), mode="drop")
    v_all = v_all.at[l, b, positions].set(v.astype(v_all.dtype), mode="drop")
    slots = jnp.arange(k_all.shape[2])
    mask = slots[None, None, :] <= positions[:, :, None]  # [B, T, S]
    return impl.dense(q, k_all[l], v_all[l], mask), (k_all, v_all)

  def replace(self, **kw):
    return dataclasses.replace(self, **kw)
