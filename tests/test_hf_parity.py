"""Parity with ``transformers`` (torch CPU, fp32): import, greedy decoding, export."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from spec_rl_jax.models import hf_io
from spec_rl_jax.models.attention import NoCache
from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.generate import generate
from spec_rl_jax.models.transformer import init_decoder
from tests import hf_fixtures

CASES = [("llama", None), ("qwen3", True), ("qwen3", False)]
LOGIT_TOL = 1e-4


def _padded_batch(vocab, lengths, seed=0):
  rng = np.random.default_rng(seed)
  T = max(lengths)
  tokens = np.zeros((len(lengths), T), np.int64)
  valid = np.zeros((len(lengths), T), bool)
  for i, n in enumerate(lengths):
    tokens[i, :n] = rng.integers(1, vocab, n)
    valid[i, :n] = True
  return tokens, valid


def _ours_logits(model, tokens, valid):
  positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  out = model(jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32),
              cache=NoCache(valid=jnp.asarray(valid)))
  return np.asarray(out.logits)


def _hf_logits(hf, tokens, valid):
  with torch.inference_mode():
    return hf(input_ids=torch.as_tensor(tokens),
              attention_mask=torch.as_tensor(valid, dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-tied{c[1]}")
def imported(request, tmp_path_factory):
  kind, tie = request.param
  d = str(tmp_path_factory.mktemp(f"{kind}{tie}"))
  hf = hf_fixtures.build(kind, d, tie=tie)
  model, _ = hf_io.load_hf_checkpoint(d, load_tokenizer=False)
  return hf, model, d


def test_config_mapping(imported):
  _, model, d = imported
  with open(os.path.join(d, "config.json")) as f:
    hf_cfg = json.load(f)
  cfg = model.cfg
  assert cfg.tie_embeddings == hf_cfg["tie_word_embeddings"]
  assert (cfg.arch == "qwen3") == cfg.qk_norm
  if cfg.arch == "llama":
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    assert cfg.num_heads // cfg.num_kv_heads == 4


def test_logits_padded_batch(imported):
  hf, model, _ = imported
  tokens, valid = _padded_batch(model.cfg.vocab_size, [13, 40, 1, 27])
  ours, ref = _ours_logits(model, tokens, valid), _hf_logits(hf, tokens, valid)
  diff = np.abs(ours - ref)[valid].max()
  assert diff <= LOGIT_TOL, diff


def test_greedy_generation_matches(imported):
  hf, model, _ = imported
  prompts = [[5, 17, 3, 44, 9], [60, 2, 11, 31, 8, 75, 20, 19, 1, 7, 43]]
  ours = generate(model, prompts, 32).tokens
  for p, toks in zip(prompts, ours):
    with torch.inference_mode():
      ref = hf.generate(torch.as_tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                        do_sample=False, max_new_tokens=32, min_new_tokens=32)
    assert toks == ref[0, len(p):].tolist()


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("max_shard_bytes", [2 * 1024**3, 40_000], ids=["single", "sharded"])
def test_export_loads_in_transformers(preset, max_shard_bytes, tmp_path):
  model = init_decoder(get_preset(preset), seed=3)
  hf_io.save_hf_checkpoint(model, str(tmp_path), max_shard_bytes=max_shard_bytes)
  sharded = os.path.exists(tmp_path / "model.safetensors.index.json")
  assert sharded == (max_shard_bytes < 2 * 1024**3)
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
  tokens, valid = _padded_batch(model.cfg.vocab_size, [9, 21, 4])
  ours, ref = _ours_logits(model, tokens, valid), _hf_logits(hf.eval(), tokens, valid)
  assert np.abs(ours - ref)[valid].max() <= LOGIT_TOL
  # and back into ours, bit for bit
  again, _ = hf_io.load_hf_checkpoint(str(tmp_path), load_tokenizer=False)
  np.testing.assert_array_equal(_ours_logits(again, tokens, valid), ours)
