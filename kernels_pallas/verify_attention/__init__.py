"""Verification attention: ``Q = k + 1`` causal queries per slot over its paged KV."""

from kernels_pallas.verify_attention.kernel import verify_attention_kernel
from kernels_pallas.verify_attention.reference import verify_attention_reference

__all__ = ["verify_attention_kernel", "verify_attention_reference"]
