"""The no-argument run trains the missing default models into the cache first."""

import dataclasses
import json
import os

import pytest

from spec_rl_jax import sft, train
from spec_rl_jax.config import TrainConfig
from spec_rl_jax.tasks.bpe import default_tokenizer_spec


def test_missing_defaults_are_produced_once(tmp_path, monkeypatch):
  monkeypatch.setenv("SPEC_RL_JAX_CACHE", str(tmp_path))
  calls = []

  def fake_produce(targets, overrides, rebuild=()):
    """What `sft.produce` leaves: the exports, and their recipes in the report."""
    calls.append(list(targets))
    done = {t: sft._recipe(sft.TARGETS[t]) for t in ("policy", "draft")
            if os.path.exists(tmp_path / t)}
    _cache(tmp_path, {**done, **{t: sft._recipe(sft.TARGETS[t]) for t in targets}},
           default_tokenizer_spec())

  monkeypatch.setattr(sft, "produce", fake_produce)
  cfg = TrainConfig()
  train.ensure_default_models(cfg)
  assert calls == [["policy", "draft"]]
  train.ensure_default_models(cfg)  # present now: nothing to do
  assert len(calls) == 1
  os.rmdir(tmp_path / "draft")
  train.ensure_default_models(cfg)
  assert calls[-1] == ["draft"]


def test_several_processes_do_not_train_the_defaults(tmp_path, monkeypatch):
  monkeypatch.setenv("SPEC_RL_JAX_CACHE", str(tmp_path))
  monkeypatch.setattr(sft, "produce", lambda *a, **k: pytest.fail("trained"))
  monkeypatch.setattr(train.jax, "process_count", lambda: 2)
  with pytest.raises(RuntimeError, match=r"2 processes must not train them into one cache"):
    train.ensure_default_models(TrainConfig())


def _cache(tmp_path, recipes, spec):
  for t in recipes:
    os.makedirs(tmp_path / t, exist_ok=True)
  report = {"tokenizer_spec": spec,
            "models": {t: {"recipe": r} for t, r in recipes.items() if r is not None}}
  (tmp_path / "report.json").write_text(json.dumps(report))


def test_defaults_from_an_older_recipe_are_rebuilt(tmp_path, monkeypatch):
  """A cache from an older release (other task, other tokenizer) is not used silently."""
  monkeypatch.setenv("SPEC_RL_JAX_CACHE", str(tmp_path))
  today = {t: sft._recipe(sft.TARGETS[t]) for t in ("policy", "draft")}
  spec = default_tokenizer_spec()
  _cache(tmp_path, today, spec)
  assert sft.stale_targets(["policy", "draft"]) == []
  _cache(tmp_path, {**today, "draft": {**today["draft"], "data": ["task:countdown"]}}, spec)
  assert sft.stale_targets(["policy", "draft"]) == ["draft"]
  _cache(tmp_path, {**today, "policy": None}, spec)  # built before recipes were recorded
  assert sft.stale_targets(["policy", "draft"]) == ["policy"]
  # Built before a field was added: at its default the recipe is today's, not otherwise.
  older = {t: {k: v for k, v in r.items() if k not in ("head", "head_options")}
           for t, r in today.items()}
  _cache(tmp_path, older, spec)
  assert sft.stale_targets(["policy", "draft"]) == []
  monkeypatch.setitem(sft.TARGETS, "policy",
                      dataclasses.replace(sft.TARGETS["policy"], head="mtp"))
  assert sft.stale_targets(["policy", "draft"]) == ["policy"]
  monkeypatch.undo()
  monkeypatch.setenv("SPEC_RL_JAX_CACHE", str(tmp_path))
  _cache(tmp_path, {**today, "policy": {**today["policy"], "no_such_field": 1}}, spec)
  assert sft.stale_targets(["policy", "draft"]) == ["policy"]
  _cache(tmp_path, today, "another corpus")
  assert sft.stale_targets(["policy", "draft"]) == ["policy", "draft"]

  calls = []
  monkeypatch.setattr(sft, "produce", lambda targets, overrides, rebuild=(): calls.append(
      (list(targets), list(rebuild))))
  _cache(tmp_path, {**today, "draft": {**today["draft"], "steps": 1}}, spec)
  train.ensure_default_models(TrainConfig())
  assert calls == [(["draft"], ["draft"])]
