"""The one switch between attention implementations: ``impl`` in {"xla", "pallas"}.

* ``"xla"``: the pure-JAX reference, on every backend.
* ``"pallas"``: the Mosaic kernel on the backends in `KERNEL_BACKENDS` (TPU); the
  kernel in interpret mode on any backend when ``interpret`` is set (tests). Elsewhere
  it raises: a run that asked for the kernels must not silently measure the reference.
  There is no GPU kernel: the Triton lowering is deprecated and no Mosaic-GPU version
  exists yet.

Model code calls these functions (through ``kernels_pallas``), never a kernel module.
"""

from __future__ import annotations

from typing import Any

import jax

from kernels_pallas.sparse_attention.kernel import sparse_attention_kernel
from kernels_pallas.sparse_attention.reference import sparse_attention_reference
from kernels_pallas.verify_attention.kernel import verify_attention_kernel
from kernels_pallas.verify_attention.reference import verify_attention_reference

IMPLS = ("xla", "pallas")
KERNEL_BACKENDS = ("tpu",)  # backends the kernels compile for (not interpreted)


def default_pages_per_block(page_size: int, backend: str | None = None) -> int:
  """KV pages per compute block for ``backend`` (default: JAX's default backend).

  TPU: 512 keys per block amortise the per-block work (DMA issue, softmax rescale)
  while the K and V double buffers stay at 0.5 MiB of VMEM for ``Dh = 128`` bf16.
  Elsewhere the kernels only run interpreted, where 128 keys keep blocks cheap yet
  cover a few pages.
  """
  keys = 512 if (backend or jax.default_backend()) == "tpu" else 128
  return max(1, keys // page_size)


def _use_kernel(name: str, impl: str, interpret: Any) -> bool:
  if impl not in IMPLS:
    raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")
  if impl == "xla":
    return False
  backend = jax.default_backend()
  if not interpret and backend not in KERNEL_BACKENDS:
    raise ValueError(f"attention impl 'pallas': no {name} kernel for backend {backend!r}"
                     f" (kernels compile for {list(KERNEL_BACKENDS)}); use impl='xla', or"
                     " interpret=True to run the kernel interpreted")
  return True


def verify_attention(
    q: jax.Array,  # [S, Q, H, Dh]
    k_pages: jax.Array,  # [Hk, P, Ps, Dh]
    v_pages: jax.Array,  # [Hk, P, Ps, Dh]
    page_table: jax.Array,  # [S, M] int32
    kv_lens: jax.Array,  # [S] int32
    *,
    impl: str = "xla",
    interpret: Any = False,
    pages_per_block: int | None = None,
    scale: float | None = None,
) -> jax.Array:  # [S, Q, H, Dh] fp32
  """Causal attention of the last ``Q`` positions of each slot over its paged KV.

  ``interpret``: True or a `pltpu.InterpretParams` runs the Pallas kernel interpreted
  (with ``impl="pallas"``). ``pages_per_block``: KV pages per kernel block, default
  `default_pages_per_block`. ``scale`` defaults to ``Dh ** -0.5``.
  """
  if not _use_kernel("verify_attention", impl, interpret):
    return verify_attention_reference(q, k_pages, v_pages, page_table, kv_lens, scale=scale)
  ppb = pages_per_block or default_pages_per_block(k_pages.shape[2])
  return verify_attention_kernel(q, k_pages, v_pages, page_table, kv_lens,
                                 pages_per_block=ppb, scale=scale, interpret=interpret)


def sparse_attention(
    q: jax.Array,  # [S, Q, H, Dh]
    k_pages: jax.Array,  # [Hk, P, Ps, Dh]
    v_pages: jax.Array,  # [Hk, P, Ps, Dh]
    page_table: jax.Array,  # [S, M] int32
    kv_lens: jax.Array,  # [S] int32
    sel_idx: jax.Array,  # [S, Hk, B] int32 page slots, from `select_pages`
    sel_valid: jax.Array,  # [S, Hk, B] bool
    *,
    impl: str = "xla",
    interpret: Any = False,
    pages_per_block: int | None = None,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # out [S, Q, H, Dh], m, l [S, Q, H]; fp32
  """Causal attention over the selected pages; ``(out, m, l)`` merge by `merge_partials`.

  Arguments as in `verify_attention`, plus the selection.
  """
  if not _use_kernel("sparse_attention", impl, interpret):
    return sparse_attention_reference(q, k_pages, v_pages, page_table, kv_lens, sel_idx,
                                      sel_valid, scale=scale)
  ppb = pages_per_block or default_pages_per_block(k_pages.shape[2])
  return sparse_attention_kernel(q, k_pages, v_pages, page_table, kv_lens, sel_idx,
                                 sel_valid, pages_per_block=ppb, scale=scale,
                                 interpret=interpret)
