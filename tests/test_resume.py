"""Kill-and-resume: a run SIGKILLed mid-way and resumed ends with exactly the
parameters of an uninterrupted run (the policy's and the drafter's it trains online),
n-gram rollout memory included."""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx
from tqdm import tqdm

from spec_rl_jax import checkpoint, train
from spec_rl_jax.config import load_config
from tests.rl_fixtures import tiny_overrides, write_tiny_models

STEPS = 6


def _cmd(overrides, resume=False):
  return [sys.executable, "-m", "spec_rl_jax.train", *(["--resume"] if resume else []),
          *overrides]


def _final_params(run_dir):
  """The last checkpoint's policy and draft-model parameters."""
  ckpt = checkpoint.TrainCheckpointer(run_dir)
  assert ckpt.latest_step() == STEPS
  meta = ckpt.restore_meta()
  params = []
  for key, model in (("params", "model"), ("draft", "draft_model")):
    _, abstract = checkpoint.abstract_params(checkpoint.config_from_json(meta[model]))
    params.append(ckpt.restore_params(abstract, key=key))
  ckpt.close()
  return params


def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
  models = write_tiny_models(str(tmp_path / "models"))
  # The three runs share a persistent XLA cache, as a user's rerun does by default: the
  # resumed run loads what the first two compiled.
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "SPEC_RL_JAX_XLA_CACHE": str(tmp_path / "xla")}
  # A fixed draft length: `auto` picks k from measured timings, so its (equally exact)
  # samples differ from run to run.
  extra = {"steps": STEPS, "checkpoint.every": 2, "drafter.num_draft_tokens": 2,
           "drafter.train.every": 2}
  straight = tiny_overrides(models, str(tmp_path / "straight"), **extra)
  killed_dir = str(tmp_path / "killed")
  killed = tiny_overrides(models, killed_dir, **extra)

  # The uninterrupted run goes alongside (independent; the test takes two runs' time).
  reference_err = tmp_path / "reference.err"
  reference = subprocess.Popen(_cmd(straight), env=env, stdout=subprocess.DEVNULL,
                               stderr=reference_err.open("w"))
  proc = subprocess.Popen(_cmd(killed), env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE)
  ckpt_dir = os.path.join(killed_dir, "ckpt")
  deadline = time.time() + 240
  while not (os.path.isdir(ckpt_dir) and "2" in os.listdir(ckpt_dir)):
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    assert time.time() < deadline
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL
  assert str(STEPS) not in os.listdir(ckpt_dir)  # really killed mid-way

  subprocess.run(_cmd(killed, resume=True), env=env, check=True,
                 stdout=subprocess.DEVNULL)
  assert reference.wait() == 0, reference_err.read_text()[-2000:]
  a, b = _final_params(str(tmp_path / "straight")), _final_params(killed_dir)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # The drafter trained (every other step) and resumed with its optimizer state.
  draft0 = checkpoint.load_model(models["draft"])[0]
  assert max(np.abs(np.asarray(x) - np.asarray(y)).max() for x, y in zip(
      jax.tree.leaves(a[1]), jax.tree.leaves(nnx.to_pure_dict(nnx.state(draft0))))) > 0
  # The resumed run kept its config and continued the step count.
  assert load_config(os.path.join(killed_dir, "config.yaml")).steps == STEPS



@pytest.mark.slow
def test_ngram_rollout_memory_resumes(tmp_path):
  """The engine's memory of earlier rollouts (the ngram proposer's references) is
  checkpointed: with two prompts revisited every step, a run restored after step 2
  holds the same references and takes exactly the uninterrupted step 3."""
  models = write_tiny_models(str(tmp_path / "models"))
  path = tmp_path / "two.jsonl"
  path.write_text('{"prompt": "3+4=", "answer": "7"}\n{"prompt": "9-5=", "answer": "4"}\n')
  cfg = load_config(None, tiny_overrides(
      models, str(tmp_path / "run"), steps=3, **{
          "drafter.proposer": "ngram", "drafter.num_draft_tokens": 3,
          "drafter.ngram.reference_len": 48, "data.sources": f"[jsonl:{path}]"}))
  bar = tqdm(disable=True)
  first = train.Trainer(cfg)
  try:
    for _ in range(2):
      first.train_step(bar)
    first.save()
    first.ckpt.wait()
    saved = first.proposer.host_state()
    straight = first.train_step(bar)  # the uninterrupted step 3
  finally:
    first.close()
  assert len(saved["prompts"]) == 2 and all(saved["rollouts"])

  second = train.Trainer(cfg, resume=True)
  try:
    assert second.step == 2 and second.proposer.host_state() == saved
    resumed = second.train_step(bar)
  finally:
    second.close()
  assert second.proposer.host_state() == first.proposer.host_state()
  assert resumed["spec/acceptance_at"] == straight["spec/acceptance_at"]
  for x, y in zip(jax.tree.leaves(first.learner.state["params"]),
                  jax.tree.leaves(second.learner.state["params"]), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
