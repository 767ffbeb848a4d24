"""Advantage estimators for group-sampled rollouts, behind one registry.

Every estimator maps the rewards of ``G`` responses to each of ``B`` prompts,
``r[B, G]``, to one scalar advantage per response, ``A[B, G]`` (broadcast over the
response's tokens by the loss). With ``mean_g = (1/G) Σ_j r_j`` and ``std_g`` the
population standard deviation of the group:

  grpo         A_i = (r_i - mean_g) / (std_g + ε)           (Shao et al., 2024)
  grpo_no_std  A_i =  r_i - mean_g                          (no scale normalisation)
  dr_grpo      A_i =  r_i - mean_g                          (Liu et al., 2025; with
                                                             the ``seq_sum_norm``
                                                             aggregation, losses.py)
  rloo         A_i =  r_i - (1/(G-1)) Σ_{j≠i} r_j = G/(G-1) (r_i - mean_g)
                                                            (Ahmadian et al., 2024)

An estimator may bring its loss aggregation (``PAIRED_AGGREGATIONS``: Dr. GRPO's
constant normaliser is half of its fix): `default_aggregation` is what the learner uses
when the recipe sets none; the others default to ``token_mean``.

Degenerate groups give zero advantage (no gradient): all-equal rewards (every
estimator), and a single response (``G = 1``; RLOO has no leave-one-out baseline).

Shape legend: B prompts, G group size.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

AdvantageFn = Callable[[np.ndarray, float], np.ndarray]  # (r[B, G], ε) -> A[B, G]

PAIRED_AGGREGATIONS: dict[str, str] = {"dr_grpo": "seq_sum_norm"}  # losses.AGGREGATIONS
DEFAULT_AGGREGATION = "token_mean"


def _centered(r: np.ndarray) -> np.ndarray:
  return r - r.mean(axis=1, keepdims=True)


def grpo(r: np.ndarray, eps: float) -> np.ndarray:
  return _centered(r) / (r.std(axis=1, keepdims=True) + eps)


def grpo_no_std(r: np.ndarray, eps: float) -> np.ndarray:
  del eps
  return _centered(r)


def rloo(r: np.ndarray, eps: float) -> np.ndarray:
  del eps
  G = r.shape[1]
  if G == 1:
    return np.zeros_like(r)
  return _centered(r) * (G / (G - 1))


ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo,
    "grpo_no_std": grpo_no_std,
    "dr_grpo": grpo_no_std,
    "rloo": rloo,
}


def default_aggregation(name: str) -> str:
  """The loss aggregation of the estimator ``name`` when the recipe sets none."""
  return PAIRED_AGGREGATIONS.get(name, DEFAULT_AGGREGATION)


def compute_advantages(name: str, rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
  """``A[B, G]`` (float32) of ``rewards[B, G]`` under the estimator ``name``."""
  if name not in ADVANTAGES:
    raise KeyError(f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGES)}")
  r = np.asarray(rewards, np.float64)
  if r.ndim != 2:
    raise ValueError(f"rewards must be [B, G], got shape {r.shape}")
  return ADVANTAGES[name](r, eps).astype(np.float32)
