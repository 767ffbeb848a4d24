"""The Llama 3.x / Qwen3 decoder (Flax NNX), layers stacked and scanned.

Shape legend: ``B`` batch, ``T`` tokens in this call, ``D`` embed dim, ``V`` vocab,
``L`` layers, ``n`` requested hidden layers.

``Decoder.__call__(tokens, positions, cache=..., hidden_layers=...)`` is the one
forward used everywhere: training (``NoCache``), reference decoding
(``ContiguousKVCache``) and the rollout engine (paged cache). The cache is threaded in
and returned, never mutated in place; its ``layers`` field is scanned together with the
layer parameters, so compile time does not grow with depth.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from spec_rl_jax import sharding
from spec_rl_jax.models import attention
from spec_rl_jax.models.config import ModelConfig
from spec_rl_jax.models.layers import Block, RMSNorm, _param, rope_inv_freq


class DecoderOutput(NamedTuple):
  logits: jax.Array  # [B, T, V] fp32 ([B, n, V] with ``logits_at``)
  cache: Any  # the attention context with updated ``layers``
  hidden: jax.Array | None  # [n, B, T, D]: output of each requested layer (pre final norm)


class Decoder(nnx.Module):
  """Token embedding → ``L`` scanned `Block`s → final RMSNorm → LM head."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dt = cfg.dtype
    self.embed = _param(rngs, (), (cfg.vocab_size, cfg.embed_dim), ("vocab", "embed"), dt)
    self.layers = Block(cfg, rngs=rngs, stack=(cfg.num_layers,))
    self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, dtype=dt)
    self.lm_head = (None if cfg.tie_embeddings else
                    _param(rngs, (), (cfg.vocab_size, cfg.embed_dim), ("vocab", "embed"), dt))

  def __call__(self, tokens: jax.Array, positions: jax.Array, *,
               cache: Any = None, hidden_layers: Sequence[int] = (),
               logits_at: jax.Array | None = None,
               layer_params: Sequence[Any] | None = None) -> DecoderOutput:
    """Runs the decoder.

    Args:
      tokens: ``[B, T]`` int token ids.
      positions: ``[B, T]`` int positions (RoPE angle and, for caches, write index).
      cache: attention context (models/attention.py); ``None`` = causal attention over
        ``tokens`` only, all valid.
      hidden_layers: layer indices in ``[0, L)`` whose outputs are returned.
      logits_at: ``[B, n]`` token indices whose logits are computed (e.g. only the
        last prompt token in a prefill); ``None`` = all ``T``.
      layer_params: per-layer copies of the layer weights (models/layout.py); the
        layers then run as an unrolled loop over them instead of a scan over the
        stacked weights (same math).
    """
    cfg = self.cfg
    cache = attention.NoCache() if cache is None else cache
    impl = attention.get_impl(cfg.attention_impl)
    for i in hidden_layers:
      if not 0 <= i < cfg.num_layers:
        raise ValueError(f"hidden layer index {i} outside [0, {cfg.num_layers})")
    wanted = jnp.asarray(tuple(hidden_layers), jnp.int32)  # [n]

    x = jnp.take(self.embed[...], tokens, axis=0)
    x = sharding.shard(x, ("batch", "seq", "act_embed"))
    inv_freq = rope_inv_freq(cfg)
    graphdef, stacked = nnx.split(self.layers)

    def body(carry, params):
      x, hidden, cache_layers, idx = carry
      block = nnx.merge(graphdef, params)
      attend = lambda q, k, v: cache.attend(impl, cache_layers, idx, q, k, v, positions)
      x, new_layers = block(x, positions, inv_freq, attend)
      if hidden is not None:
        hidden = jnp.where((wanted == idx)[:, None, None, None], x[None], hidden)
      return (x, hidden, new_layers, idx + 1), None

    if cfg.remat:
      body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    hidden0 = (jnp.zeros((len(hidden_layers),) + x.shape, x.dtype) if hidden_layers
               else None)
    if layer_params is None:
      (x, hidden, new_layers, _), _ = jax.lax.scan(
          body, (x, hidden0, cache.layers, jnp.int32(0)), stacked)
    else:
      carry = (x, hidden0, cache.layers, 0)
      for params in layer_params:
        carry, _ = body(carry, params)
      x, hidden, new_layers, _ = carry
    cache = cache.replace(layers=new_layers)

    if logits_at is not None:
      x = jnp.take_along_axis(x, logits_at[:, :, None], axis=1)
    logits = self.logits(self.final_norm(x))
    return DecoderOutput(logits, cache, hidden)

  def logits(self, x: jax.Array) -> jax.Array:
    """LM head on final-normed ``x[..., D]`` → fp32 ``[..., V]``."""
    table = self.embed if self.lm_head is None else self.lm_head  # [V, D] either way
    out = jnp.einsum("...d,vd->...v", x, table[...], preferred_element_type=jnp.float32)
    return sharding.shard(out, ("batch", "seq", "act_vocab")) if out.ndim == 3 else out


class Weights(NamedTuple):
  """A decoder's weights as inference code passes them: the model state, and
  optionally per-layer copies of the stacked layer weights (``None``: the layers run
  as a scan over the stacked weights). models/layout.py chooses per backend."""

  state: Any
  layers: tuple[Any, ...] | None


def apply(graphdef: nnx.GraphDef, weights: Weights, tokens: jax.Array, positions: jax.Array,
          **kwargs) -> DecoderOutput:
  """``Decoder.__call__`` of the model ``(graphdef, weights)`` (traceable)."""
  model = nnx.merge(graphdef, weights.state)
  return model(tokens, positions, layer_params=weights.layers, **kwargs)


def teacher_forced(graphdef: nnx.GraphDef, params: Any, tokens: jax.Array, valid: jax.Array,
                   hidden_layers: Sequence[int] = ()) -> DecoderOutput:
  """The forward of right-padded sequences ``tokens[B, T]`` (``valid[B, T]`` marks the
  real ones) at positions ``0..T-1``: ``logits[B, T, V]`` of every next token (and the
  ``hidden_layers`` outputs). The one scoring forward of the learner, SFT, distillation
  and evaluation (traceable)."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  return nnx.merge(graphdef, params)(tokens, positions, cache=attention.NoCache(valid=valid),
                                     hidden_layers=hidden_layers)


def abstract_decoder(cfg: ModelConfig) -> Decoder:
  """The decoder with ``ShapeDtypeStruct`` leaves: no weights allocated."""
  return nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))


def param_count(model: Decoder) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def init_decoder(cfg: ModelConfig, seed: int = 0, mesh: Mesh | None = None,
                 rules=sharding.RULES) -> Decoder:
  """Random-init decoder, created directly in its sharded layout on ``mesh``.

  ``eval_shape`` gives the abstract state, the rules table gives its shardings, and a
  jitted init with ``out_shardings`` materialises each shard on its device — no
  full-size host copy.
  """
  graphdef, abstract_state = nnx.split(abstract_decoder(cfg))
  mesh = sharding.make_mesh((1, 1, 1)) if mesh is None else mesh
  shardings = sharding.state_shardings(abstract_state, mesh, rules)

  def make():
    return nnx.state(Decoder(cfg, rngs=nnx.Rngs(seed)))

  make = jax.jit(make, out_shardings=shardings)
  return nnx.merge(graphdef, make())
