"""Online drafter distillation in the learner's update: the drafter learns from the
policy's logits without changing what the policy learns, weighted as configured, and a
non-finite drafter loss is skipped without reaching the policy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_rl_jax.config import DrafterTrainConfig, LearnerConfig
from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.transformer import init_decoder, teacher_forced
from spec_rl_jax.rl import losses
from spec_rl_jax.rl.learner import Learner
from tests.rl_fixtures import random_rollouts

CFG = get_preset("tiny-qwen3", vocab_size=96)
DRAFT_CFG = dataclasses.replace(CFG, num_layers=1)  # a smaller drafter, same vocabulary
N, PROMPT, RESPONSE = 8, 5, 20
LEARNER = LearnerConfig(lr=1e-3, warmup_steps=1, micro_batch_size=4)
TRAIN = DrafterTrainConfig(every=1, lr=3e-3, warmup_steps=1, weighting="reward",
                           reward_temperature=0.5)


def _batch() -> dict[str, np.ndarray]:
  """``N`` responses of random lengths with random behaviour logprobs and advantages."""
  return random_rollouts(1, N, PROMPT, RESPONSE, CFG.vocab_size, min_response=2)


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _learner(drafter=None, draft_cfg=TRAIN, temperature=1.0) -> Learner:
  return Learner(init_decoder(CFG, seed=0), LEARNER, RESPONSE, drafter,
                 draft_cfg if drafter is not None else None, temperature)


@pytest.fixture(scope="module")
def policy_only():
  """The policy's parameters after one update without a drafter."""
  learner = _learner()
  metrics = learner.update(_batch())
  return _leaves(learner.state["params"]), metrics


def test_drafter_learns_without_changing_the_policy_update(policy_only):
  learner = _learner(init_decoder(DRAFT_CFG, seed=1), temperature=0.7)
  draft0 = _leaves(learner.state["draft"])
  batch = _batch()
  # The drafter's loss by hand: Σ w d over the batch (one mini-batch), from the two
  # models' teacher-forced logits at the sampling temperature and the reward weights.
  p = teacher_forced(learner.graphdef, learner.state["params"], batch["tokens"],
                     batch["valid"]).logits
  q = teacher_forced(learner.draft_graphdef, learner.state["draft"], batch["tokens"],
                     batch["valid"]).logits
  w = losses.draft_weights("reward", batch["mask"], batch["reward"], 0.5)
  want_loss = float((losses.distill_loss("forward_kl", q, p, 0.7) * w).sum())
  alpha = losses.acceptance_prob(q / 0.7, p / 0.7)
  want_accept = float((alpha * batch["mask"]).sum() / batch["mask"].sum())

  metrics = learner.update(batch, train_draft=True)
  assert metrics["skipped"] == metrics["draft_skipped"] == 0
  assert metrics["draft_loss"] == pytest.approx(want_loss, rel=1e-5)
  assert metrics["draft_acceptance"] == pytest.approx(want_accept, rel=1e-5)
  # The policy's update is the one without a drafter (the teacher is stop-gradient).
  want_params, want_metrics = policy_only
  for x, y in zip(_leaves(learner.state["params"]), want_params, strict=True):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-7)
  assert metrics["loss"] == pytest.approx(want_metrics["loss"], rel=1e-6)
  assert max(np.abs(x - y).max() for x, y in zip(_leaves(learner.state["draft"]), draft0)) > 0
  # Further updates on the batch bring the drafter closer to the (moving) policy.
  accept = [metrics["draft_acceptance"]]
  for _ in range(3):
    accept.append(learner.update(batch, train_draft=True)["draft_acceptance"])
  assert accept[-1] > accept[0] + 0.01, accept
  # A step without the drafter leaves it as it is.
  draft = _leaves(learner.state["draft"])
  assert "draft_loss" not in learner.update(batch)
  for x, y in zip(_leaves(learner.state["draft"]), draft, strict=True):
    np.testing.assert_array_equal(x, y)
  assert learner.draft_model().cfg == DRAFT_CFG


def test_nan_drafter_is_skipped_and_never_reaches_the_policy(policy_only):
  drafter = init_decoder(DRAFT_CFG, seed=1)
  drafter.embed[...] = jnp.full_like(drafter.embed[...], jnp.nan)
  learner = _learner(drafter)
  metrics = learner.update(_batch(), train_draft=True)
  assert metrics["draft_skipped"] == 1 and metrics["skipped"] == 0
  assert not np.isfinite(metrics["draft_loss"])
  want_params, _ = policy_only
  for x, y in zip(_leaves(learner.state["params"]), want_params, strict=True):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-7)
  embed = np.asarray(learner.state["draft"]["embed"])
  assert np.isnan(embed).all()  # the drafter's state is kept, not stepped


def test_drafter_that_cannot_be_distilled():
  other_vocab = init_decoder(dataclasses.replace(DRAFT_CFG, vocab_size=64), seed=1)
  with pytest.raises(ValueError, match="vocabulary \\(64 tokens\\) differs"):
    _learner(other_vocab)
  with pytest.raises(ValueError, match="holds no drafter"):
    _learner().update(_batch(), train_draft=True)
