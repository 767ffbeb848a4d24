"""Decoupled PPO (the off-policy correction of asynchronous RL) against a hand
computation, its staleness-0 identity with PPO-clip, and the learner's proximal
log-probs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_rl_jax.config import LearnerConfig
from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.transformer import init_decoder, teacher_forced
from spec_rl_jax.rl import losses
from spec_rl_jax.rl.learner import Learner, target_logp
from tests.rl_fixtures import random_rollouts

P = losses.LossParams(clip_eps_low=0.2, clip_eps_high=0.3, importance_cap=2.0)


def _numpy_decoupled(logp, behav, prox, adv, eps_low, eps_high, cap):
  """-min(π_prox/π_behav, c) · min(r A, clip(r, 1-ε_low, 1+ε_high) A), r = π_θ/π_prox."""
  r = np.exp(logp - prox)
  a = adv[:, None]
  surrogate = np.minimum(r * a, np.clip(r, 1 - eps_low, 1 + eps_high) * a)
  return -np.minimum(np.exp(prox - behav), cap) * surrogate


def test_decoupled_ppo_hand_computed():
  # π_θ / π_prox = 1.5, 0.5, 1.0, 1.2 ; π_prox / π_behav = 3 (truncated to 2), 0.5, 1, 1.
  prox = np.log(np.array([[0.3, 0.2, 0.4, 0.5]]))
  behav = prox - np.log(np.array([[3.0, 0.5, 1.0, 1.0]]))
  logp = prox + np.log(np.array([[1.5, 0.5, 1.0, 1.2]]))
  for a in (1.0, -1.0):
    adv = np.array([a])
    loss, clipped = losses.decoupled_ppo(jnp.asarray(logp), jnp.asarray(behav),
                                         jnp.asarray(adv), P, prox_logp=jnp.asarray(prox))
    want = _numpy_decoupled(logp, behav, prox, adv, 0.2, 0.3, 2.0)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    # By hand, A = +1: w · min(r, clip(r)) = 2·1.3, 0.5·0.5, 1·1, 1·1.2.
    if a > 0:
      np.testing.assert_allclose(loss, [[-2.6, -0.25, -1.0, -1.2]], rtol=1e-5)
      np.testing.assert_array_equal(clipped, [[True, False, False, False]])
    else:  # max(r, clip(r)) = 1.5, 0.8 (clipped), 1, 1.2
      np.testing.assert_allclose(loss, [[3.0, 0.4, 1.0, 1.2]], rtol=1e-5)
      np.testing.assert_array_equal(clipped, [[False, True, False, False]])


def test_random_inputs_match_the_numpy_formula():
  rng = np.random.default_rng(0)
  logp, behav, prox = (rng.normal(-2, 0.5, (3, 7)).astype(np.float32) for _ in range(3))
  adv = rng.normal(size=3).astype(np.float32)
  loss, _ = losses.decoupled_ppo(jnp.asarray(logp), jnp.asarray(behav), jnp.asarray(adv),
                                 P, prox_logp=jnp.asarray(prox))
  np.testing.assert_allclose(loss, _numpy_decoupled(logp, behav, prox, adv, 0.2, 0.3, 2.0),
                             rtol=1e-5, atol=1e-6)


def test_importance_weight_carries_no_gradient():
  rng = np.random.default_rng(1)
  logp, behav, prox = (jnp.asarray(rng.normal(-2, 0.5, (2, 5)), jnp.float32)
                       for _ in range(3))
  adv = jnp.asarray([1.0, -0.5])
  g_prox = jax.grad(lambda x: losses.decoupled_ppo(logp, behav, adv, P, prox_logp=x)[0]
                    .sum())(prox)
  # Only through r = π_θ / π_prox, never through w: d/d prox = -d/d logp.
  g_logp = jax.grad(lambda x: losses.decoupled_ppo(x, behav, adv, P, prox_logp=prox)[0]
                    .sum())(logp)
  np.testing.assert_allclose(g_prox, -g_logp, rtol=1e-6)


@pytest.mark.parametrize("cap", [1.0, 5.0])
def test_staleness_zero_is_ppo_clip_exactly(cap):
  """Behaviour = proximal: w = 1 and the loss and its gradient are PPO-clip's, bit for
  bit."""
  p = losses.LossParams(0.2, 0.3, 0.0, cap)
  rng = np.random.default_rng(2)
  logp = jnp.asarray(rng.normal(-2, 0.5, (4, 9)), jnp.float32)
  old = jnp.asarray(rng.normal(-2, 0.5, (4, 9)), jnp.float32)
  adv = jnp.asarray(rng.normal(size=4), jnp.float32)
  got = losses.decoupled_ppo(logp, old, adv, p, prox_logp=old)
  want = losses.ppo_clip(logp, old, adv, p)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  grad = lambda fn, **kw: jax.grad(lambda x: fn(x, old, adv, p, **kw)[0].sum())(logp)  # noqa: E731
  np.testing.assert_array_equal(grad(losses.decoupled_ppo, prox_logp=old),
                                grad(losses.ppo_clip))


def test_registry_declares_the_proximal_input():
  assert losses.takes_proximal(losses.get_policy_loss("decoupled_ppo"))
  assert not losses.takes_proximal(losses.get_policy_loss("ppo_clip"))


CFG = get_preset("tiny-qwen3", vocab_size=96)


def test_learner_recomputes_the_proximal_logprobs_of_stale_tokens_only():
  """Tokens of staleness > 0 get log π_prox from the learner's current parameters;
  fresh ones keep the engine's (behaviour) log-probs."""
  learner = Learner(init_decoder(CFG, seed=3), LearnerConfig(loss="decoupled_ppo",
                                                             micro_batch_size=8,
                                                             importance_cap=1.2), 20)
  batch = random_rollouts(0, 8, 5, 20, CFG.vocab_size)
  batch["lag"][:4] = batch["mask"][:4].astype(np.int32)  # rows 0-3 stale, 4-7 fresh
  (groups,) = learner.minibatches(batch)
  want = np.asarray(target_logp(teacher_forced(learner.graphdef, learner.state["params"],
                                               batch["tokens"], batch["valid"]).logits,
                                batch["targets"]))
  for group in groups:
    assert "lag" not in group
    width = group["tokens"].shape[-1]
    for row, tokens in zip(group["prox_logp"].reshape(-1, width),
                           group["tokens"].reshape(-1, width)):
      i = next(i for i in range(8) if np.array_equal(batch["tokens"][i, :tokens.size], tokens))
      m = batch["mask"][i, :tokens.size] > 0
      expected = want[i, :tokens.size] if i < 4 else batch["old_logp"][i, :tokens.size]
      np.testing.assert_allclose(row[m], expected[m], rtol=1e-5, atol=1e-5)
  metrics = learner.update(batch)
  # Random behaviour log-probs about the model's: weights spread, some truncated at 1.2.
  assert metrics["iw_max"] == pytest.approx(1.2) and 0 < metrics["iw_truncated_frac"] < 1
  assert 0 < metrics["iw_mean"] < 1.2
