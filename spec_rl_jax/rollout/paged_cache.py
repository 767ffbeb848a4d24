"""Paged KV cache: device page pools (an attention context) and the host page allocator.

Layout (shared with ``kernels_pallas``; ``L`` layers, ``Hk`` KV heads, ``P`` pages,
``Ps`` page size, ``Dh`` head dim, ``S`` slots, ``M`` max pages per slot):

  k_pages, v_pages  [L, Hk, P, Ps, Dh]   the pools, written in place (donated)
  k_min, k_max      [L, Hk, P, Dh]       per-page, per-channel key bounds (Quest)
  page_table        [S, M] int32         page ids of each slot's pages, in order

Position ``j`` of a slot lives in page ``page_table[s, j // Ps]``, row ``j % Ps``.

Calling convention (write-then-attend): the new tokens of each row are right-aligned
in the ``[S, T]`` block with contiguous positions; padding carries negative positions.
The layer writes the valid ``k, v`` first, then every query at position ``p`` attends
keys ``0..p``; the row's KV length is ``positions[:, -1] + 1``. Rolling back rejected
speculative tokens is length bookkeeping only: their rows are overwritten later.

Key bounds are reset when row 0 of a page is written (a fresh or reused page) and
widened by every write. Rows of rejected drafts may leave the bounds looser than the
page's final keys; they remain valid upper bounds for the Quest score.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import struct

from spec_rl_jax.models.attention import AttentionImpl
from spec_rl_jax.models.config import ModelConfig


@struct.dataclass
class PagedKVCache:
  """``layers = (k_pages, v_pages, k_min, k_max)``; see the module docstring."""

  layers: tuple[jax.Array, jax.Array, jax.Array, jax.Array]
  page_table: jax.Array  # [S, M] int32

  @classmethod
  def init(cls, cfg: ModelConfig, num_slots: int, num_pages: int, page_size: int,
           max_pages_per_slot: int, dtype=None) -> "PagedKVCache":
    dtype = cfg.dtype if dtype is None else dtype
    pool = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
    bound = (cfg.num_layers, cfg.num_kv_heads, num_pages, cfg.head_dim)
    return cls(
        layers=(jnp.zeros(pool, dtype), jnp.zeros(pool, dtype),
                jnp.full(bound, jnp.inf, dtype), jnp.full(bound, -jnp.inf, dtype)),
        page_table=jnp.zeros((num_slots, max_pages_per_slot), jnp.int32))

  @property
  def page_size(self) -> int:
    return self.layers[0].shape[3]

  @property
  def num_pages(self) -> int:
    return self.layers[0].shape[2]

  def attend(self, impl: AttentionImpl, layers, l, q, k, v, positions):
    """Writes ``k, v [S,T,Hk,Dh]`` of layer ``l`` into the pools, then attends.

    Args:
      q: ``[S, T, H, Dh]`` queries; ``positions: [S, T]`` (negative = padding).
    Returns:
      ``(out [S, T, H, Dh], new layers)``.
    """
    k_pages, v_pages, k_min, k_max = layers
    Ps, P = self.page_size, self.num_pages
    valid = positions >= 0
    page = jnp.take_along_axis(self.page_table, jnp.where(valid, positions // Ps, 0), axis=1)
    page = jnp.where(valid, page, P)  # [S, T]; P is out of range: the write is dropped
    row = jnp.where(valid, positions % Ps, 0)
    # Advanced indices around a slice move to the front: values are [S, T, Hk, Dh].
    k_pages = k_pages.at[l, :, page, row].set(k.astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[l, :, page, row].set(v.astype(v_pages.dtype), mode="drop")
    fresh = jnp.where(row == 0, page, P)
    kb = k.astype(k_min.dtype)
    k_min = k_min.at[l, :, fresh].set(jnp.inf, mode="drop").at[l, :, page].min(kb, mode="drop")
    k_max = k_max.at[l, :, fresh].set(-jnp.inf, mode="drop").at[l, :, page].max(kb, mode="drop")
    kv_lens = jnp.maximum(positions[:, -1] + 1, 0)
    out = impl.paged(q, k_pages[l], v_pages[l], self.page_table, kv_lens)
    return out, (k_pages, v_pages, k_min, k_max)

  def replace(self, **kw):
    return dataclasses.replace(self, **kw)


class PagePool:
  """Host-side allocator of page ids ``0..P-1`` (LIFO free list, so hot pages recycle)."""

  def __init__(self, num_pages: int, page_size: int):
    self.num_pages, self.page_size = num_pages, page_size
    self._free = list(range(num_pages - 1, -1, -1))

  @property
  def num_free(self) -> int:
    return len(self._free)

  def pages_for(self, num_tokens: int) -> int:
    return math.ceil(num_tokens / self.page_size)

  def allocate(self, n: int) -> list[int]:
    if n > len(self._free):
      raise RuntimeError(f"page pool exhausted: asked {n}, {len(self._free)} free")
    out = self._free[-n:][::-1]
    del self._free[len(self._free) - n:]
    return out

  def release(self, pages: list[int]) -> None:
    self._free.extend(reversed(pages))
    if len(self._free) > self.num_pages or len(set(self._free)) != len(self._free):
      raise AssertionError("page released twice")  # bookkeeping invariant


def _is_pool(x) -> bool:
  return getattr(x, "ndim", 0) >= 4  # [L, Hk, P, ...]; page tables are [S, M]


def gather_pages(tree, ids: jax.Array) -> list[jax.Array]:
  """Pages ``ids [n]`` of every page pool in ``tree`` (leaves ``[L, Hk, P, ...]``:
  policy and proposer caches alike), as ``[L, Hk, n, ...]`` arrays in leaf order.
  Out-of-range ids (padding) read an arbitrary page."""
  return [jnp.take(x, ids, axis=2, mode="clip") for x in jax.tree.leaves(tree) if _is_pool(x)]


def scatter_pages(tree, ids: jax.Array, data: list[jax.Array]):
  """Writes what `gather_pages` returned into pages ``ids`` (out-of-range: dropped)."""
  leaves, treedef = jax.tree.flatten(tree)
  it = iter(data)
  leaves = [x.at[:, :, ids].set(next(it), mode="drop") if _is_pool(x) else x for x in leaves]
  return jax.tree.unflatten(treedef, leaves)


def page_bytes(tree) -> int:
  """Bytes one page occupies across every page pool in ``tree``."""
  return sum(x.size // x.shape[2] * x.dtype.itemsize for x in jax.tree.leaves(tree)
             if _is_pool(x))
