"""Static shape buckets of the engine's device programs (few compiles).

``S`` slots, ``M`` max pages per slot, ``P`` pages in the pool.

  prefill     ``(n, T)``: admitted prompts ``n`` to a power of two (at most ``S``),
              prompt length ``T`` doubling from ``min_prefill_len`` (at most the
              maximum sequence length).
  decode      ``(k, S_c, M_c)``: the call's draft length, the slots it runs
              (`slot_bucket`: ``S / 4^j``) and the page-table columns it reads
              (`page_bucket`: a power of two, at most ``M``).
  page ids    preemption copies pages in lists padded to a power of two.
"""

from __future__ import annotations

import numpy as np


def pow2(n: int) -> int:
  """The smallest power of two ``>= n``."""
  b = 1
  while b < n:
    b *= 2
  return b


def slot_bucket(num_slots: int, n: int) -> int:
  """The fewest slots ``S / 4^j >= n``: a quarter of the rows or less for a batch's tail,
  with few compiled variants (powers of two would let a long run keep meeting new
  ``(S_c, M_c)`` pairs to compile)."""
  S = num_slots
  while S % 4 == 0 and S // 4 >= n:
    S //= 4
  return S


def page_bucket(max_pages_per_slot: int, held: int) -> int:
  """Page-table columns a call reads when its slots hold at most ``held`` pages."""
  return min(pow2(max(held, 1)), max_pages_per_slot)


def prefill_len(min_prefill_len: int, max_seq_len: int, n: int) -> int:
  b = min_prefill_len
  while b < n:
    b *= 2
  return min(b, max_seq_len)


def prefill_batch(num_slots: int, n: int) -> int:
  return min(pow2(n), num_slots)


def page_ids(pages: list[int], num_pages: int, max_pages_per_slot: int) -> np.ndarray:
  """``pages`` padded with the out-of-range id ``P`` to a power of two."""
  n = min(pow2(len(pages)), max_pages_per_slot)
  ids = np.full((n,), num_pages, np.int32)
  ids[:len(pages)] = pages
  return ids
