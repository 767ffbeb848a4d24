"""Tiny policy and draft HF checkpoints (task tokenizer) for trainer tests, and random
packed rollouts for learner tests."""

import os

import numpy as np

from spec_rl_jax.models import eagle3, eagle3_io, hf_io, mtp
from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.transformer import init_decoder
from spec_rl_jax.rl.learner import pack_rollouts
from spec_rl_jax.tasks.bpe import train_tokenizer, task_corpus
from spec_rl_jax.tasks import get_task


def write_tiny_models(root: str) -> dict[str, str]:
  """``{"policy": dir, "draft": dir, "eagle3": dir, "mtp": dir}``: random tiny-qwen3
  models, vocab 512, and random Eagle3 and MTP (2 modules) heads for the policy."""
  tokenizer = train_tokenizer(task_corpus([get_task("arithmetic")], n_per_task=300))
  cfg = get_preset("tiny-qwen3", vocab_size=512)
  paths = {}
  for name, seed in (("policy", 0), ("draft", 1)):
    paths[name] = os.path.join(root, name)
    hf_io.save_hf_checkpoint(init_decoder(cfg, seed=seed), paths[name], tokenizer)
  fingerprint = eagle3.policy_fingerprint(cfg, tokenizer.backend.get_vocab())
  paths["eagle3"] = os.path.join(root, "eagle3")
  eagle3_io.save_eagle3(eagle3.init_head(eagle3.Eagle3Config.for_policy(
      cfg, (1, 1, 1), fingerprint=fingerprint), seed=2), paths["eagle3"])
  paths["mtp"] = os.path.join(root, "mtp")
  mtp.save_mtp(mtp.init_heads(mtp.MTPConfig(2, cfg, fingerprint), seed=3), paths["mtp"])
  return paths


def tiny_overrides(paths: dict[str, str], run_dir: str, **extra) -> list[str]:
  """Dotted overrides for a seconds-long run on the tiny models."""
  base = {"run_dir": run_dir, "steps": 2, "progress": False,
          "policy.path": paths["policy"], "drafter.draft_model.path": paths["draft"],
          "drafter.eagle3.path": paths["eagle3"], "drafter.mtp.path": paths["mtp"],
          "rollout.prompts_per_step": 2, "rollout.group_size": 4,
          "rollout.max_prompt_len": 32, "rollout.max_new_tokens": 12,
          "rollout.num_slots": 8, "rollout.num_pages": 64, "rollout.round_budget": 16,
          "learner.micro_batch_size": 4, "learner.lr": 1e-3, "data.eval_n": 0,
          "checkpoint.every": 1, **extra}
  return [f"{k}={v}" for k, v in base.items()]


def random_rollouts(seed: int, n: int, prompt_len: int, max_response: int, vocab: int,
                    min_response: int = 1) -> dict:
  """`pack_rollouts` of ``n`` random prompts and responses of random lengths in
  ``[min_response, max_response]``, with random behaviour logprobs, advantages and
  rewards in [0, 1)."""
  rng = np.random.default_rng(seed)
  prompts = [list(rng.integers(1, vocab, prompt_len)) for _ in range(n)]
  responses = [list(rng.integers(1, vocab, rng.integers(min_response, max_response + 1)))
               for _ in range(n)]
  old = [rng.normal(-4.6, 0.3, len(r)).astype(np.float32) for r in responses]
  return pack_rollouts(prompts, responses, old, rng.normal(size=n), rng.uniform(size=n),
                       prompt_len + max_response, 0)
