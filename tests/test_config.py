"""The config schema: recipes, dotted overrides, rejected keys and values."""

import glob
import logging
import os

import pytest

from spec_rl_jax.config import (ConfigError, TrainConfig, dump_config, load_config,
                                to_dict)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_default_recipe_is_the_schema_default():
  assert load_config(os.path.join(ROOT, "configs", "default.yaml")) == TrainConfig()


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_every_recipe_loads(path):
  cfg = load_config(path)
  r, lr = cfg.rollout, cfg.learner
  assert (r.prompts_per_step * r.group_size) % (lr.num_minibatches * lr.micro_batch_size) == 0


def test_dotted_overrides_are_typed():
  cfg = load_config(None, ["learner.lr=1e-5", "rollout.group_size=4", "progress=false",
                           "data.sources=[task:countdown, 'jsonl:/x.jsonl']",
                           "policy.mesh=[1, 2, 4]"])
  assert cfg.learner.lr == 1e-5 and isinstance(cfg.learner.lr, float)
  assert cfg.rollout.group_size == 4 and cfg.progress is False
  assert cfg.data.sources == ("task:countdown", "jsonl:/x.jsonl")
  assert cfg.policy.mesh == (1, 2, 4)
  auto, fixed = load_config(None), load_config(None, ["drafter.num_draft_tokens=3"])
  assert (auto.drafter.adaptive, auto.drafter.k_max) == (True, 4)
  assert (fixed.drafter.adaptive, fixed.drafter.k_max, fixed.drafter.num_draft_tokens) == (
      False, 3, 3)


@pytest.mark.parametrize("override,message", [
    ("learner.lrate=1", r"learner\.'lrate' \(did you mean 'lr'\?\); valid keys: .*micro_batch_size"),
    ("rollout.group=4", r"did you mean 'group_size'"),
    ("optimizer.lr=1", r"unknown config key 'optimizer'.*learner"),
    ("rollout.group_size=four", r"rollout.group_size must be int"),
    ("rollout.group_size=true", r"rollout.group_size must be int"),
    ("learner.advantage=ppo", r"not one of \['dr_grpo', 'grpo', 'grpo_no_std', 'rloo'\]"),
    ("learner.aggregation=sum", r"seq_sum_norm"),
    ("rollout.on_long_prompt=truncate", r"\['error', 'skip'\]"),
    ("learner=3", r"learner must be a mapping"),
    ("steps", r"expected section.field=value"),
    ("drafter.num_draft_tokens=often", r"an integer >= 0 or 'auto', got 'often'"),
    ("drafter.num_draft_tokens=2.5", r"must be one of int \| str, got 2.5"),
    ("drafter.max_draft_tokens=0", r"auto needs drafter.max_draft_tokens >= 1"),
    ("drafter.num_draft_tokens=6", r"in \[0, drafter.max_draft_tokens = 4\] or 'auto', got 6"),
    ("data.format_weight=-0.1", r"data.format_weight must be in \[0, 1\], got -0.1"),
])
def test_bad_overrides(override, message):
  with pytest.raises(ConfigError, match=message):
    load_config(None, [override])


def test_unknown_key_in_recipe_file(tmp_path):
  path = tmp_path / "x.yaml"
  path.write_text("learner:\n  lr: 1.0e-5\n  clip_eps: 0.2\n")
  with pytest.raises(ConfigError, match=r"learner\.'clip_eps'.*clip_eps_high"):
    load_config(str(path))


def test_dump_roundtrip(tmp_path):
  cfg = load_config(None, ["learner.kl_coef=0.05", "drafter.num_draft_tokens=0"])
  dump_config(cfg, str(tmp_path / "c.yaml"))
  assert load_config(str(tmp_path / "c.yaml")) == cfg
  assert to_dict(cfg)["learner"]["kl_coef"] == 0.05


