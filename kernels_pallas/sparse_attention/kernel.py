"""Sparse draft attention as a TPU (Mosaic) Pallas kernel.

Same grid and loop as verification attention (`paged_flash_loop`: one program per
slot and KV head, double-buffered page DMAs, online softmax), but the program walks
its own list of ``B`` selected pages instead of all used pages, so the HBM traffic is
``B`` pages per KV head whatever the context length. Invalid entries (and entries at
or past ``kv_lens``) are neither copied nor attended. The selection's page ids are
resolved through the page table outside the kernel, so only the ``[S, Hk, B]`` index
arrays, not the whole page table, are prefetched to SMEM.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import validation
from kernels_pallas.verify_attention import kernel as verify_kernel


def _sparse_kernel(
    kv_lens_ref,  # [S] int32 SMEM
    slots_ref,  # [S*Hk*B'] int32 SMEM, page slot or -1 when invalid
    ids_ref,  # [S*Hk*B'] int32 SMEM, page id
    q_ref,  # [Q*G, Dh]
    k_hbm,  # [Hk, P, Ps, Dh]
    v_hbm,  # [Hk, P, Ps, Dh]
    o_ref,  # [Q*G, Dh] fp32
    m_out,  # [Q*G, 1] fp32
    l_out,  # [Q*G, 1] fp32
    *scratch,  # see `verify_kernel.scratch_shapes`
    num_queries: int,  # Q
    budget: int,  # B', entries per slot and KV head
    scale: float,
):
  s, head = pl.program_id(0), pl.program_id(1)
  kv_len = kv_lens_ref[s]
  Ps, ppb = k_hbm.shape[2], scratch[0].shape[1]
  base = (s * pl.num_programs(1) + head) * budget

  def entry(e):
    slot = slots_ref[base + e]
    return slot, (slot >= 0) & (slot * Ps < kv_len)

  verify_kernel.paged_flash_loop(
      entry, lambda e: ids_ref[base + e], budget // ppb,
      head=head, kv_len=kv_len, num_queries=num_queries, scale=scale,
      q_ref=q_ref, k_hbm=k_hbm, v_hbm=v_hbm, k_buf=scratch[0], v_buf=scratch[1],
      sems=scratch[2], m_ref=scratch[3], l_ref=scratch[4], acc_ref=scratch[5])
  l = scratch[4][...]
  o_ref[...] = scratch[5][...] / jnp.where(l == 0.0, 1.0, l)
  m_out[...] = jnp.where(l == 0.0, -jnp.inf, scratch[3][...])
  l_out[...] = l


@functools.partial(jax.jit, static_argnames=("pages_per_block", "scale", "interpret"))
def sparse_attention_kernel(
    q: jax.Array,  # [S, Q, H, Dh]
    k_pages: jax.Array,  # [Hk, P, Ps, Dh]
    v_pages: jax.Array,  # [Hk, P, Ps, Dh]
    page_table: jax.Array,  # [S, M] int32
    kv_lens: jax.Array,  # [S] int32
    sel_idx: jax.Array,  # [S, Hk, B] int32 page slots
    sel_valid: jax.Array,  # [S, Hk, B] bool
    *,
    pages_per_block: int,
    scale: float | None = None,
    interpret: Any = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # out [S, Q, H, Dh], m, l [S, Q, H]; fp32
  """Pallas sparse attention; same contract as `sparse_attention_reference`.

  ``interpret``: False compiles with Mosaic (TPU); True or a `pltpu.InterpretParams`
  runs the kernel in interpret mode on any backend.
  """
  d = validation.check_paged_attention(q, k_pages, v_pages, page_table, kv_lens)
  B = validation.check_selection(d, sel_idx, sel_valid)
  validation.check_pages_per_block(pages_per_block)
  if not interpret:
    verify_kernel.check_mosaic_layout(d)
  scale = d.head_dim ** -0.5 if scale is None else scale
  ppb = min(pages_per_block, B)
  budget = -(-B // ppb) * ppb  # B', padded with invalid entries to whole blocks
  pad = ((0, 0), (0, 0), (0, budget - B))
  slots = jnp.pad(jnp.where(sel_valid, sel_idx, -1), pad, constant_values=-1)
  ids = jnp.take_along_axis(page_table[:, None, :],
                            jnp.clip(slots, 0, d.max_pages - 1), axis=2)

  QG = d.queries * d.group
  q_spec = pl.BlockSpec((None, None, QG, d.head_dim), lambda s, h, *_: (s, h, 0, 0))
  ml_spec = pl.BlockSpec((None, None, QG, 1), lambda s, h, *_: (s, h, 0, 0))
  hbm = pl.BlockSpec(memory_space=pl.ANY)
  ml_shape = jax.ShapeDtypeStruct((d.slots, d.kv_heads, QG, 1), jnp.float32)
  out, m, l = pl.pallas_call(
      functools.partial(_sparse_kernel, num_queries=d.queries, budget=budget, scale=scale),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3,
          grid=(d.slots, d.kv_heads),
          in_specs=[q_spec, hbm, hbm],
          out_specs=[q_spec, ml_spec, ml_spec],
          scratch_shapes=verify_kernel.scratch_shapes(d, ppb, k_pages.dtype),
      ),
      out_shape=[jax.ShapeDtypeStruct((d.slots, d.kv_heads, QG, d.head_dim), jnp.float32),
                 ml_shape, ml_shape],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      interpret=interpret,
  )(kv_lens, slots.reshape(-1), ids.reshape(-1), verify_kernel.fold_queries(q, d.kv_heads),
    k_pages, v_pages)
  unfold = functools.partial(verify_kernel.unfold_queries, num_queries=d.queries)
  return unfold(out), unfold(m)[..., 0], unfold(l)[..., 0]
