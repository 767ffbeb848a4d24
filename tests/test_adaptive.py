"""The adaptive draft-length controller (spec/adaptive.py): its choices on synthetic
statistics, bad timings, and exactness while it changes k between calls."""

import math

import numpy as np
import pytest
from flax import nnx

from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.transformer import init_decoder
from spec_rl_jax.rollout.engine import RolloutEngine
from spec_rl_jax.rollout.types import EngineConfig, Request
from spec_rl_jax.sampling import SamplingParams
from spec_rl_jax.spec.adaptive import AdaptiveK
from spec_rl_jax.spec.controller import CallShape, CallStats
from spec_rl_jax.spec.proposers.draft_model import DraftModelConfig, DraftModelProposer

SHAPE = CallShape(running=8, slots=8, pages=4)


def _drive(controller, calls, alpha, cost, shape=SHAPE, slot_rounds=64):
  """``calls`` decode calls of a synthetic engine: position ``i`` is accepted with
  probability ``alpha(call)^(i+1)`` (its expectation, so no noise) and a round with ``k``
  drafts takes ``cost(k)`` seconds. Returns the chosen ``k`` per call."""
  chosen = []
  for t in range(calls):
    k = controller.choose(shape)
    chosen.append(k)
    a = alpha(t) if callable(alpha) else alpha
    accepted = slot_rounds * a ** np.arange(1, k + 1)
    rounds = 8
    controller.observe(CallStats(k, shape.slots, shape.pages, rounds, slot_rounds, accepted,
                                 rounds * cost(k), first_call=t == 0))
  return chosen


def test_cheap_verification_and_high_acceptance_draft_the_most():
  c = AdaptiveK(4)
  chosen = _drive(c, 40, alpha=0.9, cost=lambda k: 1.0 + 0.05 * k)
  assert c.k == 4 and chosen[-8:].count(4) >= 7  # one call in 8 explores a neighbour


def test_expensive_verification_turns_drafting_off():
  c = AdaptiveK(4)
  chosen = _drive(c, 40, alpha=0.5, cost=lambda k: 1.0 + 1.0 * k)
  assert c.k == 0 and chosen[-8:].count(0) >= 7


def test_the_best_k_in_between_is_found():
  """E(k)/c(k) with alpha 0.7 and cost 1 + 0.3k peaks at k = 2 (2.19/1.6 = 1.37, against
  1.31 at k = 1 and 1.33 at k = 3)."""
  c = AdaptiveK(4)
  _drive(c, 60, alpha=0.7, cost=lambda k: 1.0 + 0.3 * k)
  assert c.k == 2
  assert c.acceptance()[:3] == pytest.approx([0.7, 0.49, 0.343], rel=0.02)


def test_a_sudden_acceptance_drop_lowers_k_within_a_few_calls():
  c = AdaptiveK(4)
  chosen = _drive(c, 60, alpha=lambda t: 0.95 if t < 30 else 0.1,
                  cost=lambda k: 1.0 + 0.2 * k)
  assert chosen[29] == 4
  # The decayed sums (decay 0.8 per call) forget the old rate within about 12 calls.
  assert max(chosen[42:]) <= 1
  assert c.k == 0


def test_explorations_that_change_nothing_grow_rarer():
  c = AdaptiveK(4, explore_every=4, max_explore_gap=32)
  _drive(c, 200, alpha=0.9, cost=lambda k: 1.0 + 0.05 * k)
  # Explorations at calls 4, 8, 16, 32, 64, then every 32 calls.
  assert c.stats["explored"] == 9


def test_bad_timings_are_ignored_and_counted():
  c = AdaptiveK(3)
  _drive(c, 10, alpha=0.9, cost=lambda k: 1.0 + 0.05 * k)
  before = c.costs(SHAPE).copy()
  for seconds in (0.0, -1.0, math.nan, math.inf):
    k = c.choose(SHAPE)
    c.observe(CallStats(k, SHAPE.slots, SHAPE.pages, 8, 64, np.full((k,), 50.0), seconds))
  assert c.stats["ignored_timings"] == 4
  after = c.costs(SHAPE)
  assert np.all(np.isfinite(after)) and np.allclose(after, before)
  assert 0 <= c.choose(SHAPE) <= 3


