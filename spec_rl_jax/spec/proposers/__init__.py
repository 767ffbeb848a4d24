"""Proposers, one file each, behind one interface (base.py) and a registry."""

from spec_rl_jax.spec.proposers import draft_model, ngram, self_sparse  # noqa: F401
from spec_rl_jax.spec.proposers.base import DraftContext, Proposer, make_proposer

__all__ = ["DraftContext", "Proposer", "make_proposer"]
