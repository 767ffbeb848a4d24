"""Draft-head SFT (head_sft.py through sft.py): an Eagle3 head trained against a frozen
policy drafts it better than a fresh one, exports in the public layout and builds the
``eagle3`` proposer; bad head recipes are refused."""

import dataclasses
import os

import jax
import numpy as np
import pytest
from flax import nnx

from spec_rl_jax import checkpoint, export, head_sft, sft
from spec_rl_jax.data import Source
from spec_rl_jax.models import eagle3, hf_io
from spec_rl_jax.spec.proposers import build_proposer
from spec_rl_jax.tasks.bpe import default_tokenizer

DATA = ("task:arithmetic?max_digits=2",)
HEAD = sft.SFTConfig(head="eagle3", teacher="pol", data=DATA, steps=20, batch_size=8,
                     max_len=32, lr=3e-3, warmup_steps=2, log_every=5, ckpt_every=10,
                     head_options=(("feature_layers", (1, 2, 2)), ("ttt_steps", 2)))
HEADS = {"eagle3": HEAD,
         "mtp": dataclasses.replace(HEAD, head="mtp", head_options=(("num_modules", 2),))}


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


@pytest.mark.parametrize("kind", ["eagle3", pytest.param("mtp", marks=pytest.mark.slow)])
def test_trained_head_drafts_the_policy_better(tok, cache, monkeypatch, kind, tmp_path):
  root, policy = cache
  cfg = HEADS[kind]
  monkeypatch.setenv("SPEC_RL_JAX_CACHE", str(root))
  monkeypatch.setitem(sft.TARGETS, kind, cfg)
  report = sft.produce([kind], {}, progress=False, eval_n=32)
  trained = report["models"][kind]["accuracy"][DATA[0]]
  options = head_sft.parse_options(kind, cfg.head_options)
  fresh = head_sft.trainee(kind, options, policy, tok, cfg.seed, sft.make_optimizer(cfg))
  before = head_sft.acceptance(fresh.merge({"params": fresh.params, **fresh.extra_state}),
                               kind, options, policy, tok,
                               [Source.parse(DATA[0])], 32, cfg.max_len)
  assert trained["alpha_0"] > before["alpha_0"] + 0.1, (before, trained)
  assert trained["alpha_1"] > before["alpha_1"]
  # Exported for this policy (its fingerprint recorded); the proposer builds from it.
  proposer = build_proposer(kind, policy, tok, path=kind)
  assert proposer.model().cfg.policy_fingerprint == eagle3.policy_fingerprint(
      policy.cfg, tok.backend.get_vocab())
  assert proposer.hidden_layers == {"eagle3": (0, 1, 1), "mtp": (2,)}[kind]
  assert os.path.exists(root / "runs" / kind / "tb")
  # The run directory exports the same heads; it is not a model to load.
  run_dir = str(root / "runs" / kind)
  export.main([run_dir, str(tmp_path / "exported")])
  again = build_proposer(kind, policy, tok, path=str(tmp_path / "exported"))
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(again.model())),
               nnx.to_pure_dict(nnx.state(proposer.model())))
  with pytest.raises(ValueError, match=f"holds {kind} draft heads, not a model"):
    checkpoint.load_model(run_dir)


def test_bad_head_recipes_are_refused(tok, cache, monkeypatch, tmp_path):
  root, _ = cache
  monkeypatch.setenv("SPEC_RL_JAX_CACHE", str(root))
  with pytest.raises(ValueError, match="unknown eagle3 option"):
    head_sft.parse_options("eagle3", (("layers", (1, 2, 3)),))
  with pytest.raises(ValueError, match="ttt_steps"):
    head_sft.parse_options("eagle3", (("ttt_steps", 0),))
  with pytest.raises(ValueError, match="unknown mtp option"):
    head_sft.parse_options("mtp", (("ttt_steps", 2),))
  with pytest.raises(ValueError, match="unknown head"):
    head_sft.head_kind("medusa")
  with pytest.raises(ValueError, match="set teacher"):
    sft.train(dataclasses.replace(HEAD, teacher=None), str(tmp_path / "a"), tok,
              progress=False)
  with pytest.raises(ValueError, match="'init'. configure a decoder's SFT"):
    sft.train(dataclasses.replace(HEAD, init="pol"), str(tmp_path / "c"), tok, progress=False)
  with pytest.raises(ValueError, match="out of range"):
    sft.train(dataclasses.replace(HEAD, head_options=(("feature_layers", (1, 2, 3)),)),
              str(tmp_path / "b"), tok, progress=False)


def test_a_head_waits_for_its_policy(tmp_path, monkeypatch):
  monkeypatch.setitem(sft.TARGETS, "pol", sft.SFTConfig(model="tiny-qwen3"))
  monkeypatch.setitem(sft.TARGETS, "head", HEAD)
  assert sft._with_stages(["head"], str(tmp_path)) == ["pol", "head"]
