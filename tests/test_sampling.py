"""Logit processing: the processed distribution is the one HF/vLLM define, and sampling
from it is exact."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_rl_jax.sampling import CDF_BLOCK, SamplingParams, inverse_cdf, process_logits, sample
from tests.stats import chi2_quantile, chi2_stat


def _probs(logits, **kw):
  return np.exp(np.asarray(process_logits(jnp.asarray(logits), SamplingParams(**kw))))


def test_greedy_is_point_mass_on_argmax():
  p = _probs([0.1, 2.0, -1.0, 2.0], temperature=0.0)
  np.testing.assert_array_equal(p, [0, 1, 0, 0])  # ties -> lowest id


def test_temperature_only():
  logits = np.array([1.0, 2.0, 3.0])
  want = np.exp(logits / 0.5) / np.exp(logits / 0.5).sum()
  np.testing.assert_allclose(_probs(logits, temperature=0.5), want, rtol=1e-6)


def test_top_k_keeps_exactly_k_and_renormalises():
  logits = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15]))
  p = _probs(logits, top_k=2)
  np.testing.assert_allclose(p, [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0], rtol=1e-6)


@pytest.mark.parametrize("top_p,kept", [(0.4, [1]), (0.41, [1, 3]), (0.7, [1, 3]),
                                        (0.71, [1, 3, 4]), (1.0, [0, 1, 2, 3, 4])])
def test_top_p_keeps_smallest_prefix_reaching_mass(top_p, kept):
  probs = np.array([0.05, 0.4, 0.1, 0.3, 0.15])
  p = _probs(np.log(probs), top_p=top_p)
  assert sorted(np.flatnonzero(p)) == kept
  np.testing.assert_allclose(p[kept], probs[kept] / probs[kept].sum(), rtol=1e-5)


def test_top_k_then_top_p():
  probs = np.array([0.05, 0.4, 0.1, 0.3, 0.15])
  # top_k=3 keeps {1,3,4} renormalised to {.47,.35,.18}; top_p=0.8 then keeps {1,3}.
  p = _probs(np.log(probs), top_k=3, top_p=0.8)
  assert sorted(np.flatnonzero(p)) == [1, 3]


def test_sampling_matches_processed_distribution():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=16) * 2)
  params = SamplingParams(temperature=0.9, top_k=10, top_p=0.85)
  lp = process_logits(logits, params)
  n = 20_000
  keys = jax.random.split(jax.random.key(0), n)
  draws = np.asarray(jax.vmap(lambda k: sample(k, lp))(keys))
  p = np.exp(np.asarray(lp))
  counts = np.bincount(draws, minlength=16)
  assert counts[p == 0].sum() == 0
  chi2, df = chi2_stat(counts, p)
  assert chi2 < chi2_quantile(df), (chi2, df)


@pytest.mark.parametrize("V", [5, CDF_BLOCK, 3 * CDF_BLOCK + 17])
def test_inverse_cdf_matches_float64_search(V):
  """On a fine grid of uniforms: the id a float64 CDF search gives, never a zero-
  probability id (zeros inside blocks, whole zero blocks, a zero last id)."""
  rng = np.random.default_rng(V)
  p = rng.random(V) ** 4
  p[rng.random(V) < 0.3] = 0
  p[-1] = 0
  if V > 2 * CDF_BLOCK:
    p[CDF_BLOCK:2 * CDF_BLOCK] = 0
  u = np.linspace(0, 1, 20_001)[:-1]
  got = np.asarray(inverse_cdf(jnp.asarray(u, jnp.float32),
                               jnp.broadcast_to(jnp.asarray(p, jnp.float32), (len(u), V))))
  F = np.cumsum(p)
  want = np.searchsorted(F, u * F[-1], side="right")
  assert (p[got] > 0).all()
  np.testing.assert_array_equal(got, want)
  # The largest uniform below 1 (rounding may put u·F at the top): the last positive id.
  top = inverse_cdf(jnp.float32(np.nextafter(np.float32(1), np.float32(0))), jnp.asarray(p))
  assert int(top) == np.flatnonzero(p)[-1]


def test_inverse_cdf_keeps_small_probabilities_in_a_long_vocabulary():
  """151,936 ids, one dominant: the ids of probability 1e-9 after it (each far below
  the fp32 resolution of a running sum near 1) hold 1.5e-4 of the mass together, and
  the uniforms that return them cover that share of [0, 1)."""
  V, tiny = 151_936, 1e-9
  p = np.full(V, tiny, np.float32)
  p[7] = 1 - tiny * (V - 1)
  tail = tiny * (V - 8)  # mass after the dominant id
  pick = jax.jit(lambda u: inverse_cdf(u, jnp.asarray(p)))
  lo, hi = np.float32(0.5), np.float32(1 - 2 ** -24)  # pick(lo) == 7, pick(hi) > 7
  assert int(pick(lo)) == 7 and int(pick(hi)) > 7
  for _ in range(40):  # bisect the uniform where the tail starts
    mid = np.float32((lo + hi) / 2)
    lo, hi = (mid, hi) if int(pick(mid)) <= 7 else (lo, mid)
  np.testing.assert_allclose(1 - float(hi), tail, rtol=0.1)


def test_invalid_params():
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0.0)
  with pytest.raises(ValueError, match="temperature"):
    SamplingParams(temperature=-1.0)
