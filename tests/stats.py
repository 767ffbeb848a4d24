"""Statistics the exactness tests share: exact laws by teacher forcing, chi-square and
total-variation goodness of fit at p = 0.001."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import jax.numpy as jnp
import numpy as np

from spec_rl_jax.sampling import SamplingParams, process_logits

Z_0001 = 3.09  # one-sided normal quantile of p = 0.001


def chi2_quantile(df: int, z: float = Z_0001) -> float:
  """Wilson–Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
  return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(counts: np.ndarray, probs: np.ndarray, outside: int = 0) -> tuple[float, int]:
  """Chi-square of ``counts[C]`` against ``probs[C]`` over cells with expected count
  >= 5, the rest pooled into one cell. ``outside`` samples fell outside every cell: they
  join the pooled cell, and make the statistic infinite when that cell expects none."""
  n = counts.sum() + outside
  exp = n * np.asarray(probs, np.float64)
  big = exp >= 5
  obs_c = np.append(counts[big], counts[~big].sum() + outside)
  exp_c = np.append(exp[big], exp[~big].sum())
  keep = exp_c > 0
  stat = float((((obs_c - exp_c) ** 2)[keep] / exp_c[keep]).sum())
  if outside and not exp[~big].sum():
    stat = math.inf
  return stat, int(keep.sum()) - 1


def exact_joint(model, prompt: Sequence[int], params: SamplingParams,
                depth: int) -> dict[tuple[int, ...], float]:
  """``{token tuple: probability}`` of the first ``depth`` sampled tokens after
  ``prompt``, enumerated by teacher forcing: one batched forward of ``model`` per depth
  over every prefix in the support (float64 products)."""
  out = {(): 1.0}
  for _ in range(depth):
    prefixes = list(out)
    seq = jnp.asarray([list(prompt) + list(prefix) for prefix in prefixes])  # [N, T]
    positions = jnp.broadcast_to(jnp.arange(seq.shape[1]), seq.shape)
    logits = model(seq, positions).logits[:, -1]  # [N, V]
    p = np.exp(np.asarray(process_logits(logits, params), np.float64))
    out = {prefix + (int(t),): out[prefix] * p[i, t]
           for i, prefix in enumerate(prefixes) for t in np.flatnonzero(p[i] > 0)}
  return out


def goodness_of_fit(exact: dict[tuple[int, ...], float],
                    samples: Iterable[Sequence[int]]) -> dict[str, float]:
  """Samples (token sequences) against the exact joint law: ``chi2`` with its p = 0.001
  threshold ``chi2_max``; total variation ``tv`` with ``tv_max`` = 1.5x its expected
  value under the null, plus 0.005; ``outside``: samples outside the law's support."""
  cells = sorted(exact)
  index = {c: i for i, c in enumerate(cells)}
  counts = np.zeros(len(cells))
  outside = 0
  for s in samples:
    i = index.get(tuple(s))
    if i is None:
      outside += 1
    else:
      counts[i] += 1
  p = np.asarray([exact[c] for c in cells])
  n = counts.sum() + outside
  chi2, df = chi2_stat(counts, p, outside)
  tv = 0.5 * (np.abs(counts / n - p).sum() + outside / n)
  tv_null = 0.5 * np.sum(np.sqrt(2 * p * (1 - p) / (math.pi * n)))
  return dict(chi2=chi2, chi2_max=chi2_quantile(df), tv=float(tv),
              tv_max=float(1.5 * tv_null + 0.005), outside=outside)
