"""Causal attention over a call's own tokens, with a recomputing backward pass.

The attention of `NoCache` (training, teacher forcing, scoring). Queries run in blocks
of `QUERY_BLOCK` rows; block ``i`` attends keys ``[0, end_i)`` only (later keys are
masked for all its rows, so skipping them is exact and halves a long sequence's
attention FLOPs). Each block is one `block_attention` call whose backward follows
FlashAttention-2 (Dao, 2023, Algorithm 2) instead of differentiating the softmax: the
forward keeps only the output ``O`` and the row log-sum-exp ``lse``, and the backward
recomputes ``P = exp(Q Kᵀ · scale + bias − lse)`` and forms

  ``dV = Pᵀ dO``,  ``dP = dO Vᵀ``,  ``D = rowsum(dO ∘ O)``,  ``dS = P ∘ (dP − D)``,
  ``dQ = dS K · scale``,  ``dK = dSᵀ Q · scale``,

so no ``[B, H, C, S]`` probability tensor is stored between the passes and the masks
are one additive bias. That makes the gradient of long sequences cheaper than autodiff
through the softmax (the reference `attention.dot_product_attention` in the same
blocks) and leaves short ones unchanged (docs/benchmarks.md, training attention).

Shape legend: ``B`` batch, ``T`` tokens, ``C`` query rows of a block, ``S`` keys of a
block, ``H`` query heads, ``K`` KV heads, ``G = H // K``, ``Dh`` head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite: a fully masked row gives a uniform (then zeroed) row, no NaN

# Query rows per block: smaller blocks skip more masked keys but unroll into more
# blocks to compile; 256 runs nearly as fast as 128 and compiles faster.
QUERY_BLOCK = 256


def _acc(x):
  """The dtype we compute in: fp32, or the inputs' if wider (float64 in tests)."""
  return jnp.promote_types(x.dtype, jnp.float32)


def _logits(q, k, bias):
  """``s [B, K, G, C, S]``: scaled ``q [B, C, H, Dh] · k [B, S, K, Dh]`` + bias."""
  B, C, H, Dh = q.shape
  K = k.shape[2]
  qg = q.reshape(B, C, K, H // K, Dh)
  s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=_acc(q))
  return s * (Dh ** -0.5) + bias[:, None, None]


def _block_forward(q, k, v, bias):
  B, C, H, Dh = q.shape
  s = _logits(q, k, bias)
  m = s.max(-1, keepdims=True)
  p = jnp.exp(s - m)
  l = p.sum(-1, keepdims=True)
  o = jnp.einsum("bkgts,bskd->bkgtd", p, v.astype(p.dtype)) / l
  o = o.transpose(0, 3, 1, 2, 4).reshape(B, C, H, Dh)
  return o, (q, k, v, bias, o, m + jnp.log(l))


def _block_backward(residuals, do):
  q, k, v, bias, o, lse = residuals
  B, C, H, Dh = q.shape
  K = k.shape[2]
  G = H // K
  p = jnp.exp(_logits(q, k, bias) - lse)  # [B, K, G, C, S]
  dog = do.reshape(B, C, K, G, Dh)
  dv = jnp.einsum("bkgts,btkgd->bskd", p, dog)
  dp = jnp.einsum("btkgd,bskd->bkgts", dog, v.astype(p.dtype))
  delta = jnp.einsum("btkgd,btkgd->bkgt", dog, o.reshape(B, C, K, G, Dh))
  ds = p * (dp - delta[..., None]) * (Dh ** -0.5)
  dq = jnp.einsum("bkgts,bskd->btkgd", ds, k.astype(p.dtype)).reshape(B, C, H, Dh)
  dk = jnp.einsum("bkgts,btkgd->bskd", ds, q.reshape(B, C, K, G, Dh).astype(p.dtype))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), jnp.zeros_like(bias)


@jax.custom_vjp
def block_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                    bias: jax.Array) -> jax.Array:
  """Softmax attention of one query block, with the recomputing backward above.

  Args:
    q: ``[B, C, H, Dh]`` queries (RoPE applied).
    k: ``[B, S, K, Dh]`` keys (RoPE applied).
    v: ``[B, S, K, Dh]`` values.
    bias: ``[B, C, S]``, 0 where query ``t`` may attend key ``s``, else `NEG_INF`
      (not differentiated).
  Returns:
    ``[B, C, H, Dh]`` in fp32 (or the inputs' dtype if wider).
  """
  return _block_forward(q, k, v, bias)[0]


block_attention.defvjp(_block_forward, _block_backward)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     valid: jax.Array | None) -> jax.Array:
  """Causal GQA attention of ``T`` tokens over themselves.

  Args:
    q: ``[B, T, H, Dh]`` queries (RoPE applied).
    k: ``[B, T, K, Dh]`` keys (RoPE applied).
    v: ``[B, T, K, Dh]`` values.
    valid: ``[B, T]`` bool, False on padding keys (either side); None: all real.
  Returns:
    ``[B, T, H, Dh]`` in fp32 (or the inputs' dtype if wider); rows with no visible key (left padding) are zero.
  """
  B, T = q.shape[:2]
  idx = jnp.arange(T)
  if valid is None:
    valid = jnp.ones((B, T), bool)
  first = jnp.argmax(valid, axis=1)  # [B]: the first real key
  seen = (idx[None] >= first[:, None]) & valid.any(axis=1, keepdims=True)  # [B, T]
  out = []
  for start in range(0, T, QUERY_BLOCK):
    end = min(start + QUERY_BLOCK, T)
    mask = (idx[start:end, None] >= idx[None, :end]) & valid[:, None, :end]  # [B, C, S]
    bias = jnp.where(mask, 0.0, NEG_INF).astype(_acc(q))
    out.append(block_attention(q[:, start:end], k[:, :end], v[:, :end], bias))
  return jnp.where(seen[:, :, None, None], jnp.concatenate(out, axis=1), 0.0)
