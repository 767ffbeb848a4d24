"""The no-argument run trains the missing default models into the cache first."""

import os

from spec_rl_jax import sft, train
from spec_rl_jax.config import TrainConfig


def test_missing_defaults_are_produced_once(tmp_path, monkeypatch):
  monkeypatch.setenv("SPEC_RL_JAX_CACHE", str(tmp_path))
  calls = []

  def fake_produce(targets, overrides):
    calls.append(list(targets))
    for t in targets:
      os.makedirs(tmp_path / t)

  monkeypatch.setattr(sft, "produce", fake_produce)
  cfg = TrainConfig()
  train.ensure_default_models(cfg)
  assert calls == [["policy", "draft"]]
  train.ensure_default_models(cfg)  # present now: nothing to do
  assert len(calls) == 1
  os.rmdir(tmp_path / "draft")
  train.ensure_default_models(cfg)
  assert calls[-1] == ["draft"]
