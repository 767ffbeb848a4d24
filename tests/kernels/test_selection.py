"""Quest page selection: fixed pages always present, top-k equal to brute force."""

import numpy as np
import pytest

from kernels_pallas.sparse_attention import page_scores, select_pages
from tests.kernels.paged_cache import F32, make_case

PS = 8
LENS = [0, 3, 8, 9, 40, 75, 128]  # empty, partial first page, page boundaries, long


def brute_force_scores(case) -> np.ndarray:  # [S, Hk, M] float64, NaN where unused
  """``max over (query, head in group) of sum_d max(q_d * min_d, q_d * max_d)``."""
  q = np.asarray(case.q, np.float64)
  lo, hi = (np.asarray(x, np.float64) for x in (case.k_min, case.k_max))
  table = np.asarray(case.page_table)
  S, Q, H, _ = q.shape
  Hk, M = lo.shape[0], table.shape[1]
  G = H // Hk
  used = -(-np.asarray(case.kv_lens) // PS)
  out = np.full((S, Hk, M), np.nan)
  for s in range(S):
    for kv in range(Hk):
      for j in range(used[s]):
        qs = q[s, :, kv * G:(kv + 1) * G]  # [Q, G, Dh]
        page = table[s, j]
        out[s, kv, j] = np.maximum(qs * lo[kv, page], qs * hi[kv, page]).sum(-1).max()
  return out


def lens_case(queries=2, group=2, seed=0):
  return make_case(seed, LENS, queries=queries, q_heads=2 * group, kv_heads=2,
                   page_size=PS, max_pages=16, dtype=F32)


def select(case, n_sink, n_window, top_k):
  idx, valid = select_pages(case.q, case.k_min, case.k_max, case.page_table, case.kv_lens,
                            page_size=PS, n_sink=n_sink, n_window=n_window, top_k=top_k)
  return np.asarray(idx), np.asarray(valid)


def test_page_scores_equal_quest_formula():
  case = lens_case(queries=3, group=4)
  expected = brute_force_scores(case)
  used = ~np.isnan(expected)
  scores = np.asarray(page_scores(case.q, case.k_min, case.k_max, case.page_table))
  # fp32 sums of Dh = 32 products (|score| <= ~100) against float64.
  np.testing.assert_allclose(scores[used], expected[used], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("n_sink,n_window,top_k", [(1, 2, 3), (2, 3, 0), (0, 1, 20),
                                                   (3, 0, 2)])
def test_fixed_pages_always_present_and_entries_distinct(n_sink, n_window, top_k):
  case = lens_case()
  idx, valid = select(case, n_sink, n_window, top_k)
  assert idx.shape == valid.shape == (len(LENS), 2, n_sink + n_window + top_k)
  assert idx.dtype == np.int32
  for s, n in enumerate(-(-np.asarray(LENS) // PS)):
    fixed = set(range(min(n_sink, n))) | set(range(max(0, n - n_window), n))
    for h in range(2):
      chosen = idx[s, h][valid[s, h]]
      assert len(set(chosen)) == len(chosen), "a page selected twice"
      assert fixed <= set(chosen)
      assert all(0 <= c < n for c in chosen)
      assert len(chosen) == min(n, n_sink + n_window + top_k)
      assert (idx[s, h][~valid[s, h]] == 0).all()


@pytest.mark.parametrize("queries,group", [(1, 1), (1, 4), (4, 2)])
def test_top_k_equals_brute_force(queries, group):
  n_sink, n_window, top_k = 1, 2, 4
  case = lens_case(queries, group, seed=queries + group)
  idx, valid = select(case, n_sink, n_window, top_k)
  scores = brute_force_scores(case)
  for s, n in enumerate(-(-np.asarray(LENS) // PS)):
    candidates = np.arange(n_sink, max(n_sink, n - n_window))
    for h in range(2):
      best = np.sort(scores[s, h, candidates])[::-1][:top_k]
      top, top_ok = idx[s, h, n_sink + n_window:], valid[s, h, n_sink + n_window:]
      assert top_ok.sum() == len(best)
      assert set(top[top_ok]) <= set(candidates)
      # Ordered best first; equal to the brute-force top-k up to fp32 rounding.
      np.testing.assert_allclose(scores[s, h, top[top_ok]], best, rtol=1e-5, atol=1e-4)


def test_rejects_bad_budget():
  case = lens_case()
  with pytest.raises(ValueError, match="negative budget"):
    select(case, n_sink=-1, n_window=2, top_k=2)
  with pytest.raises(ValueError, match="at least one page"):
    select(case, n_sink=0, n_window=0, top_k=0)
