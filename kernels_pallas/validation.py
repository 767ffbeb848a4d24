"""Static input validation shared by every paged-KV attention entry point.

Kernels, references and page selection all call these checks, so a shape or dtype
mistake fails the same way on every backend, at trace time. Values (lengths, page
ids) are traced and cannot be checked here; their contract is in the package doc.

Shape legend: ``S`` slots, ``Q`` queries per slot, ``H`` query heads, ``Hk`` KV heads,
``G = H // Hk``, ``Dh`` head dim, ``P`` pages, ``Ps`` page size, ``M`` max pages per
slot, ``B`` selected pages per slot and KV head.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class PagedDims:
  """Static sizes of one paged-attention call."""

  slots: int  # S
  queries: int  # Q
  q_heads: int  # H
  kv_heads: int  # Hk
  head_dim: int  # Dh
  num_pages: int  # P
  page_size: int  # Ps
  max_pages: int  # M

  @property
  def group(self) -> int:  # G
    return self.q_heads // self.kv_heads


def _check_float(name: str, x: jax.Array) -> None:
  if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
    raise ValueError(f"{name} must be float32 or bfloat16, got {x.dtype}")


def _check_int32(name: str, x: jax.Array) -> None:
  if x.dtype != jnp.int32:
    raise ValueError(f"{name} must be int32, got {x.dtype}")


def _check_queries(
    q: jax.Array,  # [S, Q, H, Dh]
    page_table: jax.Array,  # [S, M] int32
    kv_lens: jax.Array,  # [S] int32
    kv_heads: int,
    head_dim: int,
) -> tuple[int, int, int, int]:
  """Checks queries against the per-slot tables; returns ``(S, Q, H, M)``."""
  if q.ndim != 4:
    raise ValueError(f"q must be [S, Q, H, Dh], got shape {q.shape}")
  _check_float("q", q)
  S, Q, H, Dh = q.shape
  if Q < 1:
    raise ValueError("q needs at least one query per slot")
  if Dh != head_dim:
    raise ValueError(f"q head dim {Dh} != KV head dim {head_dim}")
  if H % kv_heads:
    raise ValueError(f"query heads {H} not a multiple of KV heads {kv_heads}")
  if page_table.ndim != 2 or page_table.shape[0] != S:
    raise ValueError(f"page_table must be [S={S}, M], got {page_table.shape}")
  _check_int32("page_table", page_table)
  if kv_lens.shape != (S,):
    raise ValueError(f"kv_lens must be [S={S}], got {kv_lens.shape}")
  _check_int32("kv_lens", kv_lens)
  return S, Q, H, page_table.shape[1]


def check_paged_attention(
    q: jax.Array,  # [S, Q, H, Dh]
    k_pages: jax.Array,  # [Hk, P, Ps, Dh]
    v_pages: jax.Array,  # [Hk, P, Ps, Dh]
    page_table: jax.Array,  # [S, M] int32
    kv_lens: jax.Array,  # [S] int32
) -> PagedDims:
  """Checks the inputs of attention over the paged KV cache."""
  if k_pages.ndim != 4:
    raise ValueError(f"k_pages must be [Hk, P, Ps, Dh], got shape {k_pages.shape}")
  if v_pages.shape != k_pages.shape:
    raise ValueError(f"v_pages {v_pages.shape} != k_pages {k_pages.shape}")
  if v_pages.dtype != k_pages.dtype:
    raise ValueError(f"v_pages {v_pages.dtype} != k_pages {k_pages.dtype}")
  _check_float("k_pages", k_pages)
  Hk, P, Ps, Dh = k_pages.shape
  S, Q, H, M = _check_queries(q, page_table, kv_lens, Hk, Dh)
  return PagedDims(slots=S, queries=Q, q_heads=H, kv_heads=Hk, head_dim=Dh,
                   num_pages=P, page_size=Ps, max_pages=M)


def check_selection(
    dims: PagedDims,
    sel_idx: jax.Array,  # [S, Hk, B] int32
    sel_valid: jax.Array,  # [S, Hk, B] bool
) -> int:
  """Checks a page selection against the call's sizes; returns ``B``."""
  if sel_idx.ndim != 3 or sel_idx.shape[:2] != (dims.slots, dims.kv_heads):
    raise ValueError(
        f"sel_idx must be [S={dims.slots}, Hk={dims.kv_heads}, B], got {sel_idx.shape}")
  _check_int32("sel_idx", sel_idx)
  if sel_valid.shape != sel_idx.shape or sel_valid.dtype != jnp.bool_:
    raise ValueError(
        f"sel_valid must be bool {sel_idx.shape}, got {sel_valid.dtype} {sel_valid.shape}")
  if sel_idx.shape[2] < 1:
    raise ValueError("a selection needs at least one entry")
  return sel_idx.shape[2]


def check_summaries(
    q: jax.Array,  # [S, Q, H, Dh]
    k_min: jax.Array,  # [Hk, P, Dh]
    k_max: jax.Array,  # [Hk, P, Dh]
    page_table: jax.Array,  # [S, M] int32
    kv_lens: jax.Array,  # [S] int32
    page_size: int,  # Ps
) -> PagedDims:
  """Checks the inputs of page selection."""
  if page_size < 1:
    raise ValueError(f"page_size must be positive, got {page_size}")
  if k_min.ndim != 3 or k_max.shape != k_min.shape:
    raise ValueError(
        f"k_min, k_max must both be [Hk, P, Dh], got {k_min.shape}, {k_max.shape}")
  _check_float("k_min", k_min)
  _check_float("k_max", k_max)
  Hk, P, Dh = k_min.shape
  S, Q, H, M = _check_queries(q, page_table, kv_lens, Hk, Dh)
  return PagedDims(slots=S, queries=Q, q_heads=H, kv_heads=Hk, head_dim=Dh,
                   num_pages=P, page_size=page_size, max_pages=M)


def check_budget(n_sink: int, n_window: int, top_k: int) -> int:
  """Checks a page budget; returns ``B = n_sink + n_window + top_k``."""
  if min(n_sink, n_window, top_k) < 0:
    raise ValueError(f"negative budget: {n_sink=}, {n_window=}, {top_k=}")
  budget = n_sink + n_window + top_k
  if budget < 1:
    raise ValueError("the page budget must select at least one page")
  return budget


def check_pages_per_block(pages_per_block: int) -> None:
  if not isinstance(pages_per_block, int) or pages_per_block < 1:
    raise ValueError(f"pages_per_block must be a positive int, got {pages_per_block!r}")
