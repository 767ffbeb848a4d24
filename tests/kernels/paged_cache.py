"""Random paged KV caches for the kernel tests, poisoned wherever reads are illegal.

Every page that no slot uses, every row at or past a slot's length inside its last
page, and the key summaries of unused pages hold NaN, so using any of them turns the
output NaN. Unused page-table entries point at poisoned pages, at page 0, or outside
the pool, so merely copying such a page raises in TPU interpret mode
(``out_of_bounds_reads="raise"``).

Also shared by the kernel tests: the sweep, the tolerances and the TPU interpret mode.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as mosaic_interpret

# TPU interpret mode: happens-before race detector on, out-of-bounds reads raise,
# VMEM scratch starts as NaN, grid split over two simulated cores ("parallel" dims).
TPU_INTERPRET = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise",
                                      uninitialized_memory="nan", num_cores_or_threads=2)

# Kernel vs reference, both fed the same inputs. Both paths multiply the stored values
# with fp32 accumulation and run the softmax and the probability-value matmul in fp32;
# they differ only in summation order and in the online rescaling by exp(m_prev -
# m_next) once per block: a few fp32 ulps. Outputs are O(1) (convex combinations of
# N(0, 1) values, |out| < 4), l is O(10), m is O(10): the largest differences over the
# sweep are 1e-6 absolute (out, m) and 7e-7 relative (l), so 1e-5 leaves a 10x margin,
# while any masking or indexing mistake moves values by 1e-2 or more.
# fp32: the bound above. bf16: the same bound, because the rounding to bf16 happens in
# the cache, before either path reads it, and the kernel never rounds anything to bf16
# itself (bf16 x bf16 products are exact in fp32). Against an fp32 ground truth bf16
# would need ~1e-2, but that compares the cache dtype, not the kernel.
TOLERANCE = {
    jnp.dtype(jnp.float32): dict(atol=1e-5, rtol=1e-5),
    jnp.dtype(jnp.bfloat16): dict(atol=1e-5, rtol=1e-5),
}

F32, BF16 = jnp.float32, jnp.bfloat16
MAX_PAGES = 5

# (Q, dtype, G, Ps, pages_per_block): every Q x dtype; the six (G, Ps) pairs and block
# sizes 1-3 (blocks that split, end mid-block, or cover several pages) rotate through.
SWEEP = [
    (1, F32, 1, 8, 1), (1, BF16, 4, 16, 2),
    (2, F32, 2, 16, 3), (2, BF16, 2, 8, 2),
    (4, F32, 4, 8, 2), (4, BF16, 2, 16, 1),
    (7, F32, 1, 16, 2), (7, BF16, 4, 8, 3),
]
# The full product of Q, dtype, G and Ps (slow runs), with 3-page blocks.
FULL_SWEEP = list(itertools.product([1, 2, 4, 7], [F32, BF16], [1, 2, 4], [8, 16], [3]))


@dataclasses.dataclass
class PagedCase:
  q: jax.Array  # [S, Q, H, Dh]
  k_pages: jax.Array  # [Hk, P, Ps, Dh]
  v_pages: jax.Array  # [Hk, P, Ps, Dh]
  page_table: jax.Array  # [S, M] int32
  kv_lens: jax.Array  # [S] int32
  k_min: jax.Array  # [Hk, P, Dh]
  k_max: jax.Array  # [Hk, P, Dh]

  @property
  def paged(self) -> tuple[jax.Array, ...]:
    return self.q, self.k_pages, self.v_pages, self.page_table, self.kv_lens

  @property
  def page_size(self) -> int:
    return self.k_pages.shape[2]


def make_case(seed: int, kv_lens: list[int], *, queries: int, q_heads: int, kv_heads: int,
              head_dim: int = 32, page_size: int = 8, max_pages: int = 6,
              dtype=jnp.float32) -> PagedCase:
  """A cache with ``len(kv_lens)`` slots whose pages are scattered over the pool."""
  rng = np.random.default_rng(seed)
  S, Ps, M, Dh = len(kv_lens), page_size, max_pages, head_dim
  lens = np.asarray(kv_lens, np.int32)
  assert lens.max() <= M * Ps
  used = -(-lens // Ps)
  P = S * M + 3
  perm = rng.permutation(P)
  live = perm[:used.sum()]
  dead = perm[used.sum():]
  table = rng.choice(dead, size=(S, M)).astype(np.int32)
  garbage = rng.random((S, M))
  table[garbage < 0.2] = 0  # "may be 0": page 0 is live or dead by chance
  table[garbage > 0.7] = P + 5  # out of the pool: a DMA of it raises
  table[np.arange(M)[None, :] < used[:, None]] = live

  k = rng.standard_normal((kv_heads, P, Ps, Dh)).astype(np.float32)
  v = rng.standard_normal((kv_heads, P, Ps, Dh)).astype(np.float32)
  q = 2.0 * rng.standard_normal((S, queries, q_heads, Dh)).astype(np.float32)
  k, v, q = (np.array(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (k, v, q))
  row_ok = np.zeros((P, Ps), bool)
  for s in range(S):
    for j in range(used[s]):
      row_ok[table[s, j], :min(Ps, lens[s] - j * Ps)] = True
  k[:, ~row_ok] = np.nan
  v[:, ~row_ok] = np.nan
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows of dead pages
    k_min = np.nanmin(k, axis=2)  # NaN for dead pages
    k_max = np.nanmax(k, axis=2)
  return PagedCase(q=jnp.asarray(q, dtype), k_pages=jnp.asarray(k, dtype),
                   v_pages=jnp.asarray(v, dtype), page_table=jnp.asarray(table),
                   kv_lens=jnp.asarray(lens), k_min=jnp.asarray(k_min, dtype),
                   k_max=jnp.asarray(k_max, dtype))


def run_tpu_interpret(fn, *args, **kwargs):
  """Runs ``fn`` under TPU interpret mode and fails on any detected data race."""
  mosaic_interpret.reset_tpu_interpret_mode_state()
  with pltpu.force_tpu_interpret_mode(TPU_INTERPRET):
    out = jax.block_until_ready(fn(*args, **kwargs))
  assert mosaic_interpret.races is not None, "the kernel did not run in TPU interpret mode"
  assert not mosaic_interpret.races.races_found, "TPU interpret mode found a data race"
  return out


def assert_close(actual, expected, dtype) -> None:
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert not np.isnan(actual).any(), "NaN in the output: a poisoned value was read"
  np.testing.assert_allclose(actual, expected, **TOLERANCE[jnp.dtype(dtype)])


def sweep_lens(queries: int, page_size: int) -> list[int]:
  """Empty slot, a slot shorter than Q (negative query positions), a length ending
  mid-page, one ending on a page boundary, and one filling most of ``M`` pages."""
  Ps = page_size
  return [0, queries // 2 + 1, Ps + Ps // 2, 2 * Ps, MAX_PAGES * Ps - 3]


def sweep_case(queries, dtype, group, page_size, seed=0):
  return make_case(seed, sweep_lens(queries, page_size), queries=queries,
                   q_heads=2 * group, kv_heads=2, page_size=page_size,
                   max_pages=MAX_PAGES, dtype=dtype)
