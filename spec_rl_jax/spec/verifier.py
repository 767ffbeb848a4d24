"""Exact batched rejection sampler (Leviathan et al. 2023; Chen et al. 2023).

Glossary and shape legend (``S`` slots, ``K`` draft length, ``V`` vocab):
  x_i      draft token ``i`` (``draft_tokens[:, i]``, i = 0..K-1)
  q_i      draft distribution that produced ``x_i`` (``[S, K, V]``), or a point mass
           for deterministic drafters (n-gram): ``q_i(x_i) = 1``
  p_i      target distribution for the token at draft position ``i`` (``i = 0..K``,
           ``p_K`` is the bonus position), from one verification forward
  accept   ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``, left to right
  residual at the first rejection ``j``, sample from ``norm(max(p_j − q_j, 0))``;
           if all ``K`` are accepted, sample the bonus token from ``p_K``

Both ``p`` and ``q`` are the *processed* distributions (same temperature / top-k /
top-p, `spec_rl_jax.sampling.process_logits`), so the emitted tokens follow exactly the
distribution plain sampling would. Greedy (temperature 0) makes ``p`` a point mass on
the argmax: a draft is accepted iff it equals the argmax, and the correction is the
argmax — so greedy SD emits exactly the greedy AR tokens.

Randomness is per slot: ``keys[S]`` (derived from request id and position by the
engine) give ``K + 1`` uniforms — one acceptance test per draft position, and the
inverse-CDF draw (`spec_rl_jax.sampling.inverse_cdf`) of the residual/bonus token.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from spec_rl_jax.sampling import SamplingParams, inverse_cdf, process_logits


class Verification(NamedTuple):
  tokens: jax.Array  # [S, K+1] int32: accepted drafts, then the correction/bonus token
  num_emitted: jax.Array  # [S] int32 in 1..K+1 (= accepted + 1)
  logprobs: jax.Array  # [S, K+1] fp32: log p_i(token) under the processed target
  policy_logprobs: jax.Array  # [S, K+1] fp32: log-softmax of the raw target logits
  accepted: jax.Array  # [S, K] bool: draft i accepted (False after the first rejection)


def residual_distribution(p: jax.Array, q: jax.Array) -> jax.Array:
  """``max(p − q, 0)`` over the last axis, unnormalised (`inverse_cdf` draws from any
  total; ``q = 0`` gives ``p``: the bonus)."""
  residual = jnp.maximum(p - q, 0.0)
  # No mass only through rounding when p ≈ q; then p itself is exact enough.
  return jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p)


def verify(keys: jax.Array, draft_tokens: jax.Array, draft_logprobs: jax.Array | None,
           target_logits: jax.Array, params: SamplingParams,
           temperature: jax.Array | None = None) -> Verification:
  """Accept/reject ``draft_tokens[S, K]`` against ``target_logits[S, K+1, V]``.

  Args:
    keys: ``[S]`` PRNG keys, one stream per slot.
    draft_tokens: ``[S, K]`` int proposals.
    draft_logprobs: ``[S, K, V]`` processed draft log-probs, or ``None`` for a point
      mass on each draft token.
    target_logits: ``[S, K+1, V]`` raw target logits at the K+1 verified positions.
    params: sampling parameters applied to the target (the draft's were applied by the
      proposer with the same function).
    temperature: ``[S]`` per-slot temperatures replacing ``params.temperature`` (0:
      greedy), or ``None``.
  """
  S, K = draft_tokens.shape
  V = target_logits.shape[-1]
  logp = process_logits(target_logits, params,
                        None if temperature is None else temperature[:, None])  # [S, K+1, V]
  policy_lp = jax.nn.log_softmax(target_logits.astype(jnp.float32), axis=-1)
  p = jnp.exp(logp)
  x = draft_tokens.astype(jnp.int32)
  onehot_x = jax.nn.one_hot(x, V, dtype=jnp.float32)  # [S, K, V]
  q = onehot_x if draft_logprobs is None else jnp.exp(draft_logprobs.astype(jnp.float32))

  p_x = jnp.take_along_axis(p[:, :K], x[..., None], axis=-1)[..., 0]  # [S, K]
  q_x = jnp.take_along_axis(q, x[..., None], axis=-1)[..., 0]
  u = jax.vmap(lambda k: jax.random.uniform(k, (K + 1,)))(keys)  # [S, K+1]
  # u_i < p/q  <=>  u_i·q < p (q_x > 0 for tokens the draft sampled).
  ok = u[:, :K] * q_x < p_x
  accepted = jnp.cumprod(ok, axis=1).astype(bool)  # [S, K]
  n_acc = accepted.sum(axis=1)  # [S] in 0..K

  # Distribution of the extra token: residual at the first rejection, p_K if none.
  q_pad = jnp.concatenate([q, jnp.zeros((S, 1, V), q.dtype)], axis=1)  # q_K := 0
  p_j = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]  # [S, V]
  q_j = jnp.take_along_axis(q_pad, n_acc[:, None, None], axis=1)[:, 0]
  extra = inverse_cdf(u[:, K], residual_distribution(p_j, q_j))

  pos = jnp.arange(K + 1)[None, :]
  x_pad = jnp.concatenate([x, jnp.zeros((S, 1), jnp.int32)], axis=1)
  tokens = jnp.where(pos < n_acc[:, None], x_pad,
                     jnp.where(pos == n_acc[:, None], extra[:, None], 0))
  pick = lambda a: jnp.take_along_axis(a, tokens[..., None], axis=-1)[..., 0]
  emitted = pos <= n_acc[:, None]
  return Verification(
      tokens=tokens, num_emitted=(n_acc + 1).astype(jnp.int32),
      logprobs=jnp.where(emitted, pick(logp), 0.0),
      policy_logprobs=jnp.where(emitted, pick(policy_lp), 0.0),
      accepted=accepted)
