"""Policy loss, KL, entropy and aggregation weights against hand-computed values."""

import jax.numpy as jnp
import numpy as np
import pytest

from spec_rl_jax.rl import losses

P = losses.LossParams(clip_eps_low=0.2, clip_eps_high=0.3)


def test_ppo_clip_hand_computed():
  # ratios 1.5, 0.5, 1.0, 1.5 ; advantages +1, +1, -2, -1.
  old = jnp.zeros((1, 4))
  logp = jnp.log(jnp.array([[1.5, 0.5, 1.0, 1.5]]))
  adv = jnp.array([1.0])
  loss, clipped = losses.ppo_clip(logp, old, adv, P)
  # A>0: ρ=1.5 → min(1.5, 1.3) = 1.3 (clipped); ρ=0.5 → min(0.5, 0.8) = 0.5 (not).
  np.testing.assert_allclose(loss, [[-1.3, -0.5, -1.0, -1.3]], rtol=1e-6)
  np.testing.assert_array_equal(clipped, [[True, False, False, True]])
  loss, clipped = losses.ppo_clip(logp, old, jnp.array([-1.0]), P)
  # A<0: -min(-ρ, -clip(ρ)) = max(ρ, clip(ρ)): 1.5, 0.8 (clipped), 1.0, 1.5.
  np.testing.assert_allclose(loss, [[1.5, 0.8, 1.0, 1.5]], rtol=1e-6)
  np.testing.assert_array_equal(clipped, [[False, True, False, False]])


def test_kl_k3_values():
  logp = jnp.log(jnp.array([0.5, 0.5]))
  ref = jnp.log(jnp.array([0.5, 0.25]))
  # d = log(ref/π): 0 → 0 ; log 0.5 → 0.5 - log 0.5 - 1.
  np.testing.assert_allclose(losses.kl_k3(logp, ref), [0.0, 0.5 - np.log(0.5) - 1],
                             rtol=1e-6, atol=1e-7)


def test_entropy_uniform_and_point_mass():
  logits = jnp.array([[[0.0, 0.0, 0.0, 0.0], [0.0, -1e9, -1e9, -1e9]]])
  np.testing.assert_allclose(losses.entropy(logits), [[np.log(4), 0.0]], atol=1e-6)


MASK = np.array([[0, 1, 1, 1], [0, 0, 1, 0], [0, 0, 0, 0]], np.float32)  # 3rd row = padding


def test_token_mean_weights():
  w = losses.aggregation_weights("token_mean", MASK, max_len=8)
  np.testing.assert_allclose(w, MASK / 4)


def test_seq_mean_weights():
  w = losses.aggregation_weights("seq_mean", MASK, max_len=8)
  np.testing.assert_allclose(w[0], [0, 1 / 6, 1 / 6, 1 / 6])
  np.testing.assert_allclose(w[1], [0, 0, 1 / 2, 0])
  np.testing.assert_array_equal(w[2], 0)


def test_seq_sum_norm_weights():
  w = losses.aggregation_weights("seq_sum_norm", MASK, max_len=8)
  np.testing.assert_allclose(w, MASK / 16)


@pytest.mark.parametrize("name", sorted(losses.AGGREGATIONS))
def test_empty_mask_is_finite(name):
  w = losses.aggregation_weights(name, np.zeros((2, 3)), max_len=4)
  np.testing.assert_array_equal(w, 0)


def test_unknown_names():
  with pytest.raises(KeyError, match="ppo_clip"):
    losses.get_policy_loss("reinforce")
  with pytest.raises(KeyError, match="token_mean"):
    losses.aggregation_weights("sum", MASK, 4)
