"""The learner's update is a function of the mini-batch only: micro-batching (gradient
accumulation, length-trimmed micro-batches) and the device mesh change how it is
computed, not what it computes."""

import dataclasses

import jax
import numpy as np
import pytest

from spec_rl_jax import sharding
from spec_rl_jax.config import LearnerConfig
from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.transformer import init_decoder
from spec_rl_jax.rl import learner as learner_lib
from spec_rl_jax.models.layout import chunk_rows
from spec_rl_jax.rl.learner import Learner, micro_batches, padded_len
from tests.rl_fixtures import random_rollouts

# Heads and widths divisible by every mesh axis, so parameters really are distributed.
CFG = get_preset("tiny-qwen3", num_heads=8, num_kv_heads=4, head_dim=8, vocab_size=96)
# T = 126 > 64: micro-batches of short responses are trimmed to 64 positions.
N, PROMPT, RESPONSE = 16, 6, 120
LEARNER = LearnerConfig(lr=1e-3, warmup_steps=1, micro_batch_size=N)


def _batch() -> dict[str, np.ndarray]:
  """``N`` responses of random lengths with random behaviour logprobs and advantages."""
  return random_rollouts(0, N, PROMPT, RESPONSE, CFG.vocab_size)


def _learner(cfg: LearnerConfig, mesh_shape=(1, 1, 1)) -> Learner:
  mesh = sharding.make_mesh(mesh_shape)
  return Learner(init_decoder(CFG, seed=3, mesh=mesh), cfg, RESPONSE)


def _gradients(cfg: LearnerConfig, mesh_shape=(1, 1, 1)):
  """The accumulated gradient (host arrays) and sums of `_batch`'s one mini-batch."""
  learner = _learner(cfg, mesh_shape)
  (groups,) = learner.minibatches(_batch())
  grads, stats = learner.gradients(groups)
  leaves = jax.tree.leaves(grads)
  if learner.mesh.size > 1:  # gradients are laid out like the distributed parameters
    assert max(len(x.sharding.device_set) for x in leaves) == learner.mesh.size
  return [np.asarray(x) for x in leaves], jax.device_get(stats)


@pytest.fixture(scope="module")
def reference():
  return _gradients(LEARNER)


def _assert_same(got, want):
  """Equal up to fp32 summation order: 1e-5 of the largest gradient entry. (The
  parameters after an Adam step are no measure of this: Adam divides by sqrt(v), so a
  gradient entry near 0 turns rounding into a change of up to lr.)"""
  grads, stats = got
  ref_grads, ref_stats = want
  scale = max(np.abs(g).max() for g in ref_grads)
  assert scale > 0
  for x, y in zip(grads, ref_grads, strict=True):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-5 * scale)
  for k in ref_stats:
    np.testing.assert_allclose(stats[k], ref_stats[k], rtol=1e-5, err_msg=k)


@pytest.mark.parametrize("micro", [1, 4])
def test_micro_batches_accumulate_to_the_whole_batch_gradient(reference, micro):
  _assert_same(_gradients(dataclasses.replace(LEARNER, micro_batch_size=micro)), reference)


def test_update_steps_on_the_accumulated_gradient(reference):
  learner = _learner(dataclasses.replace(LEARNER, micro_batch_size=4))
  before = [np.asarray(x) for x in jax.tree.leaves(learner.state["params"])]
  metrics = learner.update(_batch())
  after = [np.asarray(x) for x in jax.tree.leaves(learner.state["params"])]
  assert metrics["skipped"] == 0
  assert max(np.abs(x - y).max() for x, y in zip(after, before)) > 1e-4  # it learned
  grads, stats = reference
  np.testing.assert_allclose(metrics["loss"], stats["loss"], rtol=1e-5)
  np.testing.assert_allclose(metrics["grad_norm"],
                             np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in grads)),
                             rtol=1e-5)


def test_micro_batches_group_lengths_and_trim_only_padding():
  batch = _batch()
  lengths = batch["valid"].sum(1)
  batch["weight"] = batch["mask"]
  groups = micro_batches(batch, 2)
  micros = [{k: v[i] for k, v in g.items()} for g in groups for i in range(len(g["adv"]))]
  assert all(m["adv"].shape == (2,) for m in micros)
  rows = np.concatenate([m["adv"] for m in micros])
  assert sorted(rows) == sorted(batch["adv"])  # every response once
  got = [m["valid"].sum(1) for m in micros]
  assert list(np.concatenate(got)) == sorted(lengths, reverse=True)  # longest first
  for m in micros:
    assert m["tokens"].shape[1] == padded_len(m["valid"].sum(1).max(), PROMPT + RESPONSE)
  assert {m["tokens"].shape[1] for m in micros} == {64, 126}  # both shapes occur
  # Two widths: one micro-batch per group (few compiled shapes) ...
  assert [g["tokens"].shape[0] for g in groups] == [1] * (N // 2)
  for full, cut in ((batch["valid"], "valid"), (batch["weight"], "weight")):
    assert full.sum() == sum(m[cut].sum() for m in micros)  # nothing real trimmed
  # ... one width: all micro-batches in one scanned group.
  rows = np.flatnonzero(lengths <= 64)[:4]
  assert len(rows) == 4
  (group,) = micro_batches({k: v[rows] for k, v in batch.items()}, 2)
  assert group["tokens"].shape == (2, 2, 64)
  assert [padded_len(n, 2592) for n in (0, 1, 384, 385, 2500)] == [384, 384, 384, 768, 2592]
  assert {padded_len(n, 56) for n in range(57)} == {56}


def test_update_reports_the_positions_it_computes():
  metrics = _learner(dataclasses.replace(LEARNER, micro_batch_size=4)).update(_batch())
  lengths = np.sort(_batch()["valid"].sum(1))[::-1]
  want = sum(padded_len(lengths[i:i + 4].max(), PROMPT + RESPONSE) * 4 for i in (0, 4, 8, 12))
  assert metrics["positions_computed_frac"] == want / (N * (PROMPT + RESPONSE)) < 1


@pytest.mark.mesh
@pytest.mark.parametrize("mesh_shape", [(1, 2, 4),
                                        pytest.param((2, 2, 2), marks=pytest.mark.slow)],
                         ids=str)
def test_sharded_mesh_gradient_matches_single_device(reference, mesh_shape):
  cfg = dataclasses.replace(LEARNER, micro_batch_size=4)
  _assert_same(_gradients(cfg, mesh_shape), reference)


def test_chunked_forwards_accumulate_to_the_whole_batch_gradient(reference, monkeypatch):
  # 256 positions per forward: the 16-row micro-batch runs as chunks of 2 (width 126)
  # and 4 (width 64) rows.
  monkeypatch.setattr(learner_lib, "training_forward_tokens", lambda: 256)
  _assert_same(_gradients(LEARNER), reference)


def test_chunk_rows_fit_the_positions_per_device():
  assert chunk_rows(32, 316, None, 1) == 32  # no limit: the whole micro-batch
  assert chunk_rows(32, 316, 2048, 1) == 4
  assert chunk_rows(32, 64, 2048, 1) == 32
  # Rows split over 8 devices: chunks of whole multiples of 8, positions per device.
  assert chunk_rows(32, 316, 2048, 8) == 32
  assert chunk_rows(32, 316, 512, 8) == 8
  assert chunk_rows(32, 4096, 2048, 1) == 1  # wider than the limit: one row at a time
  assert chunk_rows(12, 316, 2048, 8) == 6  # 12 rows do not split over 8 devices
