"""The learner's update is a function of the mini-batch only: micro-batching (gradient
accumulation) and the device mesh change how it is computed, not what it computes."""

import dataclasses

import jax
import numpy as np
import pytest

from spec_rl_jax import sharding
from spec_rl_jax.config import LearnerConfig
from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.transformer import init_decoder
from spec_rl_jax.rl.learner import Learner, pack_rollouts

# Heads and widths divisible by every mesh axis, so parameters really are distributed.
CFG = get_preset("tiny-qwen3", num_heads=8, num_kv_heads=4, head_dim=8, vocab_size=96)
N, PROMPT, RESPONSE = 16, 6, 10
LEARNER = LearnerConfig(lr=1e-3, warmup_steps=1, micro_batch_size=N)


def _batch() -> dict[str, np.ndarray]:
  """``N`` responses of random lengths with random behaviour logprobs and advantages."""
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(1, CFG.vocab_size, PROMPT)) for _ in range(N)]
  responses = [list(rng.integers(1, CFG.vocab_size, rng.integers(1, RESPONSE + 1)))
               for _ in range(N)]
  old = [rng.normal(-4.6, 0.3, len(r)).astype(np.float32) for r in responses]
  return pack_rollouts(prompts, responses, old, rng.normal(size=N), PROMPT + RESPONSE, 0)


def _updated(cfg: LearnerConfig, mesh_shape=(1, 1, 1), steps: int = 2):
  """Parameters (host arrays) and metrics after ``steps`` updates on `_batch`."""
  mesh = sharding.make_mesh(mesh_shape)
  model = init_decoder(CFG, seed=3, mesh=mesh)
  learner = Learner(model, cfg, RESPONSE)
  metrics = [learner.update(_batch()) for _ in range(steps)]
  leaves = jax.tree.leaves(learner.state["params"])
  if mesh.size > 1:  # the state stays distributed across steps
    assert max(len(x.sharding.device_set) for x in leaves) == mesh.size
  return [np.asarray(x) for x in leaves], metrics[-1] if metrics else None


@pytest.fixture(scope="module")
def reference():
  return _updated(LEARNER)


def _assert_same(a, b):
  # Adam divides by sqrt(v): a gradient entry near 0 turns float rounding (summation
  # order) into a visible change, bounded by lr; 1% of lr is far below one real step.
  for x, y in zip(a, b, strict=True):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-2 * LEARNER.lr)


@pytest.mark.parametrize("micro", [1, 4])
def test_micro_batches_accumulate_to_the_whole_batch_update(reference, micro):
  params, metrics = _updated(dataclasses.replace(LEARNER, micro_batch_size=micro))
  ref_params, ref_metrics = reference
  assert ref_metrics["skipped"] == 0
  initial, _ = _updated(LEARNER, steps=0)
  assert max(np.abs(x - y).max() for x, y in zip(ref_params, initial)) > 1e-4  # it learned
  _assert_same(params, ref_params)
  for k in ("loss", "grad_norm", "clip_frac", "entropy", "logprob_gap"):
    np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-5, err_msg=k)


@pytest.mark.parametrize("mesh_shape", [(1, 2, 4), (2, 2, 2)], ids=str)
def test_sharded_mesh_update_matches_single_device(reference, mesh_shape):
  cfg = dataclasses.replace(LEARNER, micro_batch_size=4)
  params, metrics = _updated(cfg, mesh_shape)
  _assert_same(params, reference[0])
  np.testing.assert_allclose(metrics["loss"], reference[1]["loss"], rtol=1e-5)
