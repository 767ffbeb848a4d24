"""Policy losses and loss aggregations, behind two registries.

Notation (per response token t of response i): ``π_θ`` the policy being trained,
``π_old`` the behaviour policy that sampled the rollout (its logprobs come with the
rollout: the target's verification logprobs), ``ρ_t = exp(log π_θ - log π_old)`` the
importance ratio, ``A_i`` the response's advantage (advantages.py), ``ε_low/ε_high``
the clip range, ``β`` the KL coefficient, ``π_ref`` the frozen reference.

Which distribution the ratio's log-probs are of: both sides are the *raw* policy,
``log_softmax`` of the unprocessed logits. ``log π_old`` is the rollout's
``Response.policy_logprobs`` (the target's logits at the verification that emitted
the token, also for speculative rollouts: never the draft's), not ``Response.logprobs``
of the processed distribution (temperature, top-k, top-p) the token was drawn from;
``log π_θ`` is the learner's recomputation (`learner._token_logps`), likewise raw. So
with the rollout's parameters ``ρ = 1`` up to numerics (the logged ``logprob_gap``),
and the clip range bounds the policy's change alone: a processed ``π_old`` against a
raw ``π_θ`` would start every update at ``ρ = π_raw / π_processed ≠ 1`` whenever
temperature ≠ 1 or top-k/top-p truncate, spending the clip range on the sampling
settings. What this leaves out: the gap between the processed sampling distribution
and ``π_θ`` is not importance-weighted (none at temperature 1 without truncation).

Policy losses (``POLICY_LOSSES``; one signature: per-token quantities in, per-token
loss out):

  ppo_clip   ℓ_t = -min(ρ_t A_i, clip(ρ_t, 1 - ε_low, 1 + ε_high) A_i)
             (Schulman et al., 2017; GRPO's surrogate; ε_high > ε_low is DAPO's
             clip-higher)

KL penalty (optional, ``β > 0``): ``ℓ_t += β · k3_t`` with the unbiased, non-negative
estimator ``k3_t = exp(log π_ref - log π_θ) - (log π_ref - log π_θ) - 1`` of
``KL(π_θ || π_ref)`` (Schulman, 2020; as in GRPO).

Aggregations (``AGGREGATIONS``) turn per-token losses into one scalar as
``L = Σ_{i,t} w_{i,t} ℓ_{i,t}`` with weights computed on the whole mini-batch, so that
accumulating gradients over micro-batches gives exactly the mini-batch gradient:

  token_mean    w = m / Σ m                       (token-level: DAPO, Dr.GRPO-style)
  seq_mean      w = m / (|o_i| · N)               (sequence-level: original GRPO)
  seq_sum_norm  w = m / (L_max · N)               (Dr.GRPO: constant normaliser)

where ``m`` is the response-token mask, ``|o_i|`` response i's length, ``N`` the
responses in the mini-batch and ``L_max`` the response length cap.

Shape legend: B responses, T time, V vocab.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class LossParams:
  """Hyper-parameters of the policy loss (ε_low, ε_high, β)."""

  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.2
  kl_coef: float = 0.0


# (log π_θ [B,T], log π_old [B,T], A [B], params) -> (ℓ [B,T], clipped [B,T] bool)
PolicyLossFn = Callable[[jax.Array, jax.Array, jax.Array, LossParams],
                        tuple[jax.Array, jax.Array]]
# (mask [B,T], max_response_len) -> w [B,T]
AggregationFn = Callable[[np.ndarray, int], np.ndarray]


def ppo_clip(logp, old_logp, adv, p: LossParams):
  """PPO's clipped surrogate; ``logp`` and ``old_logp`` are both raw-policy log-probs
  (the module docstring says why)."""
  ratio = jnp.exp(logp - old_logp)  # ρ [B, T]
  a = adv[:, None]
  unclipped = ratio * a
  clipped = jnp.clip(ratio, 1.0 - p.clip_eps_low, 1.0 + p.clip_eps_high) * a
  return -jnp.minimum(unclipped, clipped), clipped < unclipped


POLICY_LOSSES: dict[str, PolicyLossFn] = {"ppo_clip": ppo_clip}


def kl_k3(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
  """``k3 = exp(log π_ref - log π_θ) - (log π_ref - log π_θ) - 1`` per token, >= 0."""
  d = ref_logp - logp
  return jnp.exp(d) - d - 1.0


def token_mean(mask: np.ndarray, max_len: int) -> np.ndarray:
  del max_len
  return mask / max(mask.sum(), 1.0)


def seq_mean(mask: np.ndarray, max_len: int) -> np.ndarray:
  del max_len
  lengths = np.maximum(mask.sum(axis=1, keepdims=True), 1.0)
  return mask / lengths / max((mask.sum(axis=1) > 0).sum(), 1)


def seq_sum_norm(mask: np.ndarray, max_len: int) -> np.ndarray:
  return mask / (max_len * max((mask.sum(axis=1) > 0).sum(), 1))


AGGREGATIONS: dict[str, AggregationFn] = {
    "token_mean": token_mean,
    "seq_mean": seq_mean,
    "seq_sum_norm": seq_sum_norm,
}


def get_policy_loss(name: str) -> PolicyLossFn:
  if name not in POLICY_LOSSES:
    raise KeyError(f"unknown policy loss {name!r}; known: {sorted(POLICY_LOSSES)}")
  return POLICY_LOSSES[name]


def aggregation_weights(name: str, mask: np.ndarray, max_len: int) -> np.ndarray:
  """``w[B, T]`` (float32) of the aggregation ``name`` for a mini-batch's ``mask``.

  Rows without response tokens (padding) count as no response.
  """
  if name not in AGGREGATIONS:
    raise KeyError(f"unknown loss aggregation {name!r}; known: {sorted(AGGREGATIONS)}")
  return AGGREGATIONS[name](np.asarray(mask, np.float32), max_len).astype(np.float32)


def entropy(logits: jax.Array) -> jax.Array:
  """``H_t = -Σ_v π(v) log π(v)`` of ``logits[B, T, V]`` → ``[B, T]``."""
  logp = jax.nn.log_softmax(logits)
  return -(jnp.exp(logp) * logp).sum(-1)