def test_unmeasured_shapes_use_the_fitted_cost_model():
  """Costs measured at 8 slots predict another slot bucket through the least-squares
  model: drafting is cheap at 8 slots, expensive at 64 (cost 0.1 + 0.02·S·(k+1))."""
  c = AdaptiveK(4, explore_every=2, max_explore_gap=2)
  cost = lambda S: lambda k: 0.1 + 0.02 * S * (k + 1)
  _drive(c, 40, alpha=0.7, cost=cost(2), shape=CallShape(2, 2, 4))
  _drive(c, 40, alpha=0.7, cost=cost(8), shape=SHAPE)
  np.testing.assert_allclose(c.costs(CallShape(64, 64, 4)), [cost(64)(k) for k in range(5)],
                             rtol=0.05)
  c.choose(CallShape(64, 64, 4))
  assert c.k == 0


def test_bad_setups_are_rejected():
  with pytest.raises(ValueError, match="max_draft_tokens >= 1"):
    AdaptiveK(0)
  with pytest.raises(ValueError, match="decay"):
    AdaptiveK(2, decay=0.0)


@pytest.mark.slow
def test_greedy_exact_while_k_changes_and_the_draft_catches_up():
  """Exploring every other call makes k change between calls, through 0 and back: greedy
  SD equals AR, and the draft model re-prefills what it missed (an identical draft
  then accepts everything)."""
  cfg = get_preset("tiny-qwen3")
  policy = init_decoder(cfg, seed=3)
  rng = np.random.default_rng(0)
  reqs = [Request(rng.integers(1, cfg.vocab_size, int(n)).tolist(), i)
          for i, n in enumerate(rng.integers(2, 9, 6))]
  ec = dict(num_slots=4, page_size=8, num_pages=64, max_seq_len=48, max_new_tokens=16,
            round_budget=2, sampling=SamplingParams(0.0))
  ar = RolloutEngine(policy, EngineConfig(**ec)).generate(reqs)
  copy = nnx.merge(nnx.graphdef(policy), nnx.state(policy))
  engine = RolloutEngine(policy, EngineConfig(**ec, max_draft_tokens=3),
                         proposer=DraftModelProposer(DraftModelConfig(), copy),
                         controller=AdaptiveK(3, explore_every=2, max_explore_gap=2))
  sd = engine.generate(reqs)
  assert [r.tokens for r in sd.responses] == [r.tokens for r in ar.responses]
  m = sd.metrics
  assert 0 in m["rounds_at_k"] and len(m["rounds_at_k"]) >= 2 and m["resyncs"] > 0
  assert m["accepted_tokens"] == m["drafted_tokens"] > 0
  c = m["controller"]
  assert c["explored"] > 0 and c["slot_rounds"] > 0
  assert c["realised_tokens"] / c["slot_rounds"] >= 1.0


def test_plain_calls_of_a_sibling_reading_proposer_run_only_the_busy_slots():
  """n-gram drafts read other slots' rows, so its speculative calls run every slot; its
  k = 0 calls need no drafts and run the busy leading slots, as AR does."""
  from spec_rl_jax.spec.controller import FixedK
  from spec_rl_jax.spec.proposers import build_proposer
  cfg = get_preset("tiny-qwen3")
  policy = init_decoder(cfg, seed=3)
  reqs = [Request([5, 6, 7, i + 1], i) for i in range(2)]
  ec = EngineConfig(num_slots=16, page_size=8, num_pages=64, max_seq_len=48,
                    max_new_tokens=8, sampling=SamplingParams(0.0), max_draft_tokens=2)
  runs = {}
  for k in (0, 2):
    engine = RolloutEngine(policy, ec, proposer=build_proposer("ngram", policy),
                           controller=FixedK(2, k))
    runs[k] = [r.tokens for r in engine.generate(reqs).responses]
    assert {s for _, s, _ in engine.decode_shapes} == ({4} if k == 0 else {16})
  assert runs[0] == runs[2]
