"""Attention over the paged KV cache: verification and sparse draft attention.

Public API (model and rollout code use only these names):

* `verify_attention(q, k_pages, v_pages, page_table, kv_lens, *, impl, ...)`
  -> ``out``: causal attention of the ``Q = k + 1`` new positions of each slot.
* `select_pages(q, k_min, k_max, page_table, kv_lens, *, page_size, n_sink,
  n_window, top_k)` -> ``(sel_idx, sel_valid)``: sink pages, local window and the
  top-k pages by Quest score (see `kernels_pallas.sparse_attention.selection`).
* `sparse_attention(q, k_pages, v_pages, page_table, kv_lens, sel_idx, sel_valid, *,
  impl, ...)` -> ``(out, m, l)``: causal attention over the selected pages only.
* `merge_partials(out, m, l)`: log-sum-exp merge of stacked ``(out, m, l)`` results
  over disjoint key sets.
* ``impl``: ``"xla"`` (pure-JAX reference) or ``"pallas"`` (the Mosaic kernel on the
  `KERNEL_BACKENDS`, TPU; elsewhere only with ``interpret`` set, else an error). See
  `dispatch`.

Shape legend: ``S`` slots, ``Q`` queries per slot, ``H`` query heads, ``Hk`` KV heads,
``G = H // Hk``, ``Dh`` head dim, ``P`` pages in the pool, ``Ps`` page size, ``M`` max
pages per slot, ``B = n_sink + n_window + top_k`` selected pages.

Paged KV layout (per layer; the rollout engine is built on it):

* ``k_pages, v_pages``: ``[Hk, P, Ps, Dh]``, bf16 or fp32, KV head outermost so one
  head's page is one contiguous ``[Ps, Dh]`` tile (one DMA).
* ``page_table``: ``[S, M]`` int32, the page ids of each slot's pages in order. Entries
  past a slot's used pages (``cdiv(kv_lens[s], Ps)``) are arbitrary and never read.
* ``kv_lens``: ``[S]`` int32, ``0 <= kv_lens[s] <= M * Ps``: valid positions of slot
  ``s`` *including* the positions written for this call (write, then attend).
  Position ``j`` of slot ``s`` is row ``j % Ps`` of page ``page_table[s, j // Ps]``;
  rows at or past ``kv_lens[s]`` are never read.
* ``k_min, k_max``: ``[Hk, P, Dh]``, per page and channel min/max of the keys over the
  page's valid rows (Quest summaries).
* ``q``: ``[S, Q, H, Dh]``, RoPE applied. Query ``t`` of slot ``s`` sits at position
  ``kv_lens[s] - Q + t`` and attends keys ``0 .. kv_lens[s] - Q + t``. Query heads
  ``h * G .. h * G + G - 1`` share KV head ``h``. A query at a negative position
  (``kv_lens[s] < Q``, e.g. an empty slot) sees no key and gives zeros. The softmax
  scale defaults to ``Dh ** -0.5``.

Outputs:

* `verify_attention`: ``[S, Q, H, Dh]`` fp32 whatever the input dtype, like the
  model's dense attention, so verification logprobs match a teacher-forced forward.
* `sparse_attention`: ``out [S, Q, H, Dh]`` normalised (``out = sum_j p_j v_j / l``),
  ``m [S, Q, H]`` the max scaled logit, ``l [S, Q, H] = sum_j exp(logit_j - m)``, all
  fp32; a row without keys gives ``out = 0, m = -inf, l = 0``.
* `select_pages`: ``sel_idx [S, Hk, B]`` int32 page *slots* (indices into the slot's
  page-table row, not page ids, so positions are known), ``sel_valid [S, Hk, B]``
  bool. Invalid entries hold 0; valid entries are distinct used pages.
"""

from kernels_pallas.dispatch import (
    IMPLS,
    KERNEL_BACKENDS,
    default_pages_per_block,
    sparse_attention,
    verify_attention,
)
from kernels_pallas.sparse_attention.reference import merge_partials
from kernels_pallas.sparse_attention.selection import select_pages

__all__ = [
    "IMPLS",
    "KERNEL_BACKENDS",
    "default_pages_per_block",
    "merge_partials",
    "select_pages",
    "sparse_attention",
    "verify_attention",
]
