"""Sparse draft attention: kernel vs reference, full budget vs dense, merge."""

import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas
from kernels_pallas.sparse_attention import (
    merge_partials,
    select_pages,
    sparse_attention_kernel,
    sparse_attention_reference,
)
from kernels_pallas.verify_attention import verify_attention_reference
from tests.kernels.paged_cache import (
    F32,
    FULL_SWEEP,
    MAX_PAGES,
    SWEEP,
    TOLERANCE,
    assert_close,
    make_case,
    run_tpu_interpret,
    sweep_case,
)


def select(case, n_sink, n_window, top_k):
  return select_pages(case.q, case.k_min, case.k_max, case.page_table, case.kv_lens,
                      page_size=case.page_size, n_sink=n_sink, n_window=n_window,
                      top_k=top_k)


def assert_partials_close(actual, expected, dtype):
  """``(out, m, l)``: ``m`` must be -inf exactly where the reference's is."""
  out, m, l = (np.asarray(x) for x in actual)
  ref_out, ref_m, ref_l = (np.asarray(x) for x in expected)
  assert_close(out, ref_out, dtype)
  assert_close(l, ref_l, dtype)
  empty = np.isneginf(ref_m)
  np.testing.assert_array_equal(np.isneginf(m), empty)
  np.testing.assert_array_equal(l[empty], 0.0)
  np.testing.assert_allclose(m[~empty], ref_m[~empty], **TOLERANCE[jnp.dtype(dtype)])


@pytest.mark.parametrize("queries,dtype,group,page_size,ppb", SWEEP)
def test_kernel_matches_reference(queries, dtype, group, page_size, ppb):
  case = sweep_case(queries, dtype, group, page_size)
  sel = select(case, n_sink=1, n_window=1, top_k=2)  # 4 of up to 5 pages
  ref = sparse_attention_reference(*case.paged, *sel)
  out = sparse_attention_kernel(*case.paged, *sel, pages_per_block=ppb, interpret=True)
  assert_partials_close(out, ref, dtype)
  out = run_tpu_interpret(sparse_attention_kernel, *case.paged, *sel, pages_per_block=ppb)
  assert_partials_close(out, ref, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("queries,dtype,group,page_size,ppb", FULL_SWEEP)
def test_kernel_matches_reference_full_sweep(queries, dtype, group, page_size, ppb):
  case = sweep_case(queries, dtype, group, page_size, seed=1)
  sel = select(case, n_sink=1, n_window=1, top_k=1)
  out = run_tpu_interpret(sparse_attention_kernel, *case.paged, *sel, pages_per_block=ppb)
  assert_partials_close(out, sparse_attention_reference(*case.paged, *sel), dtype)


def test_selection_with_gaps():
  """Invalid entries between valid ones, a fully invalid block, pages out of order."""
  case = sweep_case(4, F32, group=2, page_size=8)
  S, Hk = 5, 2
  rng = np.random.default_rng(1)
  used = -(-np.asarray(case.kv_lens) // 8)
  idx = np.zeros((S, Hk, 6), np.int32)
  valid = np.zeros((S, Hk, 6), bool)
  for s in range(S):
    for h in range(Hk):
      pages = rng.permutation(used[s])[:4]
      where = np.sort(rng.choice([0, 1, 4, 5], size=len(pages), replace=False))
      idx[s, h, where], valid[s, h, where] = pages, True
  sel = (jnp.asarray(idx), jnp.asarray(valid))
  ref = sparse_attention_reference(*case.paged, *sel)
  out = run_tpu_interpret(sparse_attention_kernel, *case.paged, *sel, pages_per_block=2)
  assert_partials_close(out, ref, F32)


@pytest.mark.parametrize("queries,dtype", [(1, jnp.bfloat16), (4, F32)])
def test_full_budget_equals_dense(queries, dtype):
  case = sweep_case(queries, dtype, group=2, page_size=8)
  sel = select(case, n_sink=1, n_window=2, top_k=MAX_PAGES)
  assert np.asarray(sel[1]).sum(-1).tolist() == [[n, n] for n in
                                                 -(-np.asarray(case.kv_lens) // 8)]
  dense = verify_attention_reference(*case.paged)
  out, _, _ = run_tpu_interpret(sparse_attention_kernel, *case.paged, *sel, pages_per_block=2)
  assert_close(out, dense, dtype)
  out, _, _ = kernels_pallas.sparse_attention(*case.paged, *sel, impl="xla")
  assert_close(out, dense, dtype)


def test_merge_of_disjoint_selections_equals_dense():
  case = sweep_case(4, F32, group=2, page_size=8)
  idx, valid = select(case, n_sink=1, n_window=2, top_k=MAX_PAGES)
  split = np.random.default_rng(2).random(idx.shape) < 0.5
  parts = [kernels_pallas.sparse_attention(*case.paged, idx, valid & part, impl="pallas",
                                           interpret=True, pages_per_block=2)
           for part in (split, ~split)]
  empty = kernels_pallas.sparse_attention(*case.paged, idx, valid & False, impl="xla")
  stacked = [jnp.stack(xs) for xs in zip(*parts, empty)]
  out, m, l = merge_partials(*stacked)
  assert_close(out, verify_attention_reference(*case.paged), F32)
  whole = sparse_attention_reference(*case.paged, idx, valid)
  assert_partials_close((out, m, l), whole, F32)
  assert_partials_close(merge_partials(*(x[None] for x in whole)), whole, F32)


def test_reference_on_hand_selection():
  """One slot, one head, pages {2, 0} selected: equals attention over those keys."""
  case = make_case(3, [30], queries=2, q_heads=1, kv_heads=1, page_size=8, max_pages=4)
  sel = (jnp.asarray([[[2, 0, 3]]], jnp.int32), jnp.asarray([[[True, True, False]]]))
  out, m, l = (np.asarray(x, np.float64) for x in
               sparse_attention_reference(*case.paged, *sel))
  q = np.asarray(case.q, np.float64)[0, :, 0]  # [Q, Dh]
  table = np.asarray(case.page_table)[0]
  keys = [(p, r) for p in (0, 2) for r in range(8)]  # positions 0-7 and 16-23
  k = np.stack([np.asarray(case.k_pages, np.float64)[0, table[p], r] for p, r in keys])
  v = np.stack([np.asarray(case.v_pages, np.float64)[0, table[p], r] for p, r in keys])
  logits = q @ k.T * 32 ** -0.5
  np.testing.assert_allclose(m[0, :, 0], logits.max(-1), rtol=1e-6)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  np.testing.assert_allclose(l[0, :, 0], w.sum(-1), rtol=1e-5)
  np.testing.assert_allclose(out[0, :, 0], w @ v / w.sum(-1, keepdims=True), atol=1e-5)


def test_dispatch_validates_selection_shape():
  case = sweep_case(1, F32, group=1, page_size=8)
  idx, valid = select(case, n_sink=1, n_window=1, top_k=1)
  with pytest.raises(ValueError, match="sel_valid"):
    kernels_pallas.sparse_attention(*case.paged, idx, valid[..., :-1])
  with pytest.raises(ValueError, match="sel_idx"):
    kernels_pallas.sparse_attention(*case.paged, idx[:, :1], valid[:, :1], impl="pallas",
                                    interpret=True)
