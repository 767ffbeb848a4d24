"""Policy loss, KL, entropy, aggregation weights and the drafter's distillation losses and
weights against hand-computed values."""

import jax
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


# ----------------------------------------------------------------- drafter distillation

# One position, vocab 3: teacher p = (0.5, 0.25, 0.25), student q = (0.25, 0.25, 0.5).
_P = np.array([0.5, 0.25, 0.25])
_Q = np.array([0.25, 0.25, 0.5])


def test_distill_losses_hand_computed():
  student, teacher = jnp.log(_Q)[None, None], jnp.log(_P)[None, None]  # [1, 1, 3]
  want = {"forward_kl": (0.5 * np.log(2) + 0.25 * np.log(0.5)),  # Σ p log p/q
          "reverse_kl": (0.25 * np.log(0.5) + 0.5 * np.log(2)),  # Σ q log q/p
          "tv": 0.5 * (0.25 + 0 + 0.25)}
  for name, value in want.items():
    np.testing.assert_allclose(losses.distill_loss(name, student, teacher), [[value]],
                               rtol=1e-6)
  # α = Σ min(p, q) = 0.25 + 0.25 + 0.25 = 1 - TV.
  np.testing.assert_allclose(losses.acceptance_prob(student, teacher), [[0.75]], rtol=1e-6)
  # Temperature 2 compares softmax(z / 2): p ∝ sqrt(p), q ∝ sqrt(q).
  p2, q2 = np.sqrt(_P) / np.sqrt(_P).sum(), np.sqrt(_Q) / np.sqrt(_Q).sum()
  np.testing.assert_allclose(losses.distill_loss("forward_kl", student, teacher, 2.0),
                             [[(p2 * np.log(p2 / q2)).sum()]], rtol=1e-5)


def test_distill_loss_sends_no_gradient_to_the_teacher():
  student, teacher = jnp.log(_Q)[None, None], jnp.log(_P)[None, None]
  for name in losses.DISTILL_LOSSES:
    g_teacher = jax.grad(lambda t: losses.distill_loss(name, student, t).sum())(teacher)
    np.testing.assert_array_equal(g_teacher, 0.0)
    g_student = jax.grad(lambda s: losses.distill_loss(name, s, teacher).sum())(student)
    assert np.abs(g_student).max() > 0


def test_draft_weights_hand_computed():
  mask = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], np.float32)  # lengths 2, 1, 0
  rewards = np.array([1.0, 0.0, 5.0])  # the third row has no tokens: no weight
  np.testing.assert_allclose(losses.draft_weights("uniform", mask, rewards, 1.0),
                             mask / 3, rtol=1e-6)
  # reward, τ_r = 0.5: e^{r/τ} = e^2 for row 0's two tokens, 1 for row 1's one token.
  e = np.exp(2.0)
  want = np.array([[e, e, 0], [1, 0, 0], [0, 0, 0]]) / (2 * e + 1)
  got = losses.draft_weights("reward", mask, rewards, 0.5)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert got.dtype == np.float32 and got.sum() == pytest.approx(1.0)
  # A high temperature tends to the uniform weighting; an empty mask gives zeros.
  np.testing.assert_allclose(losses.draft_weights("reward", mask, rewards, 1e6), mask / 3,
                             rtol=1e-5)
  assert not losses.draft_weights("reward", np.zeros((2, 3)), rewards[:2], 1.0).any()


def test_unknown_drafter_names():
  x = jnp.zeros((1, 1, 3))
  with pytest.raises(KeyError, match="known: \\['forward_kl', 'reverse_kl', 'tv'\\]"):
    losses.distill_loss("kl", x, x)
  with pytest.raises(KeyError, match="known: \\['reward', 'uniform'\\]"):
    losses.draft_weights("advantage", np.ones((1, 1)), np.ones(1), 1.0)
