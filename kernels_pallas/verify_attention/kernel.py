"""Verification attention as a TPU (Mosaic) Pallas kernel.

Grid ``(S, Hk)``: one program per slot and KV head. The ``G`` query heads of that KV
head and the ``Q`` query positions are folded into the rows of one ``[Q*G, Dh]`` block
(row ``r`` is query ``r // G``, head ``r % G``), so each KV page is read from HBM once
per KV head, not once per query head. A program walks the slot's used pages in blocks
of ``pages_per_block`` pages: page DMAs from HBM to VMEM are double-buffered (block
``i + 1`` is in flight while block ``i`` is computed) and the softmax is online
(running max ``m``, sum ``l`` and unnormalised output in VMEM scratch, all fp32).

Only pages below ``cdiv(kv_lens[s], Ps)`` are copied; rows past ``kv_lens[s]`` inside
the last page and stale VMEM rows of a partial block are zeroed before they reach a
matmul, so garbage (NaN) in unread memory can never leak into the output.

`paged_flash_loop` is the shared core: the sparse draft kernel runs the same loop over
its selected pages.

Mosaic constraints: ``Ps`` must be a multiple of 8 (16 keeps bf16 pages in native
tiles) and ``Dh`` should be a multiple of 128 (Llama/Qwen3 use 128); interpret mode
takes any size. ``kv_lens`` and the flattened page table are prefetched to SMEM, so
``S * M`` int32 must fit there (64 slots x 2048 pages = 512 KiB). Each program starts
its first block's DMA itself, so that one copy is not overlapped with compute.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import validation

# Finite, so a fully masked block gives a finite running max (no inf - inf).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
HIGHEST = lax.Precision.HIGHEST


def check_mosaic_layout(dims: validation.PagedDims) -> None:
  """Raises when the pages cannot be tiled by Mosaic (interpret mode skips this)."""
  if dims.page_size % 8:
    raise ValueError(f"the Mosaic kernels need page_size % 8 == 0, got {dims.page_size}")


def fold_queries(
    q: jax.Array,  # [S, Q, H, Dh]
    kv_heads: int,
) -> jax.Array:  # [S, Hk, Q*G, Dh]
  S, Q, H, Dh = q.shape
  G = H // kv_heads
  return q.reshape(S, Q, kv_heads, G, Dh).transpose(0, 2, 1, 3, 4).reshape(
      S, kv_heads, Q * G, Dh)


def unfold_queries(
    x: jax.Array,  # [S, Hk, Q*G, *rest]
    num_queries: int,
) -> jax.Array:  # [S, Q, H, *rest]
  S, Hk, QG, *rest = x.shape
  G = QG // num_queries
  x = x.reshape(S, Hk, num_queries, G, *rest)
  return jnp.moveaxis(x, 2, 1).reshape(S, num_queries, Hk * G, *rest)


def scratch_shapes(
    dims: validation.PagedDims,
    pages_per_block: int,
    kv_dtype: Any,
) -> list[Any]:
  """VMEM/semaphore scratch of `paged_flash_loop`, in its argument order."""
  QG, Dh = dims.queries * dims.group, dims.head_dim
  buf = pltpu.VMEM((2, pages_per_block, dims.page_size, Dh), kv_dtype)
  return [
      buf,  # k_buf
      buf,  # v_buf
      pltpu.SemaphoreType.DMA((2, 2)),  # [buffer, k|v]
      pltpu.VMEM((QG, 1), jnp.float32),  # m
      pltpu.VMEM((QG, 1), jnp.float32),  # l
      pltpu.VMEM((QG, Dh), jnp.float32),  # unnormalised output
  ]


def paged_flash_loop(
    entry: Callable[[jax.Array], tuple[jax.Array, jax.Array]],  # e -> (slot, valid)
    page_id: Callable[[jax.Array], jax.Array],  # e -> page id
    num_blocks: int | jax.Array,  # scalar, blocks of ppb entries
    *,
    head: jax.Array,  # scalar KV head index
    kv_len: jax.Array,  # scalar kv_lens[s]
    num_queries: int,  # Q
    scale: float,
    q_ref,  # [Q*G, Dh] VMEM
    k_hbm,  # [Hk, P, Ps, Dh] HBM
    v_hbm,  # [Hk, P, Ps, Dh] HBM
    k_buf,  # [2, ppb, Ps, Dh] VMEM
    v_buf,  # [2, ppb, Ps, Dh] VMEM
    sems,  # DMA semaphores [2, 2]
    m_ref,  # [Q*G, 1] fp32 VMEM
    l_ref,  # [Q*G, 1] fp32 VMEM
    acc_ref,  # [Q*G, Dh] fp32 VMEM
) -> None:
  """Online-softmax attention of one slot and KV head over a list of pages.

  The list has ``num_blocks * ppb`` entries; ``entry(e)`` gives entry ``e``'s page slot
  (index into the slot's page table, so its keys sit at positions ``slot*Ps + row``)
  and whether it is valid, ``page_id(e)`` its page id (called only for valid entries).
  Leaves ``m, l`` and the unnormalised output in the scratch refs.
  """
  _, ppb, Ps, Dh = k_buf.shape
  QG = q_ref.shape[0]
  T = ppb * Ps
  group = QG // num_queries

  def entries(blk):
    return [entry(blk * ppb + j) for j in range(ppb)]

  def copies(blk, buf, start: bool):
    for j, (_, ok) in enumerate(entries(blk)):

      @pl.when(ok)
      def _():
        pid = page_id(blk * ppb + j)
        for kv, (src, dst) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf))):
          copy = pltpu.make_async_copy(src.at[head, pid], dst.at[buf, j], sems.at[buf, kv])
          if start:
            copy.start()
          else:
            copy.wait()

  def key_positions(blk, shape, dim):
    """Key position of each element along ``dim``; ``kv_len`` (masked) if invalid."""
    r = lax.broadcasted_iota(jnp.int32, shape, dim)
    pos = jnp.full(shape, kv_len, jnp.int32)
    for j, (slot, ok) in enumerate(entries(blk)):
      in_page = (r >= j * Ps) & (r < (j + 1) * Ps) & ok
      pos = jnp.where(in_page, slot * Ps + r - j * Ps, pos)
    return pos

  def compute(blk, buf):
    row_ok = key_positions(blk, (T, Dh), 0) < kv_len  # [T, Dh]
    k = jnp.where(row_ok, k_buf[buf].astype(jnp.float32).reshape(T, Dh), 0.0)
    v = jnp.where(row_ok, v_buf[buf].astype(jnp.float32).reshape(T, Dh), 0.0)
    q = q_ref[...]
    if q.dtype == k_buf.dtype:
      k = k.astype(q.dtype)  # exact: the values came from this dtype
    else:
      q = q.astype(jnp.float32)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=HIGHEST,
                        preferred_element_type=jnp.float32) * scale  # [QG, T]
    q_pos = kv_len - num_queries + lax.div(
        lax.broadcasted_iota(jnp.int32, (QG, T), 0), group)
    mask = key_positions(blk, (QG, T), 1) <= q_pos  # invalid keys sit at >= kv_len
    s = jnp.where(mask, s, MASK_VALUE)
    m_prev = m_ref[...]
    m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(mask, jnp.exp(s - m_next), 0.0)
    l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(
        p, v, precision=HIGHEST, preferred_element_type=jnp.float32)
    m_ref[...] = m_next

  m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
  l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
  acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
  copies(0, 0, start=True)

  def body(blk, carry):
    buf = lax.rem(blk, 2)

    @pl.when(blk + 1 < num_blocks)
    def _():
      copies(blk + 1, 1 - buf, start=True)

    copies(blk, buf, start=False)
    any_ok = functools.reduce(jnp.logical_or, [ok for _, ok in entries(blk)])
    pl.when(any_ok)(lambda: compute(blk, buf))
    return carry

  lax.fori_loop(0, num_blocks, body, 0)


def _verify_kernel(
    kv_lens_ref,  # [S] int32 SMEM
    page_table_ref,  # [S*M] int32 SMEM
    q_ref,  # [Q*G, Dh]
    k_hbm,  # [Hk, P, Ps, Dh]
    v_hbm,  # [Hk, P, Ps, Dh]
    o_ref,  # [Q*G, Dh] fp32
    *scratch,  # see `scratch_shapes`
    num_queries: int,  # Q
    max_pages: int,  # M
    scale: float,
):
  s, head = pl.program_id(0), pl.program_id(1)
  kv_len = kv_lens_ref[s]
  Ps, ppb = k_hbm.shape[2], scratch[0].shape[1]
  n_pages = jnp.minimum(lax.div(kv_len + Ps - 1, Ps), max_pages)
  paged_flash_loop(
      lambda e: (e, e < n_pages),
      lambda e: page_table_ref[s * max_pages + e],
      lax.div(n_pages + ppb - 1, ppb),
      head=head, kv_len=kv_len, num_queries=num_queries, scale=scale,
      q_ref=q_ref, k_hbm=k_hbm, v_hbm=v_hbm, k_buf=scratch[0], v_buf=scratch[1],
      sems=scratch[2], m_ref=scratch[3], l_ref=scratch[4], acc_ref=scratch[5])
  l = scratch[4][...]
  o_ref[...] = scratch[5][...] / jnp.where(l == 0.0, 1.0, l)


@functools.partial(jax.jit, static_argnames=("pages_per_block", "scale", "interpret"))
def verify_attention_kernel(
    q: jax.Array,  # [S, Q, H, Dh]
    k_pages: jax.Array,  # [Hk, P, Ps, Dh]
    v_pages: jax.Array,  # [Hk, P, Ps, Dh]
    page_table: jax.Array,  # [S, M] int32
    kv_lens: jax.Array,  # [S] int32
    *,
    pages_per_block: int,
    scale: float | None = None,
    interpret: Any = False,
) -> jax.Array:  # [S, Q, H, Dh] fp32
  """Pallas verification attention; same contract as `verify_attention_reference`.

  ``interpret``: False compiles with Mosaic (TPU); True or a `pltpu.InterpretParams`
  runs the kernel in interpret mode on any backend.
  """
  d = validation.check_paged_attention(q, k_pages, v_pages, page_table, kv_lens)
  validation.check_pages_per_block(pages_per_block)
  if not interpret:
    check_mosaic_layout(d)
  scale = d.head_dim ** -0.5 if scale is None else scale
  ppb = min(pages_per_block, d.max_pages)
  QG = d.queries * d.group
  q_spec = pl.BlockSpec((None, None, QG, d.head_dim), lambda s, h, *_: (s, h, 0, 0))
  hbm = pl.BlockSpec(memory_space=pl.ANY)
  out = pl.pallas_call(
      functools.partial(_verify_kernel, num_queries=d.queries, max_pages=d.max_pages,
                        scale=scale),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(d.slots, d.kv_heads),
          in_specs=[q_spec, hbm, hbm],
          out_specs=q_spec,
          scratch_shapes=scratch_shapes(d, ppb, k_pages.dtype),
      ),
      out_shape=jax.ShapeDtypeStruct((d.slots, d.kv_heads, QG, d.head_dim), jnp.float32),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      interpret=interpret,
  )(kv_lens, page_table.reshape(-1), fold_queries(q, d.kv_heads), k_pages, v_pages)
  return unfold_queries(out, d.queries)
