"""Model shapes for the simulator: parameter counts, active parameters, KV bytes.

Symbols (one decoder, Llama/Qwen3 family, optionally mixture-of-experts):

  L layers, d model width, H query heads, H_kv KV heads, h head dim, F FFN width of one
  expert (the dense FFN for dense models), E experts, a experts active per token, V vocab.

  N_attn   = L·d·h·(2H + 2H_kv)               (q, k, v, o projections)
  N_expert = 3·d·F                            (SwiGLU: gate, up, down)
  N_total  = N_attn + L·(E·N_expert + d·E·[E>1]) + V·d·(1 if tied else 2)
  N_active = N_attn + L·(a·N_expert + d·E·[E>1]) + V·d   (per token: the LM head is a
             matmul, the embedding a gather)
  KV bytes per token = 2·L·H_kv·h·b_kv

The Qwen3 numbers are the published `config.json` values of the Hugging Face checkpoints
(`Qwen/Qwen3-*`: num_hidden_layers, hidden_size, num_attention_heads,
num_key_value_heads, head_dim, intermediate_size / moe_intermediate_size, num_experts,
num_experts_per_tok, tie_word_embeddings). The built-in defaults come from
`spec_rl_jax.models.config.PRESETS`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SimModel:
  """A decoder's shape (symbols in the module docstring); ``weight_bytes`` per parameter
  as served (2: bf16), ``kv_bytes`` per cached element."""

  name: str
  layers: int
  d_model: int
  heads: int
  kv_heads: int
  head_dim: int
  ffn: int
  vocab: int
  tied: bool = False
  experts: int = 1
  active_experts: int = 1
  weight_bytes: int = 2
  kv_bytes: int = 2

  @property
  def attn_params(self) -> int:
    """``N_attn = L·d·h·(2H + 2H_kv)``."""
    return self.layers * self.d_model * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

  @property
  def expert_params(self) -> int:
    """``N_expert = 3·d·F`` (one expert of one layer)."""
    return 3 * self.d_model * self.ffn

  @property
  def router_params(self) -> int:
    return self.layers * self.d_model * self.experts if self.experts > 1 else 0

  @property
  def total_params(self) -> int:
    """``N_total`` (module docstring)."""
    embed = self.vocab * self.d_model * (1 if self.tied else 2)
    return (self.attn_params + self.layers * self.experts * self.expert_params
            + self.router_params + embed)

  @property
  def active_params(self) -> int:
    """``N_active``: the parameters one token's forward multiplies with."""
    return (self.attn_params + self.layers * self.active_experts * self.expert_params
            + self.router_params + self.vocab * self.d_model)

  @property
  def dense_params(self) -> int:
    """Parameters every token reads, whatever its routing: ``N_total`` less the experts
    (dense models: all of them)."""
    if self.experts == 1:
      return self.total_params
    return self.total_params - self.layers * self.experts * self.expert_params

  @property
  def kv_bytes_per_token(self) -> int:
    """``2·L·H_kv·h·b_kv``."""
    return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes

  @property
  def moe(self) -> bool:
    return self.experts > 1


def _qwen3(name, L, d, H, Hkv, F, tied, E=1, a=1) -> SimModel:
  return SimModel(name, L, d, H, Hkv, 128, F, 151_936, tied, E, a)


MODELS: dict[str, SimModel] = {m.name: m for m in (
    _qwen3("qwen3-0.6b", 28, 1024, 16, 8, 3072, True),
    _qwen3("qwen3-1.7b", 28, 2048, 16, 8, 6144, True),
    _qwen3("qwen3-4b", 36, 2560, 32, 8, 9728, True),
    _qwen3("qwen3-8b", 36, 4096, 32, 8, 12_288, False),
    _qwen3("qwen3-14b", 40, 5120, 40, 8, 17_408, False),
    _qwen3("qwen3-32b", 64, 5120, 64, 8, 25_600, False),
    _qwen3("qwen3-30b-a3b", 48, 2048, 32, 4, 768, False, E=128, a=8),
    _qwen3("qwen3-235b-a22b", 94, 4096, 64, 4, 1536, False, E=128, a=8),
)}


def _from_preset(name: str) -> SimModel:
  from spec_rl_jax.models.config import get_preset
  return from_config(name, get_preset(name))


def from_config(name: str, c) -> SimModel:
  """The shapes of a `models.config.ModelConfig` ``c`` as a `SimModel`."""
  b = 4 if c.param_dtype == "float32" else 2
  return SimModel(name, c.num_layers, c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim,
                  c.mlp_dim, c.vocab_size, c.tie_embeddings, weight_bytes=b, kv_bytes=b)


BUILTIN = ("default-policy", "default-draft", "long-policy", "long-draft")


def get_model(name: str) -> SimModel:
  """The named model; an unknown name lists the known ones."""
  if name in MODELS:
    return MODELS[name]
  if name in BUILTIN:
    return _from_preset(name)
  raise ValueError(f"unknown model {name!r}; known models: {', '.join([*MODELS, *BUILTIN])}")


def known_models() -> list[str]:
  return [*MODELS, *BUILTIN]


# ------------------------------------------------------------------------ drafters

@dataclasses.dataclass(frozen=True)
class Drafter:
  """What one draft step reads and computes: ``model`` (its own decoder; None for a
  model-free drafter such as n-gram matching) run once per drafted token."""

  kind: str
  model: SimModel | None


DRAFTERS = ("eagle3", "mtp", "draft_model", "ngram", "none")
# The small external draft model of each target (same tokenizer, the smallest family
# member that is at most a tenth of the target's size); built-in policies have theirs.
DEFAULT_DRAFT = {"default-policy": "default-draft", "long-policy": "long-draft"}
EAGLE3_VOCAB = 32_000  # Eagle3's reduced draft vocabulary (its released Qwen3/Llama heads)


def get_drafter(kind: str, target: SimModel, draft_model: str | None = None) -> Drafter:
  """The drafter ``kind`` for ``target``:

  * ``eagle3``: one decoder layer of the target's shape and an LM head over
    `EAGLE3_VOCAB` tokens, ``N = N_layer + V_draft·d`` read per draft step (dense FFN of
    the target's width; for a MoE target one expert's width times the active count).
    The fusion ``3d -> d`` of the target's low/mid/high features runs once per round
    on the verified positions, not per draft step, and is left out.
  * ``mtp``: one decoder layer plus the target's (shared) LM head per draft step.
  * ``draft_model``: a separate small model (``draft_model`` or the default per target).
  * ``ngram``: suffix matching on the host, no device work.
  """
  if kind not in DRAFTERS:
    raise ValueError(f"unknown drafter {kind!r}; known drafters: {', '.join(DRAFTERS)}")
  if kind in ("ngram", "none"):
    return Drafter(kind, None)
  if kind == "draft_model":
    name = draft_model or DEFAULT_DRAFT.get(target.name)
    if name is None:
      small = [m for m in MODELS.values()
               if not m.moe and m.total_params * 10 <= target.total_params]
      if not small:
        raise ValueError(f"no default draft model for {target.name}: pass --draft-model")
      name = max(small, key=lambda m: m.total_params).name
    return Drafter(kind, get_model(name))
  ffn = target.ffn * target.active_experts
  layer = dataclasses.replace(target, name=f"{kind}-head({target.name})", layers=1, ffn=ffn,
                              experts=1, active_experts=1, tied=True,
                              vocab=EAGLE3_VOCAB if kind == "eagle3" else target.vocab)
  return Drafter(kind, layer)
