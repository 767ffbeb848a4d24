"""The attention dispatch point and the cache-free attention context.

Model code never calls an attention implementation directly: it hands ``q, k, v`` to
an *attention context* — `NoCache` here, `ContiguousKVCache` (models/kv_cache.py) or
the rollout engine's paged cache — and the context picks the implementation registered
under ``ModelConfig.attention_impl`` with `get_impl`. Kernels (``kernels_pallas``)
plug in by registering a name; layer code does not change. `resolve_impl` turns a
recipe's choice (``auto`` included) into a registered name for the run's backend.

A context is a pytree with:
  * ``layers``: per-layer state with a leading ``[L]`` axis (``None`` when there is
    none). It rides in the layer scan's *carry* and each layer updates its ``[l]``
    slice in place, so a donated cache is never copied per token.
  * ``attend(impl, layers, l, q, k, v, positions) -> (out, new_layers)`` for layer
    ``l`` (a traced int),
  * ``replace(layers=...)``.

Shape legend: ``B`` batch, ``T`` query tokens, ``S`` key tokens, ``H`` query heads,
``K`` KV heads, ``G = H // K``, ``Dh`` head dim.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

import kernels_pallas
from spec_rl_jax.models.causal_attention import NEG_INF, causal_attention


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                          mask: jax.Array) -> jax.Array:
  """Reference GQA attention (pure XLA, fp32 softmax).

  Args:
    q: ``[B, T, H, Dh]`` queries (RoPE applied).
    k: ``[B, S, K, Dh]`` keys (RoPE applied).
    v: ``[B, S, K, Dh]`` values.
    mask: ``[B, T, S]`` bool, True where query ``t`` may attend key ``s``.
  Returns:
    ``[B, T, H, Dh]`` in fp32 (or the inputs' dtype if wider); rows with no visible
    key are zero.
  """
  B, T, H, Dh = q.shape
  K = k.shape[2]
  qg = q.reshape(B, T, K, H // K, Dh)
  acc = jnp.promote_types(q.dtype, jnp.float32)
  logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=acc)
  logits = logits * (Dh ** -0.5)
  m = mask[:, None, None, :, :]
  logits = jnp.where(m, logits, NEG_INF)
  probs = jax.nn.softmax(logits, axis=-1)
  probs = jnp.where(m, probs, 0.0)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(acc))
  return out.reshape(B, T, H, Dh)


@dataclasses.dataclass(frozen=True)
class AttentionImpl:
  """The functions one implementation provides."""

  dense: Callable[..., jax.Array]  # (q, k, v, mask) -> out
  # (q [B,T,H,Dh], k, v [B,T,K,Dh], valid [B,T] | None) -> out: causal, cache-free
  causal: Callable[..., jax.Array]
  # (q [S,T,H,Dh], k_pages [Hk,P,Ps,Dh], v_pages, page_table [S,M], kv_lens [S]) -> out
  paged: Callable[..., jax.Array]
  # paged arguments + (sel_idx, sel_valid [S,Hk,B]) -> (out, m, l): selected pages only
  sparse: Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


def _paged_impl(**kernel_args) -> AttentionImpl:
  """The paged attentions through `kernels_pallas` with ``kernel_args`` (``impl``,
  ``interpret``). Cache-free attention has no kernel: training uses XLA's, blocked with
  a recomputing backward (models/causal_attention.py)."""
  return AttentionImpl(
      dense=dot_product_attention, causal=causal_attention,
      paged=functools.partial(kernels_pallas.verify_attention, **kernel_args),
      sparse=functools.partial(kernels_pallas.sparse_attention, **kernel_args))


# "pallas": the Mosaic kernels, only on `kernels_pallas.KERNEL_BACKENDS` (TPU).
# "pallas_interpret": the same kernels interpreted on any backend, so CPU tests run the
# engine through the kernels' code (slow: tiny models only). A block's pages are
# unrolled into the program: 2-page blocks keep the programs small and still cover
# double buffering and partial blocks.
_IMPLS: dict[str, AttentionImpl] = {
    "xla": _paged_impl(impl="xla"),
    "pallas": _paged_impl(impl="pallas"),
    "pallas_interpret": _paged_impl(impl="pallas", interpret=True, pages_per_block=2),
}
# What a recipe may ask for (``policy.attention_impl``): a registered name, or "auto".
CHOICES = ("auto", *_IMPLS)


def get_impl(name: str) -> AttentionImpl:
  if name not in _IMPLS:
    raise ValueError(f"unknown attention_impl {name!r}; registered: {sorted(_IMPLS)}")
  return _IMPLS[name]


def resolve_impl(name: str, backend: str | None = None) -> str:
  """The registered implementation that ``name`` (one of `CHOICES`) means on
  ``backend`` (default: JAX's default backend). Raises ValueError for an unknown name
  and for ``"pallas"`` where no kernel compiles, so a run stops before it loads a weight.

  ``"auto"``: the Pallas kernels where they compile (TPU), else the XLA path. On GPU
  that is XLA: the repo has no Pallas GPU kernel (Triton lowering deprecated, no Mosaic
  GPU kernel); one would have to beat XLA's attention in ``bench.kernels`` on the GPU
  before ``auto`` picks it there.
  """
  backend = backend or jax.default_backend()
  if name == "auto":
    return "pallas" if backend in kernels_pallas.KERNEL_BACKENDS else "xla"
  if name not in _IMPLS:
    raise ValueError(f"unknown attention_impl {name!r}; choose one of {list(CHOICES)}")
  if name == "pallas" and backend not in kernels_pallas.KERNEL_BACKENDS:
    raise ValueError(f"attention_impl 'pallas': the Pallas kernels compile for"
                     f" {list(kernels_pallas.KERNEL_BACKENDS)}, not for backend {backend!r};"
                     " use 'auto' or 'xla' ('pallas_interpret' runs them interpreted, for"
                     " tests)")
  return name


@struct.dataclass
class NoCache:
  """Attention over the tokens of this call only (training, teacher forcing, scoring).

  Causal by index: query ``t`` sees the keys ``s <= t`` that ``valid[B, T]`` marks
  real (padding on either side is masked out; ``positions`` only set the RoPE angles).
  The implementation's ``causal`` attention runs it (query blocks, recomputing
  backward: models/causal_attention.py).
  """

  valid: jax.Array | None = None
  layers: Any = None

  def attend(self, impl: AttentionImpl, layers, l, q, k, v, positions):
    del l, positions
    return impl.causal(q, k, v, self.valid), layers

  def replace(self, **kw):
    return dataclasses.replace(self, **kw)
