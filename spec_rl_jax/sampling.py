"""Logit processing shared by plain sampling and the speculative verifier.

`process_logits` turns raw logits into the log-probabilities of the *processed*
sampling distribution (temperature, then top-k, then top-p, as in HF/vLLM). Plain
sampling draws from it; the rejection sampler applies the same function to target and
draft logits so ``p`` and ``q`` are processed identically.

Greedy is ``temperature == 0``: the processed distribution is a point mass on the
argmax (ties broken towards the lowest id).
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


def process_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """``logits[..., V]`` → log-probs ``[..., V]`` of the processed distribution (fp32)."""
  logits = logits.astype(jnp.float32)
  if params.greedy:
    top = jnp.argmax(logits, axis=-1)
    return jnp.where(jax.nn.one_hot(top, logits.shape[-1], dtype=bool), 0.0, NEG_INF)
  logits = logits / params.temperature
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
  return jax.nn.log_softmax(logits, axis=-1)


def sample(key: jax.Array, logprobs: jax.Array) -> jax.Array:
  """Draws ids from processed ``logprobs[..., V]`` (``key`` shaped like the batch or scalar)."""
  return jax.random.categorical(key, logprobs, axis=-1)
