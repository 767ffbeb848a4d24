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
``log π_θ`` is the learner's recomputation (`learner._micro_loss`), likewise raw. So
with the rollout's parameters ``ρ = 1`` up to numerics (the logged ``logprob_gap``),
and the clip range bounds the policy's change alone: a processed ``π_old`` against a
raw ``π_θ`` would start every update at ``ρ = π_raw / π_processed ≠ 1`` whenever
temperature ≠ 1 or top-k/top-p truncate, spending the clip range on the sampling
settings. What this leaves out: the gap between the processed sampling distribution
and ``π_θ`` is not importance-weighted (none at temperature 1 without truncation).

Policy losses (``POLICY_LOSSES``; one signature: per-token quantities in, per-token
loss out; a loss that also takes the keyword ``prox_logp`` gets the proximal policy's
log-probs, `takes_proximal`):

  ppo_clip       ℓ_t = -min(ρ_t A_i, clip(ρ_t, 1 - ε_low, 1 + ε_high) A_i)
                 (Schulman et al., 2017; GRPO's surrogate; ε_high > ε_low is DAPO's
                 clip-higher)
  decoupled_ppo  ℓ_t = -w_t · min(r_t A_i, clip(r_t, 1 - ε_low, 1 + ε_high) A_i),
                 r_t = π_θ / π_prox,  w_t = min(π_prox / π_behav, c)
                 (decoupled PPO, Hilton et al., 2022, as AReaL runs it for asynchronous
                 RL; the truncation is V-trace's, Espeholt et al., 2018)

In asynchronous RL the behaviour policy ``π_behav`` (``π_old`` above: the engine's
log-probs) may be up to ``max_staleness`` updates older than ``π_θ``. Decoupled PPO
measures the trust region from the proximal policy ``π_prox`` (the learner's parameters
at the start of the update: the learner recomputes its log-probs) instead, so the clip
bounds this update's change alone, and corrects the behaviour/proximal gap with the
importance weight ``w_t``, truncated at ``c`` (``learner.importance_cap``) to bound its
variance; ``w_t`` carries no gradient. Tokens the learner's current parameters sampled
(staleness 0) have ``π_prox = π_behav`` (the same parameters: the learner takes the
engine's log-probs), so ``w_t = min(1, c)`` and, for ``c >= 1``, the loss is
``ppo_clip``'s exactly.

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

Drafter distillation (``DISTILL_LOSSES``; one signature: student and teacher logits in,
per-token divergence out). The teacher ``p`` is the policy's next-token distribution,
the student ``q`` the drafter's, both at the sampling temperature ``τ`` (the
distributions speculative sampling compares; raw logits at ``τ = 0``):

  forward_kl  d_t = KL(p || q) = Σ_v p (log p - log q)   (mass-covering; SFT's
              distillation, equal in gradient to the soft cross-entropy -Σ p log q)
  reverse_kl  d_t = KL(q || p) = Σ_v q (log q - log p)   (mode-seeking)
  tv          d_t = ½ Σ_v |p - q| = 1 - α_t              (directly the rejection rate)

where ``α_t = Σ_v min(p, q)`` is the probability that speculative sampling accepts a
draft token at position t (Leviathan et al., 2023), logged as the drafter/policy
agreement. Per-sequence weights (``DRAFT_WEIGHTINGS``) turn ``d`` into the drafter's
loss ``L_draft = Σ_{i,t} w_{i,t} d_{i,t}``, again normalised over the whole mini-batch:

  uniform  w_{i,t} = m_{i,t} / Σ m                          (token mean)
  reward   w_{i,t} = m_{i,t} e^{r_i/τ_r} / Σ_{j,u} m_{j,u} e^{r_j/τ_r}

``reward`` is ReSpec's reward-weighted distillation: the drafter spends its capacity on
the responses the policy is being pushed towards (high reward ``r_i``), which the next
rollouts sample more often; the exponentiated form is reward-weighted regression's
(Peters & Schaal, 2007), ``τ_r`` (``reward_temperature``) sets how sharply it favours
them, and ``τ_r → ∞`` is ``uniform``.

Shape legend: B responses, T time, V vocab.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class LossParams:
  """Hyper-parameters of the policy loss (ε_low, ε_high, β, the importance cap c)."""

  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.2
  kl_coef: float = 0.0
  importance_cap: float = 5.0


# (log π_θ [B,T], log π_old [B,T], A [B], params[, *, prox_logp=log π_prox [B,T]])
#   -> (ℓ [B,T], clipped [B,T] bool)
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


def truncated_importance_weight(prox_logp, behav_logp, cap: float):
  """``w_t = min(π_prox / π_behav, c)`` per token, ``[B, T]``, no gradient."""
  w = jnp.minimum(jnp.exp(prox_logp - behav_logp), cap)
  return jax.lax.stop_gradient(w)


def decoupled_ppo(logp, old_logp, adv, p: LossParams, *, prox_logp):
  """Decoupled PPO (module docstring): PPO-clip against ``π_prox``, weighted by
  ``w_t = min(π_prox / π_behav, c)``; ``old_logp`` is ``log π_behav``."""
  loss, clipped = ppo_clip(logp, prox_logp, adv, p)
  return truncated_importance_weight(prox_logp, old_logp, p.importance_cap) * loss, clipped


POLICY_LOSSES: dict[str, PolicyLossFn] = {"ppo_clip": ppo_clip,
                                          "decoupled_ppo": decoupled_ppo}


def takes_proximal(fn: PolicyLossFn) -> bool:
  """Whether the loss ``fn`` takes the proximal policy's log-probs (``prox_logp``), which
  the learner then recomputes at the start of each update."""
  return "prox_logp" in inspect.signature(fn).parameters


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


# (student logits [B,T,V], teacher logits [B,T,V]) -> d [B,T]
DistillLossFn = Callable[[jax.Array, jax.Array], jax.Array]
# (mask [B,T], rewards [B], reward_temperature) -> w [B,T]
DraftWeightingFn = Callable[[np.ndarray, np.ndarray, float], np.ndarray]


def forward_kl(student, teacher):
  logq, logp = jax.nn.log_softmax(student), jax.nn.log_softmax(teacher)
  return (jnp.exp(logp) * (logp - logq)).sum(-1)


def reverse_kl(student, teacher):
  logq, logp = jax.nn.log_softmax(student), jax.nn.log_softmax(teacher)
  return (jnp.exp(logq) * (logq - logp)).sum(-1)


def total_variation(student, teacher):
  return 0.5 * jnp.abs(jax.nn.softmax(student) - jax.nn.softmax(teacher)).sum(-1)


DISTILL_LOSSES: dict[str, DistillLossFn] = {
    "forward_kl": forward_kl,
    "reverse_kl": reverse_kl,
    "tv": total_variation,
}


def acceptance_prob(student: jax.Array, teacher: jax.Array) -> jax.Array:
  """``α_t = Σ_v min(p, q)`` per position of logits ``[B, T, V]`` → ``[B, T]``."""
  return jnp.minimum(jax.nn.softmax(student), jax.nn.softmax(teacher)).sum(-1)


def distill_loss(name: str, student: jax.Array, teacher: jax.Array,
                 temperature: float = 1.0) -> jax.Array:
  """``d[B, T]`` of the registered loss ``name`` between the student's and the
  teacher's logits ``[B, T, V]`` at ``temperature`` (0: the raw logits). The teacher
  gets no gradient."""
  if name not in DISTILL_LOSSES:
    raise KeyError(f"unknown distillation loss {name!r}; known: {sorted(DISTILL_LOSSES)}")
  scale = 1.0 / temperature if temperature > 0 else 1.0
  return DISTILL_LOSSES[name](student * scale, jax.lax.stop_gradient(teacher) * scale)


def uniform_weights(mask: np.ndarray, rewards: np.ndarray, temperature: float) -> np.ndarray:
  del rewards, temperature
  return mask / max(mask.sum(), 1.0)


def reward_weights(mask: np.ndarray, rewards: np.ndarray, temperature: float) -> np.ndarray:
  r = np.asarray(rewards, np.float64)[:, None] / temperature
  w = mask * np.exp(r - r.max())  # the max cancels in the normalisation
  return w / max(w.sum(), np.finfo(np.float64).tiny)


DRAFT_WEIGHTINGS: dict[str, DraftWeightingFn] = {
    "uniform": uniform_weights,
    "reward": reward_weights,
}


def draft_weights(name: str, mask: np.ndarray, rewards: np.ndarray,
                  temperature: float) -> np.ndarray:
  """``w[B, T]`` (float32) of the drafter weighting ``name`` for a mini-batch."""
  if name not in DRAFT_WEIGHTINGS:
    raise KeyError(f"unknown drafter weighting {name!r}; known: {sorted(DRAFT_WEIGHTINGS)}")
  return DRAFT_WEIGHTINGS[name](np.asarray(mask, np.float64), rewards,
                                temperature).astype(np.float32)


def entropy(logits: jax.Array) -> jax.Array:
  """``H_t = -Σ_v π(v) log π(v)`` of ``logits[B, T, V]`` → ``[B, T]``."""
  logp = jax.nn.log_softmax(logits)
  return -(jnp.exp(logp) * logp).sum(-1)
