"""Query-aware page selection (Quest) for sparse draft attention, in pure JAX.

For each slot and KV head the budget ``B = n_sink + n_window + top_k`` is filled as

  ``[0, n_sink)``                     the first ``n_sink`` pages (attention sinks),
  ``[n_sink, n_sink + n_window)``     the last ``n_window`` used pages (local window,
                                      which holds the newest positions),
  ``[n_sink + n_window, B)``          the ``top_k`` best remaining pages by score,
                                      best first.

Entries are page *slots* (indices into the slot's page-table row, so the keys of
entry ``i`` sit at positions ``idx * Ps + row``). An entry is invalid (mask False,
index 0) when the slot has too few used pages to fill it; valid entries never repeat
a page and never point at or past ``cdiv(kv_lens[s], Ps)``.

Score of a page for one query head (Quest): ``sum_d max(q_d * min_d, q_d * max_d)``,
an upper bound on ``q . k`` over the page's keys. It is aggregated over the ``G`` query
heads that share the KV head and over the ``Q`` queries by ``max``, so it stays an
upper bound on the largest logit any of them can see in the page.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import validation

HIGHEST = jax.lax.Precision.HIGHEST


def page_scores(
    q: jax.Array,  # [S, Q, H, Dh]
    k_min: jax.Array,  # [Hk, P, Dh]
    k_max: jax.Array,  # [Hk, P, Dh]
    page_table: jax.Array,  # [S, M] int32
) -> jax.Array:  # [S, Hk, M] fp32
  """Quest score of every page slot, max over the KV head's query heads and queries.

  Uses ``max(q*lo, q*hi) = max(q, 0) * hi + min(q, 0) * lo`` (``lo <= hi``), i.e. two
  matmuls. Scores of unused slots are computed from whatever those entries point at
  and must be masked by the caller.
  """
  S, Q, H, Dh = q.shape
  Hk, P = k_min.shape[:2]
  qg = q.astype(jnp.float32).reshape(S, Q, Hk, H // Hk, Dh)
  ids = jnp.clip(page_table, 0, P - 1)
  lo = k_min[:, ids].astype(jnp.float32)  # [Hk, S, M, Dh]
  hi = k_max[:, ids].astype(jnp.float32)
  bound = (jnp.einsum("sqkgd,ksmd->skqgm", jnp.maximum(qg, 0.0), hi, precision=HIGHEST)
           + jnp.einsum("sqkgd,ksmd->skqgm", jnp.minimum(qg, 0.0), lo, precision=HIGHEST))
  return bound.max(axis=(2, 3))


@functools.partial(jax.jit, static_argnames=("page_size", "n_sink", "n_window", "top_k"))
def select_pages(
    q: jax.Array,  # [S, Q, H, Dh]
    k_min: jax.Array,  # [Hk, P, Dh]
    k_max: jax.Array,  # [Hk, P, Dh]
    page_table: jax.Array,  # [S, M] int32
    kv_lens: jax.Array,  # [S] int32
    *,
    page_size: int,
    n_sink: int,
    n_window: int,
    top_k: int,
) -> tuple[jax.Array, jax.Array]:  # idx [S, Hk, B] int32 page slots, valid [S, Hk, B] bool
  """Sink pages, local window and the ``top_k`` pages by Quest score (module doc)."""
  d = validation.check_summaries(q, k_min, k_max, page_table, kv_lens, page_size)
  validation.check_budget(n_sink, n_window, top_k)
  S, Hk, M = d.slots, d.kv_heads, d.max_pages
  n_used = jnp.minimum((kv_lens + page_size - 1) // page_size, M)[:, None]  # [S, 1]

  sink = jnp.broadcast_to(jnp.arange(n_sink), (S, n_sink))
  sink_ok = sink < n_used
  window = n_used - n_window + jnp.arange(n_window)  # [S, n_window]
  window_ok = (window >= n_sink) & (window < n_used)
  fixed = jnp.concatenate([sink, window], axis=1)
  fixed_ok = jnp.concatenate([sink_ok, window_ok], axis=1)
  fixed = jnp.broadcast_to(jnp.where(fixed_ok, fixed, 0)[:, None], (S, Hk, n_sink + n_window))
  fixed_ok = jnp.broadcast_to(fixed_ok[:, None], fixed.shape)

  slot = jnp.arange(M)
  candidate = (slot >= n_sink) & (slot < n_used - n_window)  # [S, M]
  scores = jnp.where(candidate[:, None, :], page_scores(q, k_min, k_max, page_table),
                     -jnp.inf)
  k_eff = min(top_k, M)
  best, top = jax.lax.top_k(scores, k_eff)  # [S, Hk, k_eff]
  top_ok = best > -jnp.inf
  pad = ((0, 0), (0, 0), (0, top_k - k_eff))
  top = jnp.pad(jnp.where(top_ok, top, 0), pad).astype(jnp.int32)
  top_ok = jnp.pad(top_ok, pad)
  return (jnp.concatenate([fixed.astype(jnp.int32), top], axis=2),
          jnp.concatenate([fixed_ok, top_ok], axis=2))
