"""Decoder building blocks (Flax NNX): RMSNorm, RoPE, GQA attention, SwiGLU MLP.

Shape legend: ``B`` batch, ``T`` new tokens, ``D`` embed dim, ``H`` query heads,
``K`` KV heads, ``G = H // K`` query heads per KV head, ``Dh`` head dim, ``F`` MLP dim.

Every parameter is created with a ``stack`` prefix shape (``(L,)`` for the scanned
layer stack) and logical ``axes`` metadata read by `spec_rl_jax.sharding`. Projection
weights are stored output-major, as ``nn.Linear`` stores them (``q: [H, Dh, D]``,
``o: [D, H, Dh]``, ``gate: [F, D]``), with ``in_dims`` metadata: how many trailing dims
are the input. `project` runs each projection as one 2-D matmul (head dims merged by a
free reshape), on that layout or on an input-major inference copy
(`layout.CpuLayerCopies`: ``q: [D, H, Dh]``, ``o: [H, Dh, D]``, ``gate: [D, F]``,
``input_major`` metadata). Which layout XLA:CPU reads faster depends on the number of
matmul rows and on the CPU, so the split between the two is a measured default, not a
law (docs/benchmarks.md, CPU inference layout).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from spec_rl_jax.models.config import ModelConfig
from spec_rl_jax.sharding import shard

INIT_STD = 0.02  # HF ``initializer_range``


def _param(rngs: nnx.Rngs | None, stack: tuple[int, ...], shape: tuple[int, ...],
           axes: tuple[str, ...], dtype, init: str = "normal", **metadata) -> nnx.Param:
  full = stack + shape
  full_axes = ("layers",) * len(stack) + axes
  if init == "ones":
    value = jnp.ones(full, dtype)
  else:
    value = (INIT_STD * jax.random.normal(rngs.params(), full, jnp.float32)).astype(dtype)
  return nnx.Param(value, axes=full_axes, **metadata)


class RMSNorm(nnx.Module):
  """``y = x / sqrt(mean(x²) + eps) * w``, computed in fp32."""

  def __init__(self, dim: int, eps: float, *, stack=(), axes=("norm",), dtype=jnp.float32):
    self.eps = eps
    self.scale = _param(None, stack, (dim,), axes, dtype, init="ones")

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
  """Inverse frequencies ``θ_i = base^(-2i/Dh)``, with llama3 scaling when configured."""
  inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, cfg.head_dim, 2, dtype=jnp.float32)
                                  / cfg.head_dim))
  s = cfg.rope_scaling
  if s is None:
    return inv
  low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = jnp.where(wavelen > low_wavelen, inv / s.factor, inv)
  smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
            / (s.high_freq_factor - s.low_freq_factor))
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return jnp.where(medium, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotates ``x[B, T, N, Dh]`` by ``positions[B, T]`` (half-split convention, as HF)."""
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def project(x: jax.Array, w: nnx.Variable) -> jax.Array:
  """``x[..., I] · W → [..., *O]`` for a projection weight whose ``w.in_dims`` input dims
  (flattened: ``I``) are last as stored (``[*O, *I]``) or first in an input-major
  inference copy (``[*I, *O]``, ``input_major`` metadata)."""
  value, n_in = w[...], w.in_dims
  if w.get_metadata().get("input_major", False):
    out_shape = value.shape[n_in:]
    y = jnp.einsum("...i,io->...o", x, value.reshape(x.shape[-1], -1))
  else:
    out_shape = value.shape[:value.ndim - n_in]
    y = jnp.einsum("...i,oi->...o", x, value.reshape(-1, x.shape[-1]))
  return y.reshape(*x.shape[:-1], *out_shape)


class Attention(nnx.Module):
  """Grouped-query attention; the KV history and the softmax live behind ``cache``."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, stack=()):
    D, H, K, Dh, dt = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype
    self.q = _param(rngs, stack, (H, Dh, D), ("heads", "head_dim", "embed"), dt, in_dims=1)
    self.k = _param(rngs, stack, (K, Dh, D), ("kv_heads", "head_dim", "embed"), dt, in_dims=1)
    self.v = _param(rngs, stack, (K, Dh, D), ("kv_heads", "head_dim", "embed"), dt, in_dims=1)
    self.o = _param(rngs, stack, (D, H, Dh), ("embed", "heads", "head_dim"), dt, in_dims=2)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(Dh, cfg.norm_eps, stack=stack, axes=("head_dim",), dtype=dt)
      self.k_norm = RMSNorm(Dh, cfg.norm_eps, stack=stack, axes=("head_dim",), dtype=dt)
    else:
      self.q_norm = self.k_norm = None

  def __call__(self, x, positions, inv_freq, attend):
    """``x[B,T,D]`` → ``([B,T,D], cache layers)``.

    ``attend(q, k, v) -> (out, new_cache_layers)`` closes over the attention context
    (models/attention.py): it writes this layer's ``k, v`` and attends.
    """
    q, k, v = project(x, self.q), project(x, self.k), project(x, self.v)  # [B, T, N, Dh]
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q = shard(apply_rope(q, positions, inv_freq), ("batch", "seq", "act_heads", None))
    k = shard(apply_rope(k, positions, inv_freq), ("batch", "seq", "act_kv_heads", None))
    v = shard(v, ("batch", "seq", "act_kv_heads", None))
    out, cache_layers = attend(q, k, v)  # out: [B, T, H, Dh]
    B, T, H, Dh = out.shape
    out = out.astype(x.dtype).reshape(B, T, H * Dh)
    return project(out, self.o), cache_layers


class MLP(nnx.Module):
  """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, stack=()):
    D, F, dt = cfg.embed_dim, cfg.mlp_dim, cfg.dtype
    self.gate = _param(rngs, stack, (F, D), ("mlp", "embed"), dt, in_dims=1)
    self.up = _param(rngs, stack, (F, D), ("mlp", "embed"), dt, in_dims=1)
    self.down = _param(rngs, stack, (D, F), ("embed", "mlp"), dt, in_dims=1)

  def __call__(self, x):
    h = jax.nn.silu(project(x, self.gate)) * project(x, self.up)
    h = shard(h, ("batch", "seq", "act_mlp"))
    return project(h, self.down)


class Block(nnx.Module):
  """Pre-norm decoder layer: ``x += attn(norm(x)); x += mlp(norm(x))``."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, stack=()):
    self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, stack=stack, dtype=cfg.dtype)
    self.attn = Attention(cfg, rngs=rngs, stack=stack)
    self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, stack=stack, dtype=cfg.dtype)
    self.mlp = MLP(cfg, rngs=rngs, stack=stack)

  def __call__(self, x, positions, inv_freq, attend):
    h, cache_layers = self.attn(self.attn_norm(x), positions, inv_freq, attend)
    x = shard(x + h, ("batch", "seq", "act_embed"))
    x = shard(x + self.mlp(self.mlp_norm(x)), ("batch", "seq", "act_embed"))
    return x, cache_layers
