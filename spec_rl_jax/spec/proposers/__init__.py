"""Proposers, one file each, behind one interface (base.py) and one registry."""

from spec_rl_jax.spec.proposers import draft_model, eagle3, mtp, ngram, self_sparse  # noqa: F401
from spec_rl_jax.spec.proposers.base import (DraftContext, Feedback, PrefillBatch, Proposer,
                                             ProposerState, build_proposer, proposer_class,
                                             registry)

__all__ = ["DraftContext", "Feedback", "PrefillBatch", "Proposer", "ProposerState",
           "build_proposer", "proposer_class", "registry"]
