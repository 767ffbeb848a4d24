"""Logit processing shared by plain sampling and the speculative verifier.

`process_logits` turns raw logits into the log-probabilities of the *processed*
sampling distribution (temperature, then top-k, then top-p, as in HF/vLLM). Plain
sampling draws from it; the rejection sampler applies the same function to target and
draft logits so ``p`` and ``q`` are processed identically.

Greedy is ``temperature == 0``: the processed distribution is a point mass on the
argmax (ties broken towards the lowest id). The temperature may differ per row (per
request); top-k and top-p are shared.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  temperature: float = 1.0  # 0 = greedy
  top_k: int = 0  # 0 = off
  top_p: float = 1.0  # 1 = off

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def process_logits(logits: jax.Array, params: SamplingParams,
                   temperature: jax.Array | None = None) -> jax.Array:
  """``logits[..., V]`` → log-probs ``[..., V]`` of the processed distribution (fp32).

  ``temperature`` (broadcastable to ``logits.shape[:-1]``, e.g. one per slot) replaces
  ``params.temperature`` row by row; rows at 0 are greedy. Top-k and top-p are the same
  for every row (static: they decide the shape of the work).
  """
  logits = logits.astype(jnp.float32)
  t = jnp.broadcast_to(jnp.asarray(params.temperature if temperature is None else temperature,
                                   jnp.float32), logits.shape[:-1])[..., None]
  greedy = t == 0
  top = jnp.argmax(logits, axis=-1)
  point_mass = jnp.where(jax.nn.one_hot(top, logits.shape[-1], dtype=bool), 0.0, NEG_INF)
  logits = logits / jnp.where(greedy, 1.0, t)
  V = logits.shape[-1]
  if params.top_k and params.top_k < V:
    kth = jax.lax.top_k(logits, params.top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, NEG_INF, logits)
  if params.top_p < 1.0:
    # Keep the smallest prefix of the sorted distribution whose mass reaches top_p
    # (the token that crosses the threshold is kept).
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < params.top_p
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, NEG_INF, logits)
  return jnp.where(greedy, point_mass, jax.nn.log_softmax(logits, axis=-1))


CDF_BLOCK = 128  # ids per block of the two-level inverse CDF


def inverse_cdf(u: jax.Array, probs: jax.Array) -> jax.Array:
  """The id ``i`` with ``F(i-1) <= u·F(V-1) < F(i)``, ``F`` the running sum of
  ``probs[..., V]`` (non-negative, any total), for uniforms ``u[...]`` in ``[0, 1)``.

  Two levels: the masses of blocks of `CDF_BLOCK` ids pick a block, then the running
  sum inside that block picks the id, so only ``V / 128`` block sums and one block are
  scanned (several times faster than a flat running sum over a 151k vocabulary, and
  than the Gumbel-max trick), and the inner sums stay on the scale of one block. Ids
  with zero probability are never returned, also when rounding puts ``u·F(V-1)`` at or
  past the last step.
  """
  V = probs.shape[-1]
  C = min(CDF_BLOCK, V)
  nb = -(-V // C)
  pad = [(0, 0)] * (probs.ndim - 1) + [(0, nb * C - V)]
  blocks = jnp.pad(probs.astype(jnp.float32), pad).reshape(*probs.shape[:-1], nb, C)
  mass = blocks.sum(-1)  # [..., nb]
  cdf = jnp.cumsum(mass, axis=-1)
  x = u * cdf[..., -1]
  b = jnp.minimum(jnp.sum(cdf <= x[..., None], -1), _last_positive(mass))  # [...]
  before = jnp.take_along_axis(cdf, b[..., None], -1)[..., 0] - jnp.take_along_axis(
      mass, b[..., None], -1)[..., 0]
  row = jnp.take_along_axis(blocks, b[..., None, None], -2)[..., 0, :]  # [..., C]
  r = x - before
  j = jnp.minimum(jnp.sum(jnp.cumsum(row, axis=-1) <= r[..., None], -1), _last_positive(row))
  return (b * C + j).astype(jnp.int32)


def _last_positive(w: jax.Array) -> jax.Array:
  """Index of the last positive entry along the last axis."""
  return w.shape[-1] - 1 - jnp.argmax(w[..., ::-1] > 0, axis=-1)


def sample(key: jax.Array, logprobs: jax.Array) -> jax.Array:
  """Draws one id per row of processed ``logprobs[..., V]``: `inverse_cdf` at one
  uniform per row from ``key`` (one random number per draw, not one per id as the
  Gumbel-max trick needs — with a 151k vocabulary that is most of a CPU decode step)."""
  return inverse_cdf(jax.random.uniform(key, logprobs.shape[:-1]), jnp.exp(logprobs))
