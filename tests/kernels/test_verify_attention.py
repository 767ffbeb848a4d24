"""Verification attention: Pallas kernel vs pure-JAX reference vs a float64 loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas
from kernels_pallas.sparse_attention import sparse_attention_kernel
from kernels_pallas.verify_attention import verify_attention_kernel, verify_attention_reference
from tests.kernels.paged_cache import (
    BF16,
    F32,
    FULL_SWEEP,
    SWEEP,
    assert_close,
    run_tpu_interpret,
    sweep_case,
    sweep_lens,
)


def naive_attention(case) -> np.ndarray:  # [S, Q, H, Dh] float64
  """Position-by-position loop in float64, straight from the layout contract."""
  q, k, v, table, lens = (np.asarray(x, np.float64) if i < 3 else np.asarray(x)
                          for i, x in enumerate(case.paged))
  S, Q, H, Dh = q.shape
  Hk, _, Ps, _ = k.shape
  out = np.zeros_like(q)
  for s in range(S):
    for t in range(Q):
      pos = lens[s] - Q + t
      keys = [(table[s, j // Ps], j % Ps) for j in range(pos + 1)]
      for h in range(H):
        if not keys:
          continue
        kv = h // (H // Hk)
        kk = np.stack([k[kv, p, r] for p, r in keys])
        vv = np.stack([v[kv, p, r] for p, r in keys])
        logits = kk @ q[s, t, h] * Dh ** -0.5
        w = np.exp(logits - logits.max())
        out[s, t, h] = w @ vv / w.sum()
  return out


@pytest.mark.parametrize("queries", [1, 7])
def test_reference_matches_float64_loop(queries):
  case = sweep_case(queries, F32, group=2, page_size=8)
  ref = np.asarray(verify_attention_reference(*case.paged))
  assert_close(ref, naive_attention(case), F32)
  assert not ref[0].any()  # empty slot
  short = sweep_lens(queries, 8)[1]
  assert not ref[1, :queries - short].any()  # queries at negative positions


@pytest.mark.parametrize("queries,dtype,group,page_size,ppb", SWEEP)
def test_kernel_matches_reference(queries, dtype, group, page_size, ppb):
  case = sweep_case(queries, dtype, group, page_size)
  ref = verify_attention_reference(*case.paged)
  out = verify_attention_kernel(*case.paged, pages_per_block=ppb, interpret=True)
  assert out.dtype == jnp.float32 and out.shape == case.q.shape
  assert_close(out, ref, dtype)
  out = run_tpu_interpret(verify_attention_kernel, *case.paged, pages_per_block=ppb)
  assert_close(out, ref, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("queries,dtype,group,page_size,ppb", FULL_SWEEP)
def test_kernel_matches_reference_full_sweep(queries, dtype, group, page_size, ppb):
  case = sweep_case(queries, dtype, group, page_size, seed=1)
  out = run_tpu_interpret(verify_attention_kernel, *case.paged, pages_per_block=ppb)
  assert_close(out, verify_attention_reference(*case.paged), dtype)


def test_mixed_query_and_cache_dtypes():
  case = sweep_case(4, BF16, group=2, page_size=8)
  q32 = case.q.astype(F32)
  args = (q32, *case.paged[1:])
  assert_close(verify_attention_kernel(*args, pages_per_block=2, interpret=True),
               verify_attention_reference(*args), BF16)


def test_dispatch():
  case = sweep_case(2, F32, group=2, page_size=8)
  ref = verify_attention_reference(*case.paged)
  assert_close(kernels_pallas.verify_attention(*case.paged, impl="xla"), ref, F32)
  assert_close(kernels_pallas.verify_attention(*case.paged, impl="pallas", interpret=True),
               ref, F32)
  # CPU has no compiled kernel: asking for it is an error, not the reference in disguise
  with pytest.raises(ValueError, match="no verify_attention kernel for backend 'cpu'"):
    kernels_pallas.verify_attention(*case.paged, impl="pallas")
  with pytest.raises(ValueError, match="unknown attention impl"):
    kernels_pallas.verify_attention(*case.paged, impl="triton")


def test_default_block_sizes_per_backend():
  assert kernels_pallas.default_pages_per_block(16, "tpu") == 32
  assert kernels_pallas.default_pages_per_block(16, "cpu") == 8
  assert kernels_pallas.default_pages_per_block(1024, "tpu") == 1


def test_validation_rejects_bad_inputs():
  q, k, v, table, lens = sweep_case(2, F32, group=2, page_size=8).paged
  with pytest.raises(ValueError, match="v_pages"):
    verify_attention_reference(q, k, v[:, :-1], table, lens)
  with pytest.raises(ValueError, match="not a multiple"):
    verify_attention_reference(q[:, :, :3], k, v, table, lens)
  with pytest.raises(ValueError, match="kv_lens"):
    verify_attention_reference(q, k, v, table, lens[:-1])
  with pytest.raises(ValueError, match="int32"):
    verify_attention_reference(q, k, v, table.astype(jnp.int16), lens)
  with pytest.raises(ValueError, match="pages_per_block"):
    verify_attention_kernel(q, k, v, table, lens, pages_per_block=0, interpret=True)
  with pytest.raises(ValueError, match="page_size % 8"):
    verify_attention_kernel(q, k[:, :, :4], v[:, :, :4], table, lens, pages_per_block=1)


def test_kernels_lower_to_mosaic():
  """Both kernels trace and lower to Mosaic MLIR for TPU at production-like sizes."""
  S, Q, H, Hk, Dh, P, Ps, M, B = 4, 4, 32, 8, 128, 64, 16, 16, 8
  spec = jax.ShapeDtypeStruct
  paged = (spec((S, Q, H, Dh), BF16), spec((Hk, P, Ps, Dh), BF16),
           spec((Hk, P, Ps, Dh), BF16), spec((S, M), jnp.int32), spec((S,), jnp.int32))
  sel = (spec((S, Hk, B), jnp.int32), spec((S, Hk, B), jnp.bool_))
  for fn, args in ((verify_attention_kernel, paged), (sparse_attention_kernel, paged + sel)):
    text = fn.trace(*args, pages_per_block=4).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
