"""Sparse draft attention over selected KV pages, page selection and the merge."""

from kernels_pallas.sparse_attention.kernel import sparse_attention_kernel
from kernels_pallas.sparse_attention.reference import merge_partials, sparse_attention_reference
from kernels_pallas.sparse_attention.selection import page_scores, select_pages

__all__ = [
    "merge_partials",
    "page_scores",
    "select_pages",
    "sparse_attention_kernel",
    "sparse_attention_reference",
]
