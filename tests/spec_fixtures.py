"""The speculative-decoding tests' shared setup: a tiny HF-built target, engines over
it, and a greedy request set with shared motifs (n-gram matches) and EOS finishes."""

from __future__ import annotations

import numpy as np

from spec_rl_jax.models import hf_io
from spec_rl_jax.rollout.engine import RolloutEngine
from spec_rl_jax.rollout.types import EngineConfig, Request
from spec_rl_jax.sampling import SamplingParams
from tests import hf_fixtures

V = 96  # hf_fixtures' vocabulary
GREEDY = SamplingParams(temperature=0.0)


def build_target(directory: str):
  """The tiny tied Qwen3 target every engine-level exactness test uses."""
  hf_fixtures.build("qwen3", directory, tie=True, seed=1)
  return hf_io.load_hf_checkpoint(directory, load_tokenizer=False)[0]


def engine(target, proposer, K, slots, **kw) -> RolloutEngine:
  """A paged engine of ``slots`` slots drafting up to ``K`` tokens (``kw`` overrides)."""
  cfg = dict(num_slots=slots, page_size=8, num_pages=160, max_seq_len=96, max_new_tokens=24,
             max_draft_tokens=K)
  cfg.update(kw)
  return RolloutEngine(target, EngineConfig(**cfg), proposer=proposer)


def prompts(n: int, seed: int) -> list[list[int]]:
  """Prompts of 4-28 tokens sharing one repeated motif, so n-grams find matches."""
  rng = np.random.default_rng(seed)
  base = rng.integers(1, V, 6).tolist()
  return [(base * 3)[: rng.integers(3, 18)] + rng.integers(1, V, rng.integers(1, 12)).tolist()
          for _ in range(n)]


GREEDY_REQS = [Request(p, i, group_id=i % 3) for i, p in enumerate(prompts(9, seed=1))]
