"""Tiny random ``transformers`` checkpoints built inside the tests (no hub access)."""

from __future__ import annotations

import torch
import transformers

LLAMA = dict(
    vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
    num_attention_heads=8, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
    max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2,
    rope_theta=500_000.0,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=32),
)
QWEN3 = dict(
    vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
    max_position_embeddings=256, initializer_range=0.2, rope_theta=1_000_000.0,
)


def build(kind: str, directory: str, tie: bool | None = None, seed: int = 0):
  """Builds, saves and returns a random fp32 HF model of ``kind`` (llama|qwen3)."""
  torch.manual_seed(seed)
  if kind == "llama":
    cfg = transformers.LlamaConfig(**LLAMA)
    model = transformers.LlamaForCausalLM(cfg)
  else:
    cfg = transformers.Qwen3Config(**QWEN3, tie_word_embeddings=bool(tie))
    model = transformers.Qwen3ForCausalLM(cfg)
  model = model.eval().to(torch.float32)
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  model.save_pretrained(directory)
  return model