def test_duplicate_key_in_recipe_names_key_and_both_lines(tmp_path):
  path = tmp_path / "x.yaml"
  path.write_text("learner:\n  lr: 1.0e-5\n  clip_eps_low: 0.2\n  lr: 3.0e-6\nsteps: 5\n")
  with pytest.raises(ConfigError, match=rf"{path}:4: duplicate key 'lr' \(first at line 2\)"):
    load_config(str(path))
  path.write_text("steps: 5\nlearner: {lr: 1.0e-5}\nsteps: 6\n")
  with pytest.raises(ConfigError, match=r":3: duplicate key 'steps' \(first at line 1\)"):
    load_config(str(path))
  with pytest.raises(ConfigError, match=r"override 'learner=\{lr: 1, lr: 2\}':1: duplicate"
                                        r" key 'lr'"):
    load_config(None, ["learner={lr: 1, lr: 2}"])


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
  path = tmp_path / "x.yaml"
  path.write_text("learner:\n  <<: {lr: 1.0e-5, kl_coef: 0.1}\n  lr: 3.0e-6\n")
  assert load_config(str(path)).learner.lr == 3.0e-6


def test_dr_grpo_brings_its_aggregation(tmp_path, caplog):
  with caplog.at_level(logging.WARNING):
    cfg = load_config(None, ["learner.advantage=dr_grpo"])
    assert load_config(None).learner.aggregation == "token_mean"
    assert load_config(None, ["learner.advantage=dr_grpo",
                              "learner.aggregation=seq_sum_norm"]) == cfg
  assert cfg.learner.aggregation == "seq_sum_norm" and "aggregation" not in caplog.text
  # The run's saved config holds the effective value.
  dump_config(cfg, str(tmp_path / "c.yaml"))
  assert "aggregation: seq_sum_norm" in (tmp_path / "c.yaml").read_text()
  assert load_config(str(tmp_path / "c.yaml")) == cfg


def test_contradicting_aggregation_warns_and_is_kept(caplog):
  with caplog.at_level(logging.WARNING):
    cfg = load_config(None, ["learner.advantage=dr_grpo", "learner.aggregation=token_mean"])
  assert cfg.learner.aggregation == "token_mean"
  assert ("learner.advantage=dr_grpo comes with learner.aggregation=seq_sum_norm, but the"
          " config sets token_mean: kept") in caplog.text


def test_data_sources_checked_and_overlapping_evaluation_warned(caplog):
  with pytest.raises(ConfigError, match=r"data\.sources\[1\]: bad data source.*heldout must"):
    load_config(None, ["data.sources=[task:countdown, 'jsonl:/x.jsonl?heldout=2']"])
  with caplog.at_level(logging.WARNING):
    load_config(None, ["data.sources=['jsonl:/x.jsonl?heldout=0.05']"])
    load_config(None, ["data.sources=['jsonl:/x.jsonl']", "data.eval_n=0"])
  assert "heldout" not in caplog.text
  with caplog.at_level(logging.WARNING):
    load_config(None, ["data.sources=['jsonl:/x.jsonl']"])
  assert ("data.sources[0] 'jsonl:/x.jsonl': training reads the whole file, so the"
          " evaluation records (its first data.eval_n=100) are training data") in caplog.text


def test_config_changes_for_resume():
  """What --resume compares: changed keys by name; a key an older run's record lacks
  matches at its default; run_dir, steps and progress may change."""
  from spec_rl_jax.config import config_changes, to_dict  # noqa: PLC0415
  cfg = load_config(None, ["learner.lr=3e-4", "steps=5"])
  recorded = to_dict(load_config(None, ["learner.lr=3e-4", "run_dir=elsewhere"]))
  assert config_changes(recorded, cfg) == []
  assert config_changes(recorded, load_config(None, ["learner.lr=1e-4"])) == ["learner.lr"]
  del recorded["rollout"]["mesh"], recorded["plan"]  # written before these existed
  assert config_changes(recorded, cfg) == []
  assert config_changes(recorded, load_config(None, ["learner.lr=3e-4", "rollout.mesh=[1,1,2]",
                                                     "plan.chip=tpu-v5p"])) == [
      "plan", "rollout.mesh"]
  recorded["learner"]["retired_option"] = 1  # a field a later release removed
  assert config_changes(recorded, cfg) == ["learner.retired_option"]
