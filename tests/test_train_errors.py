"""Bad input to the trainer: config keys, data files, long prompts, non-finite losses."""

import json

import jax.numpy as jnp
import pytest

from spec_rl_jax import data, train
from spec_rl_jax.config import ConfigError
from spec_rl_jax.rl import losses
from spec_rl_jax.rl.metrics import read_metrics
from tests.rl_fixtures import tiny_overrides, write_tiny_models


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  return write_tiny_models(str(tmp_path_factory.mktemp("models")))


def _jsonl(path, lines):
  path.write_text("\n".join(lines) + "\n")
  return str(path)


def test_unknown_key_names_alternatives(models, tmp_path):
  with pytest.raises(ConfigError, match=r"learner\.'lrate'.*did you mean 'lr'.*clip_norm"):
    train.main(tiny_overrides(models, str(tmp_path / "run"), **{"learner.lrate": 1}))


def test_malformed_jsonl_names_file_and_line(models, tmp_path):
  path = _jsonl(tmp_path / "bad.jsonl", ['{"prompt": "1+1?", "answer": "2"}', "{oops"])
  with pytest.raises(data.JsonlError, match=r"bad\.jsonl:2"):
    train.main(tiny_overrides(models, str(tmp_path / "run"),
                              **{"data.sources": f"[jsonl:{path}]"}))


def test_empty_dataset(models, tmp_path):
  path = _jsonl(tmp_path / "empty.jsonl", [""])
  with pytest.raises(data.JsonlError, match="no records"):
    train.main(tiny_overrides(models, str(tmp_path / "run"),
                              **{"data.sources": f"[jsonl:{path}]"}))


def _long_prompt_file(tmp_path):
  return _jsonl(tmp_path / "mixed.jsonl", [
      json.dumps({"prompt": "What is 2 + 3?", "answer": "#### 5", "task": "arithmetic"}),
      json.dumps({"prompt": "What is " + " + ".join(["1"] * 40) + "?", "answer": "#### 40",
                  "task": "arithmetic"})])


def test_long_prompt_error(models, tmp_path):
  path = _long_prompt_file(tmp_path)
  with pytest.raises(ValueError, match="exceeds rollout.max_prompt_len=32"):
    train.main(tiny_overrides(models, str(tmp_path / "run"), steps=3,
                              **{"data.sources": f"[jsonl:{path}]",
                                 "rollout.on_long_prompt": "error"}))


def test_long_prompt_skip_is_counted(models, tmp_path):
  path = _long_prompt_file(tmp_path)
  run_dir = str(tmp_path / "run")
  train.main(tiny_overrides(models, run_dir, steps=3,
                            **{"data.sources": f"[jsonl:{path}]",
                               "drafter.num_draft_tokens": 0}))
  skipped = [r["data/long_prompts_skipped"] for r in read_metrics(run_dir)]
  # 2 prompts per step from a 2-record file, shuffled per epoch: one long prompt a step.
  assert skipped == [1, 2, 3]


def _nan_loss(logp, old_logp, adv, p):
  loss, clipped = losses.ppo_clip(logp, old_logp, adv, p)
  return loss * jnp.nan, clipped


def test_nan_loss_skipped_then_stops(models, tmp_path, monkeypatch):
  monkeypatch.setitem(losses.POLICY_LOSSES, "nan_loss", _nan_loss)
  run_dir = str(tmp_path / "run")
  with pytest.raises(train.NonFiniteLossError, match=r"2 non-finite updates in a row"
                     r" \(learner.max_nan_streak=2\)"):
    train.main(tiny_overrides(models, run_dir, steps=5,
                              **{"learner.loss": "nan_loss", "learner.max_nan_streak": 2,
                                 "drafter.num_draft_tokens": 0}))
  records = read_metrics(run_dir)
  assert [r["train/skipped"] for r in records] == [1]
  assert records[0]["train/nan_skipped_total"] == 1


def _nan_divergence(student, teacher):
  return (student * jnp.nan).sum(-1)


def test_nan_drafter_loss_is_skipped_and_counted(models, tmp_path, monkeypatch):
  """A non-finite drafter loss skips the drafter's update only: the policy trains on,
  the drafter stays as it was (its lag grows) and the skips are counted."""
  monkeypatch.setitem(losses.DISTILL_LOSSES, "nan_kl", _nan_divergence)
  run_dir = str(tmp_path / "run")
  train.main(tiny_overrides(models, run_dir, **{
      "drafter.num_draft_tokens": 2, "drafter.train.every": 1,
      "drafter.train.loss": "nan_kl"}))
  records = read_metrics(run_dir)
  assert [r["train/skipped"] for r in records] == [0, 0]
  assert [r["train/draft_skipped"] for r in records] == [1, 1]
  assert [r["train/draft_nan_skipped_total"] for r in records] == [1, 2]
  assert [r["spec/draft_lag_steps"] for r in records] == [1, 2]


@pytest.mark.parametrize("overrides,error,match", [
    ({"drafter.proposer": "ngram"}, ValueError, "'ngram' proposer has no weights to train"),
    ({"drafter.num_draft_tokens": 0}, ValueError, "there is no drafter to train"),
    ({"drafter.proposer": "eagle3", "drafter.train.loss": "tv"}, ValueError,
     "the eagle3 head trains with its kind's loss"),
    ({"drafter.train.loss": "kl"}, ConfigError,
     "drafter.train.loss='kl' is not one of \\['forward_kl', 'reverse_kl', 'tv'\\]"),
    ({"drafter.train.loss_weight": -1}, ConfigError, "loss_weight must be >= 0, got -1"),
    ({"drafter.train.weighting": "advantage"}, ConfigError, "'reward', 'uniform'"),
], ids=["ngram", "no-drafts", "eagle3", "loss", "lambda", "weighting"])
def test_drafter_training_bad_input(models, tmp_path, overrides, error, match):
  with pytest.raises(error, match=match):
    train.main(tiny_overrides(models, str(tmp_path / "run"),
                              **{"drafter.train.every": 1, **overrides}))


def test_resume_with_another_config_names_the_keys(models, tmp_path):
  run_dir = str(tmp_path / "run")
  base = {"steps": 1, "drafter.num_draft_tokens": 0}
  train.main(tiny_overrides(models, run_dir, **base))
  with pytest.raises(ValueError, match=r"another config: learner\.lr, rollout\.temperature"
                                       r" differ \(only run_dir, steps, progress may change"):
    train.main(["--resume", *tiny_overrides(models, run_dir, **{
        **base, "learner.lr": 0.5, "rollout.temperature": 0.5, "steps": 2})])
  train.main(["--resume", *tiny_overrides(models, run_dir, **{**base, "steps": 2})])
  assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
