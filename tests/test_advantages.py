"""Advantage estimators against hand-computed values, degenerate groups included."""

import numpy as np
import pytest

from spec_rl_jax.rl.advantages import ADVANTAGES, compute_advantages

R = np.array([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])


def test_grpo_hand_computed():
  # Group 0: mean 0.5, std 0.5 → ±1. Group 1: mean 2, std sqrt(0.5).
  a = compute_advantages("grpo", R, eps=0.0)
  s = np.sqrt(0.5)
  np.testing.assert_allclose(a, [[1, -1, -1, 1], [1 / s, -1 / s, 0, 0]], rtol=1e-6)


@pytest.mark.parametrize("name", ["grpo_no_std", "dr_grpo"])
def test_mean_centered(name):
  np.testing.assert_allclose(compute_advantages(name, R),
                             [[0.5, -0.5, -0.5, 0.5], [1, -1, 0, 0]], rtol=1e-6)


def test_rloo_leave_one_out():
  # A_0 of group 0: 1 - mean(0, 0, 1) = 2/3; A_1: 0 - mean(1, 0, 1) = -2/3.
  a = compute_advantages("rloo", R)
  np.testing.assert_allclose(a[0], [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)
  np.testing.assert_allclose(a[1], [3 - 5 / 3, 1 - 7 / 3, 0, 0], rtol=1e-6)


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_all_equal_rewards_give_zero(name):
  a = compute_advantages(name, np.full((3, 5), 0.7))
  np.testing.assert_array_equal(a, 0.0)
  assert np.isfinite(a).all()


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_single_response_gives_zero(name):
  a = compute_advantages(name, np.array([[1.0], [0.0]]))
  np.testing.assert_array_equal(a, 0.0)


def test_unknown_and_bad_shape():
  with pytest.raises(KeyError, match="rloo"):
    compute_advantages("ppo", R)
  with pytest.raises(ValueError, match=r"\[B, G\]"):
    compute_advantages("grpo", np.zeros(4))
