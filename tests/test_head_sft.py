"""Draft-head SFT (head_sft.py through sft.py): an Eagle3 head trained against a frozen
policy drafts it better than a fresh one, exports in the public layout and builds the
``eagle3`` proposer; bad head recipes are refused."""

import dataclasses
import os

import pytest

from spec_rl_jax import head_sft, sft
from spec_rl_jax.data import Source
from spec_rl_jax.models import eagle3, eagle3_io, hf_io
from spec_rl_jax.spec.proposers import build_proposer
from spec_rl_jax.tasks.bpe import default_tokenizer

DATA = ("task:arithmetic?max_digits=2",)
HEAD = sft.SFTConfig(head="eagle3", teacher="pol", data=DATA, steps=20, batch_size=8,
                     max_len=32, lr=3e-3, warmup_steps=2, log_every=5, ckpt_every=10,
                     head_options=(("feature_layers", (1, 2, 2)), ("ttt_steps", 2)))


@pytest.fixture(scope="module")
def tok():
  return default_tokenizer()


@pytest.fixture(scope="module")
def cache(tok, tmp_path_factory):
  """A cache holding a policy ("pol") briefly trained on the task: its next-token
  distributions have the task's structure for a head to learn."""
  root = tmp_path_factory.mktemp("cache")
  cfg = sft.SFTConfig(model="tiny-qwen3", model_overrides=(("vocab_size", 512),
                                                            ("num_layers", 3)),
                      data=DATA, steps=30, batch_size=8, max_len=32, warmup_steps=2)
  policy, _, _ = sft.train(cfg, str(root / "runs" / "pol"), tok, progress=False)
  hf_io.save_hf_checkpoint(policy, str(root / "pol"), tok)
  return root, policy


def test_trained_head_drafts_the_policy_better(tok, cache, monkeypatch):
  root, policy = cache
  monkeypatch.setenv("SPEC_RL_JAX_CACHE", str(root))
  monkeypatch.setitem(sft.TARGETS, "head", HEAD)
  report = sft.produce(["head"], {}, progress=False, eval_n=32)
  trained = report["models"]["head"]["accuracy"][DATA[0]]
  options = head_sft.parse_options("eagle3", HEAD.head_options)
  fresh = head_sft.trainee("eagle3", options, policy, tok, HEAD.seed, sft.make_optimizer(HEAD))
  before = head_sft.acceptance(fresh.merge(fresh.params), "eagle3", options, policy, tok,
                               [Source.parse(DATA[0])], 32, HEAD.max_len)
  assert trained["alpha_0"] > before["alpha_0"] + 0.1, (before, trained)
  assert trained["alpha_1"] > before["alpha_1"]
  # Exported in the public layout, for this policy (its fingerprint recorded).
  head = eagle3_io.load_eagle3(str(root / "head"), policy.cfg)
  assert head.cfg.policy_fingerprint == eagle3.policy_fingerprint(
      policy.cfg, tok.backend.get_vocab())
  proposer = build_proposer("eagle3", policy, tok, path="head")
  assert proposer.hidden_layers == (0, 1, 1)
  assert os.path.exists(root / "runs" / "head" / "tb")


def test_bad_head_recipes_are_refused(tok, cache, monkeypatch, tmp_path):
  root, _ = cache
  monkeypatch.setenv("SPEC_RL_JAX_CACHE", str(root))
  with pytest.raises(ValueError, match="unknown eagle3 option"):
    head_sft.parse_options("eagle3", (("layers", (1, 2, 3)),))
  with pytest.raises(ValueError, match="ttt_steps"):
    head_sft.parse_options("eagle3", (("ttt_steps", 0),))
  with pytest.raises(ValueError, match="unknown head"):
    head_sft.head_kind("medusa")
  with pytest.raises(ValueError, match="set teacher"):
    sft.train(dataclasses.replace(HEAD, teacher=None), str(tmp_path / "a"), tok,
              progress=False)
  with pytest.raises(ValueError, match="out of range"):
    sft.train(dataclasses.replace(HEAD, head_options=(("feature_layers", (1, 2, 3)),)),
              str(tmp_path / "b"), tok, progress=False)


def test_a_head_waits_for_its_policy(tmp_path, monkeypatch):
  monkeypatch.setitem(sft.TARGETS, "pol", sft.SFTConfig(model="tiny-qwen3"))
  monkeypatch.setitem(sft.TARGETS, "head", HEAD)
  assert sft._with_stages(["head"], str(tmp_path)) == ["pol", "head"]
