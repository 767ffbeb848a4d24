"""Model configuration: one frozen dataclass for the Llama 3.x / Qwen3 decoder family.

The two families differ only in a handful of switches:

| switch            | Llama 3.x                | Qwen3              |
|-------------------|--------------------------|--------------------|
| ``qk_norm``       | False                    | True (RMSNorm on q, k per head) |
| ``rope_scaling``  | ``Llama3RopeScaling``    | None               |
| ``tie_embeddings``| 1B/3B: True, 8B: False   | <=4B: True, 8B: False |

Presets are registered by name (`get_preset`) and range from tiny test sizes to the
published checkpoints; the published parameter counts are checked by a test that
instantiates the HF model on the ``meta`` device.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

Arch = Literal["llama", "qwen3"]
AttentionImpl = Literal["xla", "pallas", "pallas_interpret"]  # models/attention.py

ARCHITECTURES: dict[str, Arch] = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
  """Llama 3.1 frequency-dependent RoPE scaling (``rope_type: llama3``)."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder hyper-parameters. ``D`` = ``embed_dim``, ``F`` = ``mlp_dim``."""

  arch: Arch
  vocab_size: int
  embed_dim: int
  mlp_dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10_000.0
  rope_scaling: Llama3RopeScaling | None = None
  norm_eps: float = 1e-6
  qk_norm: bool = False
  tie_embeddings: bool = False
  max_position_embeddings: int = 4096
  param_dtype: str = "float32"  # "float32" | "bfloat16"; norms/softmax always fp32
  remat: bool = False  # rematerialise each layer in the backward pass
  attention_impl: AttentionImpl = "xla"

  def __post_init__(self):
    if self.arch not in ("llama", "qwen3"):
      raise ValueError(f"arch must be 'llama' or 'qwen3', got {self.arch!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads"
          f" ({self.num_kv_heads}) for grouped-query attention")
    if self.param_dtype not in ("float32", "bfloat16"):
      raise ValueError(f"param_dtype must be float32 or bfloat16, got {self.param_dtype!r}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

  @property
  def dtype(self) -> jnp.dtype:
    return jnp.dtype(self.param_dtype)

  @property
  def num_groups(self) -> int:
    """Query heads per KV head (GQA group size)."""
    return self.num_heads // self.num_kv_heads

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)


_LLAMA31_SCALING = Llama3RopeScaling(8.0, 1.0, 4.0, 8192)
_LLAMA32_SCALING = Llama3RopeScaling(32.0, 1.0, 4.0, 8192)

PRESETS: dict[str, ModelConfig] = {
    # Tiny sizes for tests (vocab small so the statistical tests can enumerate it).
    "tiny-qwen3": ModelConfig(
        arch="qwen3", vocab_size=128, embed_dim=64, mlp_dim=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10_000.0, qk_norm=True,
        tie_embeddings=True, max_position_embeddings=512),
    "tiny-llama": ModelConfig(
        arch="llama", vocab_size=128, embed_dim=64, mlp_dim=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=500_000.0,
        rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 64), norm_eps=1e-5,
        max_position_embeddings=512),
    # The embedded default policy and its drafter, trained by `python -m spec_rl_jax.sft`
    # on the built-in tasks (vocab = the task tokenizer's cap, spec_rl_jax/tasks/bpe.py).
    "default-policy": ModelConfig(
        arch="qwen3", vocab_size=512, embed_dim=320, mlp_dim=1024, num_layers=6,
        num_heads=5, num_kv_heads=1, head_dim=64, rope_theta=10_000.0, qk_norm=True,
        tie_embeddings=True, max_position_embeddings=512),
    "default-draft": ModelConfig(
        arch="qwen3", vocab_size=512, embed_dim=192, mlp_dim=576, num_layers=3,
        num_heads=3, num_kv_heads=1, head_dim=64, rope_theta=10_000.0, qk_norm=True,
        tie_embeddings=True, max_position_embeddings=512),
    # The long-response workload (tasks/counting.py, bench/sparse.py): small weights,
    # 4k positions, so attention over the KV cache dominates decode time. The policy's
    # RoPE base is 1e6: its stop compares the number just written with the prompt's end
    # number up to ~2,500 positions back, and the larger base learned that comparison
    # more reliably than 1e4 (docs/benchmarks.md, the long policy's SFT).
    "long-policy": ModelConfig(
        arch="qwen3", vocab_size=512, embed_dim=192, mlp_dim=512, num_layers=4,
        num_heads=6, num_kv_heads=2, head_dim=32, rope_theta=1_000_000.0, qk_norm=True,
        tie_embeddings=True, max_position_embeddings=4096),
    "long-draft": ModelConfig(
        arch="qwen3", vocab_size=512, embed_dim=128, mlp_dim=256, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10_000.0, qk_norm=True,
        tie_embeddings=True, max_position_embeddings=4096),
    # Published checkpoints.
    "qwen3-0.6b": ModelConfig(
        arch="qwen3", vocab_size=151_936, embed_dim=1024, mlp_dim=3072, num_layers=28,
        num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0, qk_norm=True,
        tie_embeddings=True, max_position_embeddings=40_960, param_dtype="bfloat16"),
    "qwen3-1.7b": ModelConfig(
        arch="qwen3", vocab_size=151_936, embed_dim=2048, mlp_dim=6144, num_layers=28,
        num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0, qk_norm=True,
        tie_embeddings=True, max_position_embeddings=40_960, param_dtype="bfloat16"),
    "qwen3-8b": ModelConfig(
        arch="qwen3", vocab_size=151_936, embed_dim=4096, mlp_dim=12_288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0, qk_norm=True,
        tie_embeddings=False, max_position_embeddings=40_960, param_dtype="bfloat16"),
    "llama-3.2-1b": ModelConfig(
        arch="llama", vocab_size=128_256, embed_dim=2048, mlp_dim=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500_000.0,
        rope_scaling=_LLAMA32_SCALING, norm_eps=1e-5, tie_embeddings=True,
        max_position_embeddings=131_072, param_dtype="bfloat16"),
    "llama-3.1-8b": ModelConfig(
        arch="llama", vocab_size=128_256, embed_dim=4096, mlp_dim=14_336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500_000.0,
        rope_scaling=_LLAMA31_SCALING, norm_eps=1e-5, tie_embeddings=False,
        max_position_embeddings=131_072, param_dtype="bfloat16"),
}


def get_preset(name: str, **overrides) -> ModelConfig:
  """Returns the named preset, optionally with fields replaced."""
  if name not in PRESETS:
    raise KeyError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}")
  return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
